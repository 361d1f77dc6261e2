// bench.mjs: sandgate's model API proxy next to its peers (LiteLLM proxy,
// Portkey's gateway), in one run on one machine (issue 24, part 3).
//
// Three processes at a time: the mock upstream (mock.mjs: the unchanged
// tests/e2e/fixtures/mock_model_server.mjs, OpenAI chat completions), one
// proxy in front of it, and this process, the load generator (node:http,
// keep-alive agents, 127.0.0.1 only). The proxies run one after another,
// never together, and each is measured the same way:
//   - added latency: the same request straight to the mock and through the
//     proxy; non-streaming is send to whole body, streaming is send to the
//     first body bytes (time to first byte). 1 client: direct and proxied
//     requests alternate on one client, model latency 20 ms. 64 clients:
//     64 concurrent clients straight to the mock, then 64 through the proxy,
//     starts staggered over the model latency (500 ms) so it is steady
//     concurrency, not one burst. Added = p(proxied) - p(direct).
//   - throughput at saturation: 64 clients, model latency 0, non-streaming,
//     for a fixed time; requests/s completed with 200.
//   - CPU seconds per 10k requests (utime + stime of the proxy's process
//     tree over the saturation phase) and RSS (the tree's VmRSS idle, after
//     load, and the sum of VmHWM).
// Every phase is bounded in requests and time; the whole run has a deadline.
// Writes JSON to argv[2] and a Markdown table to argv[3].
//
// Environment: SANDGATE_BIN, SANDGATE_TEMPLATES_DIR, LITELLM_BIN (the venv's
// litellm), PEERS (comma list, default sandgate,litellm,portkey), QUICK=1
// (a few requests per phase, to check the harness).
import http from 'node:http';
import net from 'node:net';
import { spawn, execFileSync } from 'node:child_process';
import { mkdtempSync, writeFileSync, readFileSync, readdirSync, rmSync, existsSync } from 'node:fs';
import { tmpdir, cpus, totalmem } from 'node:os';
import { join, dirname } from 'node:path';
import { fileURLToPath } from 'node:url';
import { randomBytes } from 'node:crypto';

const HERE = dirname(fileURLToPath(import.meta.url));
const [outJson, outMd] = process.argv.slice(2);
if (!outJson || !outMd) {
  console.error('usage: node bench.mjs OUT.json OUT.md');
  process.exit(2);
}
const QUICK = process.env.QUICK === '1';
const PEERS = (process.env.PEERS || 'sandgate,litellm,portkey').split(',').filter(Boolean);
const UPSTREAM_KEY = 'sk-mock-upstream-0123456789';
const LITELLM_MASTER_KEY = 'sk-litellm-bench-master';

const CFG = {
  c1: { clients: 1, modelMs: 20, pairs: QUICK ? 10 : 250 },
  c64: { clients: 64, modelMs: 500, perClient: QUICK ? 1 : 8 },
  sat: { clients: 64, modelMs: 0, seconds: QUICK ? 1 : 8 },
  warmup: { clients: 8, requests: QUICK ? 16 : 400 },
  requestTimeoutMs: 30_000,
  phaseDeadlineMs: 120_000,
  runDeadlineMs: 20 * 60_000,
};

const children = new Set();
function killAll() {
  for (const c of children) {
    try { c.kill('SIGKILL'); } catch {}
  }
}
const runDeadline = setTimeout(() => {
  console.error(`bench: run deadline of ${CFG.runDeadlineMs / 1000} s passed; stopping`);
  killAll();
  process.exit(1);
}, CFG.runDeadlineMs);
runDeadline.unref();
process.on('SIGINT', () => { killAll(); process.exit(130); });
process.on('SIGTERM', () => { killAll(); process.exit(143); });

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const log = (...a) => console.error(new Date().toISOString().slice(11, 19), ...a);

// ---- processes ------------------------------------------------------------

function track(proc, name) {
  children.add(proc);
  proc.on('exit', () => children.delete(proc));
  proc.name = name;
  return proc;
}

async function freePort() {
  const s = net.createServer();
  await new Promise((r) => s.listen(0, '127.0.0.1', r));
  const { port } = s.address();
  await new Promise((r) => s.close(r));
  return port;
}

async function stopProc(proc, ms = 10_000) {
  if (proc.exitCode !== null || proc.signalCode !== null) return;
  const exited = new Promise((r) => proc.once('exit', r));
  proc.kill('SIGTERM');
  if (await Promise.race([exited.then(() => true), sleep(ms).then(() => false)])) return;
  proc.kill('SIGKILL');
  await exited;
}

// Waits until a proxied non-streaming request answers 200.
async function waitReady(target, proc, seconds) {
  const end = Date.now() + seconds * 1000;
  let last = '';
  while (Date.now() < end) {
    if (proc.exitCode !== null) throw new Error(`${proc.name} exited with ${proc.exitCode}: ${proc.output ?? ''}`);
    const r = await once(target, false);
    if (r.ok) return;
    last = r.error ?? `HTTP ${r.status}: ${r.body?.slice(0, 300)}`;
    await sleep(250);
  }
  throw new Error(`${proc.name} not ready after ${seconds} s: ${last}\n${(proc.output ?? '').slice(-2000)}`);
}

function keepOutput(proc) {
  proc.output = '';
  const add = (c) => { proc.output = (proc.output + c).slice(-20000); };
  proc.stdout?.on('data', add);
  proc.stderr?.on('data', add);
}

async function startMock() {
  const proc = track(spawn(process.execPath, [join(HERE, 'mock.mjs')], {
    stdio: ['ignore', 'inherit', 'inherit', 'ipc'],
    env: { ...process.env, MOCK_API_KEY: UPSTREAM_KEY },
  }), 'mock');
  const port = await new Promise((resolve, reject) => {
    proc.once('message', (m) => resolve(m.port));
    proc.once('exit', (c) => reject(new Error(`mock exited with ${c}`)));
  });
  return {
    proc,
    port,
    url: `http://127.0.0.1:${port}`,
    setLatency(ms) {
      return new Promise((resolve) => {
        proc.once('message', resolve);
        proc.send({ latencyMs: ms });
      });
    },
  };
}

async function startSandgate(mock) {
  const bin = process.env.SANDGATE_BIN;
  const templates = process.env.SANDGATE_TEMPLATES_DIR;
  const dir = mkdtempSync(join(tmpdir(), 'llm-peers-sandgate-'));
  const keyFile = join(dir, 'upstream.key');
  writeFileSync(keyFile, UPSTREAM_KEY + '\n', { mode: 0o600 });
  const data = join(dir, 'data');
  const proc = track(spawn(bin, ['serve', '--listen', '127.0.0.1:0', '--data-dir', data,
    '--templates-dir', templates, '--cgroup-parent', 'sgtest-' + randomBytes(4).toString('hex'),
    // No rate limits, as the peers have none configured (the defaults would
    // refuse most saturation requests with 429); the same flags as
    // tests/bench/llm_proxy_bench.cpp.
    '--log-level', 'warn', '--keep-sandboxes', 'off', '--rate', '0', '--create-rate', '0', '--llm-rate', '0', '--llm-tokens-per-min', '0',
    '--openai-base-url', mock.url, '--openai-key-file', keyFile],
  { stdio: ['ignore', 'pipe', 'pipe'] }), 'sandgate');
  keepOutput(proc);
  const url = await new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error('sandgate did not start: ' + proc.output)), 60_000);
    proc.once('exit', (c) => reject(new Error(`sandgate exited with ${c}: ${proc.output}`)));
    const check = () => {
      const m = /listening on (http:\/\/[0-9.:]+)/.exec(proc.output);
      if (m) { clearTimeout(timer); resolve(m[1]); }
    };
    proc.stdout.on('data', check);
  });
  const vkey = execFileSync(bin, ['llm', 'key', 'create', 'local', '--name', 'bench', '--data-dir', data],
    { encoding: 'utf8' }).trim();
  if (!/^sk-sg-[0-9a-f]{48}$/.test(vkey)) throw new Error(`unexpected virtual key: ${vkey}`);
  const port = Number(new URL(url).port);
  return {
    proc,
    target: makeTarget('sandgate', port, '/v1/chat/completions', { authorization: `Bearer ${vkey}` }),
    version: execFileSync(bin, ['version'], { encoding: 'utf8' }).trim(),
    cleanup: () => rmSync(dir, { recursive: true, force: true }),
  };
}

async function startLitellm(mock) {
  const bin = process.env.LITELLM_BIN;
  const dir = mkdtempSync(join(tmpdir(), 'llm-peers-litellm-'));
  const cfg = join(dir, 'config.yaml');
  writeFileSync(cfg, [
    'model_list:',
    '  - model_name: mock-gpt',
    '    litellm_params:',
    '      model: openai/mock-gpt',
    `      api_base: ${mock.url}/v1`,
    `      api_key: ${UPSTREAM_KEY}`,
    'litellm_settings:',
    '  telemetry: false',
    '  set_verbose: false',
    'general_settings:',
    `  master_key: ${LITELLM_MASTER_KEY}`,
    '',
  ].join('\n'));
  const port = await freePort();
  const proc = track(spawn(bin, ['--config', cfg, '--host', '127.0.0.1', '--port', String(port),
    '--num_workers', '1'], {
    stdio: ['ignore', 'pipe', 'pipe'],
    cwd: dir,
    env: {
      ...process.env,
      LITELLM_LOCAL_MODEL_COST_MAP: 'True',
      LITELLM_LOG: 'ERROR',
      LITELLM_TELEMETRY: 'False',
      DISABLE_ADMIN_UI: 'True',
      NO_DOCS: 'True',
      NO_PROXY: '127.0.0.1,localhost',
    },
  }), 'litellm');
  keepOutput(proc);
  const target = makeTarget('litellm', port, '/v1/chat/completions', { authorization: `Bearer ${LITELLM_MASTER_KEY}` });
  await waitReady(target, proc, 180);
  return { proc, target, cleanup: () => rmSync(dir, { recursive: true, force: true }) };
}

async function startPortkey(mock) {
  const port = await freePort();
  const proc = track(spawn(process.execPath, [join(HERE, 'portkey.mjs'), `--port=${port}`, '--headless'], {
    stdio: ['ignore', 'pipe', 'pipe'],
    cwd: HERE,
    env: { ...process.env, NODE_ENV: 'production' },
  }), 'portkey');
  keepOutput(proc);
  const target = makeTarget('portkey', port, '/v1/chat/completions', {
    authorization: `Bearer ${UPSTREAM_KEY}`,
    'x-portkey-provider': 'openai',
    'x-portkey-custom-host': `${mock.url}/v1`,
  });
  await waitReady(target, proc, 60);
  return { proc, target, cleanup: () => {} };
}

const STARTERS = { sandgate: startSandgate, litellm: startLitellm, portkey: startPortkey };

// ---- /proc accounting -----------------------------------------------------

const CLK_TCK = Number(execFileSync('getconf', ['CLK_TCK'], { encoding: 'utf8' }).trim());

function procStat(pid) {
  try {
    const s = readFileSync(`/proc/${pid}/stat`, 'utf8');
    const f = s.slice(s.lastIndexOf(')') + 2).split(' ');
    return { ppid: Number(f[1]), ticks: Number(f[11]) + Number(f[12]) };
  } catch {
    return null;
  }
}

// The process and all its descendants, at this moment.
function tree(root) {
  const kids = new Map();
  for (const d of readdirSync('/proc')) {
    if (!/^\d+$/.test(d)) continue;
    const st = procStat(d);
    if (!st) continue;
    if (!kids.has(st.ppid)) kids.set(st.ppid, []);
    kids.get(st.ppid).push(Number(d));
  }
  const out = [];
  const stack = [root];
  while (stack.length) {
    const p = stack.pop();
    out.push(p);
    stack.push(...(kids.get(p) ?? []));
  }
  return out;
}

function statusKiB(pid, field) {
  try {
    const m = new RegExp(`^${field}:\\s+(\\d+) kB`, 'm').exec(readFileSync(`/proc/${pid}/status`, 'utf8'));
    return m ? Number(m[1]) : 0;
  } catch {
    return 0;
  }
}

function usage(root) {
  const pids = tree(root);
  let ticks = 0, rss = 0, hwm = 0;
  for (const p of pids) {
    ticks += procStat(p)?.ticks ?? 0;
    rss += statusKiB(p, 'VmRSS');
    hwm += statusKiB(p, 'VmHWM');
  }
  return { processes: pids.length, cpu_s: ticks / CLK_TCK, rss_mib: rss / 1024, hwm_mib: hwm / 1024 };
}

// ---- load generator ---------------------------------------------------------

const BODY = JSON.stringify({ model: 'mock-gpt', messages: [{ role: 'user', content: 'Say hello to the benchmark.' }] });
const BODY_STREAM = JSON.stringify({ model: 'mock-gpt', messages: [{ role: 'user', content: 'Say hello to the benchmark.' }], stream: true });

function makeTarget(name, port, path, headers) {
  return { name, port, path, headers, agent: new http.Agent({ keepAlive: true, maxSockets: Infinity, scheduling: 'lifo' }) };
}

// One request. Non-streaming: ok when 200 with a `choices` body; streaming:
// ok when 200 and the stream ends with `data: [DONE]`. ttfb is to the first
// body bytes, total to the end of the body (ms).
function once(target, stream) {
  return new Promise((resolve) => {
    const body = stream ? BODY_STREAM : BODY;
    let done = false;
    const finish = (r) => { if (!done) { done = true; resolve(r); } };
    const t0 = performance.now();
    const req = http.request({
      host: '127.0.0.1', port: target.port, path: target.path, method: 'POST', agent: target.agent,
      headers: { ...target.headers, 'content-type': 'application/json', 'content-length': Buffer.byteLength(body) },
    }, (res) => {
      let first = 0;
      let text = '';
      res.setEncoding('utf8');
      res.on('data', (c) => {
        if (!first) first = performance.now();
        text = stream ? (text + c).slice(-256) : text + c;
      });
      res.on('end', () => {
        const end = performance.now();
        const ok = res.statusCode === 200 && (stream ? /data: \[DONE\]\s*$/.test(text) : text.includes('"choices"'));
        finish({ ok, status: res.statusCode, ttfb: first - t0, total: end - t0, body: ok ? undefined : text });
      });
      res.on('error', (e) => finish({ ok: false, error: e.message }));
    });
    req.setTimeout(CFG.requestTimeoutMs, () => req.destroy(new Error('request timeout')));
    req.on('error', (e) => finish({ ok: false, error: e.message }));
    req.end(body);
  });
}

function pct(sorted, p) {
  if (!sorted.length) return null;
  const i = Math.min(sorted.length - 1, Math.max(0, Math.ceil((p / 100) * sorted.length) - 1));
  return sorted[i];
}

function summary(samples) {
  const s = [...samples].sort((a, b) => a - b);
  const r3 = (x) => (x === null ? null : Math.round(x * 1000) / 1000);
  return { n: s.length, p50_ms: r3(pct(s, 50)), p99_ms: r3(pct(s, 99)), mean_ms: r3(s.reduce((a, b) => a + b, 0) / (s.length || 1)) };
}

function metric(r, stream) { return stream ? r.ttfb : r.total; }

// 1 client: direct and proxied requests alternate (which goes first flips
// every pair), one request in flight at a time.
async function alternating(direct, proxied, pairs, stream) {
  const d = [], p = [];
  const errors = { direct: 0, proxied: 0 };
  const end = Date.now() + CFG.phaseDeadlineMs;
  for (let k = 0; k < pairs && Date.now() < end; k++) {
    for (const which of k % 2 ? ['p', 'd'] : ['d', 'p']) {
      const r = await once(which === 'd' ? direct : proxied, stream);
      if (!r.ok) { errors[which === 'd' ? 'direct' : 'proxied']++; continue; }
      (which === 'd' ? d : p).push(metric(r, stream));
    }
  }
  return { d, p, errors };
}

// `clients` concurrent clients, each making `perClient` requests one after
// another, starts spread over `staggerMs`.
async function concurrent(target, clients, perClient, stream, staggerMs) {
  const samples = [];
  let errors = 0;
  const end = Date.now() + CFG.phaseDeadlineMs;
  await Promise.all(Array.from({ length: clients }, async (_, i) => {
    await sleep((i * staggerMs) / clients);
    for (let k = 0; k < perClient && Date.now() < end; k++) {
      const r = await once(target, stream);
      if (r.ok) samples.push(metric(r, stream)); else errors++;
    }
  }));
  return { samples, errors };
}

// `clients` clients as fast as they can for `seconds`.
async function saturate(target, clients, seconds) {
  let ok = 0, errors = 0;
  const why = {};
  const t0 = performance.now();
  const end = t0 + seconds * 1000;
  let last = t0;
  await Promise.all(Array.from({ length: clients }, async () => {
    while (performance.now() < end) {
      const r = await once(target, false);
      if (r.ok) ok++;
      else {
        errors++;
        const k = r.error ?? `HTTP ${r.status}: ${(r.body ?? '').slice(0, 160)}`;
        why[k] = (why[k] ?? 0) + 1;
      }
      last = performance.now();
    }
  }));
  const elapsed = (last - t0) / 1000;
  return { ok, errors, error_kinds: why, seconds: Math.round(elapsed * 1000) / 1000, rps: Math.round((ok / elapsed) * 10) / 10 };
}

function added(direct, proxied) {
  const r3 = (x) => Math.round(x * 1000) / 1000;
  return {
    added_p50_ms: r3(proxied.p50_ms - direct.p50_ms),
    added_p99_ms: r3(proxied.p99_ms - direct.p99_ms),
    direct,
    proxied,
  };
}

async function measure(name, mock, direct) {
  log(`${name}: starting`);
  const started = performance.now();
  const peer = await STARTERS[name](mock);
  const startSeconds = Math.round((performance.now() - started) / 10) / 100;
  const pid = peer.proc.pid;
  const out = { start_s: startSeconds };
  if (peer.version) out.version = peer.version;
  const t = peer.target;
  const totalBefore = usage(pid);
  let proxiedRequests = 0;

  await mock.setLatency(0);
  for (const stream of [false, true]) {
    const w = await concurrent(t, CFG.warmup.clients, CFG.warmup.requests / CFG.warmup.clients, stream, 0);
    if (w.errors) throw new Error(`${name}: ${w.errors} errors in warm-up (stream=${stream})`);
    proxiedRequests += w.samples.length;
  }
  out.rss_idle_mib = Math.round(usage(pid).rss_mib * 10) / 10;
  out.latency = {};
  out.errors = {};

  await mock.setLatency(CFG.c1.modelMs);
  for (const stream of [false, true]) {
    const key = stream ? 'stream_ttfb_c1' : 'nonstream_c1';
    log(`${name}: ${key}`);
    const r = await alternating(direct, t, CFG.c1.pairs, stream);
    proxiedRequests += r.p.length;
    out.latency[key] = added(summary(r.d), summary(r.p));
    out.errors[key] = r.errors;
  }

  await mock.setLatency(CFG.c64.modelMs);
  for (const stream of [false, true]) {
    const key = stream ? 'stream_ttfb_c64' : 'nonstream_c64';
    log(`${name}: ${key}`);
    const d = await concurrent(direct, CFG.c64.clients, CFG.c64.perClient, stream, CFG.c64.modelMs);
    const p = await concurrent(t, CFG.c64.clients, CFG.c64.perClient, stream, CFG.c64.modelMs);
    proxiedRequests += p.samples.length;
    out.latency[key] = added(summary(d.samples), summary(p.samples));
    out.errors[key] = { direct: d.errors, proxied: p.errors };
  }

  await mock.setLatency(CFG.sat.modelMs);
  log(`${name}: saturation`);
  const before = usage(pid);
  const sat = await saturate(t, CFG.sat.clients, CFG.sat.seconds);
  const after = usage(pid);
  proxiedRequests += sat.ok;
  out.saturation = sat;
  out.cpu_s_per_10k = Math.round(((after.cpu_s - before.cpu_s) / sat.ok) * 1e4 * 100) / 100;
  out.cpu_s_saturation = Math.round((after.cpu_s - before.cpu_s) * 100) / 100;
  out.cpu_s_per_10k_whole_run = Math.round(((after.cpu_s - totalBefore.cpu_s) / proxiedRequests) * 1e4 * 100) / 100;
  out.requests_proxied = proxiedRequests;
  out.rss_after_load_mib = Math.round(after.rss_mib * 10) / 10;
  out.rss_peak_mib = Math.round(after.hwm_mib * 10) / 10;
  out.processes = after.processes;
  await stopProc(peer.proc);
  peer.cleanup();
  log(`${name}: done`, JSON.stringify({ sat: sat.rps, cpu: out.cpu_s_per_10k, rss: out.rss_after_load_mib }));
  return out;
}

// ---- report -----------------------------------------------------------------

function sh(cmd, args) {
  try { return execFileSync(cmd, args, { encoding: 'utf8' }).trim(); } catch { return null; }
}

function machine() {
  const cpuinfo = readFileSync('/proc/cpuinfo', 'utf8');
  const meminfo = readFileSync('/proc/meminfo', 'utf8');
  const osRelease = existsSync('/etc/os-release') ? readFileSync('/etc/os-release', 'utf8') : '';
  return {
    nproc: Number(sh('nproc', [])),
    cpu_model: /^model name\s*:\s*(.*)$/m.exec(cpuinfo)?.[1] ?? null,
    mem_total_kib: Number(/^MemTotal:\s+(\d+)/m.exec(meminfo)?.[1]),
    kernel: sh('uname', ['-r']),
    os: /^PRETTY_NAME="?([^"\n]*)"?/m.exec(osRelease)?.[1] ?? null,
    node: process.version,
  };
}

function versions() {
  const pkg = (p) => { try { return JSON.parse(readFileSync(join(HERE, 'node_modules', p, 'package.json'), 'utf8')).version; } catch { return null; } };
  const py = process.env.LITELLM_BIN ? join(dirname(process.env.LITELLM_BIN), 'python') : null;
  return {
    sandgate_git: sh('git', ['-C', HERE, 'describe', '--always', '--dirty']),
    sandgate_build: process.env.SANDGATE_BUILD_TYPE ?? null,
    litellm: py ? sh(py, ['-c', 'import importlib.metadata as m; print(m.version("litellm"))']) : null,
    litellm_python: py ? sh(py, ['-c', 'import platform; print(platform.python_version())']) : null,
    litellm_uvicorn: py ? sh(py, ['-c', 'import importlib.metadata as m; print(m.version("uvicorn"))']) : null,
    portkey_gateway: pkg('@portkey-ai/gateway'),
    hono_node_server: pkg('@hono/node-server'),
    node: process.version,
  };
}

const LABEL = { sandgate: 'sandgate', litellm: 'LiteLLM proxy', portkey: 'Portkey gateway' };
const f2 = (x) => (x === null || x === undefined ? 'n/a' : x.toFixed(2));

function markdown(report) {
  const names = Object.keys(report.proxies);
  const col = (fn) => names.map((n) => fn(report.proxies[n])).join(' | ');
  const lat = (key) => (p) => `${f2(p.latency[key].added_p50_ms)} / ${f2(p.latency[key].added_p99_ms)} ms`;
  const m = report.machine;
  const v = report.versions;
  const lines = [
    `| added latency p50 / p99 | ${names.map((n) => LABEL[n] + (n === 'sandgate' ? '' : ` ${n === 'litellm' ? v.litellm : v.portkey_gateway}`)).join(' | ')} |`,
    `| --- | ${names.map(() => '---').join(' | ')} |`,
    `| non-streaming, 1 client (20 ms model) | ${col(lat('nonstream_c1'))} |`,
    `| streaming time to first byte, 1 client | ${col(lat('stream_ttfb_c1'))} |`,
    `| non-streaming, 64 clients (500 ms model) | ${col(lat('nonstream_c64'))} |`,
    `| streaming time to first byte, 64 clients | ${col(lat('stream_ttfb_c64'))} |`,
    `| throughput at saturation, 64 clients, 0 ms model | ${col((p) => `${Math.round(p.saturation.rps)} req/s`)} |`,
    `| CPU seconds per 10k requests (at saturation) | ${col((p) => `${f2(p.cpu_s_per_10k)} s`)} |`,
    `| RSS idle / after load | ${col((p) => `${Math.round(p.rss_idle_mib)} / ${Math.round(p.rss_after_load_mib)} MiB`)} |`,
  ];
  const d = report.direct_saturation;
  const offered = (CFG.c64.clients * 1000) / CFG.c64.modelMs;
  const notes = [];
  for (const n of names) {
    const p = report.proxies[n];
    if (p.saturation.rps < offered) {
      notes.push(`${LABEL[n]} saturates at ${Math.round(p.saturation.rps)} req/s, below the ${offered} req/s that 64 clients offer ` +
        `with a ${CFG.c64.modelMs} ms model, so its 64-client rows are mostly queueing in the proxy.`);
    }
    const errs = Object.entries(p.errors).reduce((a, [, e]) => a + e.direct + e.proxied, 0) + p.saturation.errors;
    notes.push(`${LABEL[n]}: ${errs} failed requests in ${p.requests_proxied} proxied.`);
  }
  return [
    `<!-- written by tests/bench/llm-peers/run.sh on ${report.date}; numbers in docs/bench/llm-peers.json -->`,
    `Run ${report.date.slice(0, 10)}, one machine: ${m.nproc} cores (${m.cpu_model}), ${Math.round(m.mem_total_kib / 1048576)} GiB, kernel ${m.kernel}; ` +
      `client, mock upstream and proxy share the cores; loopback; sandgate ${v.sandgate_build ?? ''} build (${v.sandgate_git}).`,
    '',
    ...lines,
    '',
    `Added latency is p50 (p99) through the proxy minus p50 (p99) straight to the mock (\`tests/e2e/fixtures/mock_model_server.mjs\`). ` +
      `Straight to the mock, 64 clients reach ${Math.round(d.rps)} req/s: the ceiling of this client and mock on this machine. ` +
      `LiteLLM runs one uvicorn worker (its default), Portkey one Node process; sandgate is one process.`,
    '',
    ...notes.map((x) => `- ${x}`),
    '- Pins (tests/bench/llm-peers/requirements.txt, package.json): litellm[proxy] 1.108.0 is the newest release whose ' +
      '`proxy` extra installs from PyPI (1.108.14 and 1.110.x want litellm-proxy / litellm-proxy-extras versions PyPI does not serve); ' +
      'Portkey with @hono/node-server overridden to 1.13.8.',
    '',
  ].join('\n');
}

// ---- main -------------------------------------------------------------------

const mock = await startMock();
log(`mock on ${mock.url}`);
const direct = makeTarget('direct', mock.port, '/v1/chat/completions', { authorization: `Bearer ${UPSTREAM_KEY}` });
await mock.setLatency(0);
await concurrent(direct, CFG.warmup.clients, CFG.warmup.requests / CFG.warmup.clients, false, 0);
log('direct saturation');
const directSat = await saturate(direct, CFG.sat.clients, CFG.sat.seconds);

const report = {
  date: new Date().toISOString(),
  what: 'model API proxies in front of the same mock upstream (OpenAI chat completions), same client; see tests/bench/llm-peers/bench.mjs',
  machine: machine(),
  versions: versions(),
  settings: { ...CFG, quick: QUICK, cpu_count_node: cpus().length, mem_total_bytes: totalmem() },
  direct_saturation: directSat,
  proxies: {},
};
let failed = false;
for (const name of PEERS) {
  try {
    report.proxies[name] = await measure(name, mock, direct);
  } catch (err) {
    failed = true;
    log(`${name}: FAILED: ${err.stack ?? err}`);
    report.proxies[name] = { error: String(err.message ?? err).slice(0, 2000) };
    for (const c of [...children]) if (c !== mock.proc) await stopProc(c);
  }
}
await stopProc(mock.proc, 2000);
writeFileSync(outJson, JSON.stringify(report, null, 2) + '\n');
const ok = Object.fromEntries(Object.entries(report.proxies).filter(([, p]) => !p.error));
writeFileSync(outMd, markdown({ ...report, proxies: ok }));
process.stdout.write(readFileSync(outMd, 'utf8'));
process.exit(failed ? 1 : 0);
