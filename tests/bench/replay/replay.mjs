#!/usr/bin/env node
// replay: N sibling sandboxes of one template run recorded agent
// trajectories (tool commands through the E2B API, model calls through
// sandgate's model proxy to a mock upstream that answers after the recorded
// latency), once per memory policy, with M(t) sampled from the host every
// second. Writes a JSON report and an SVG plot of M(t) per policy.
// Format and method: docs/replay.md.
//
// usage: node tests/bench/replay/replay.mjs [--n N] [--mode rollout|group]
//          [--trajectories coding,data] [--policies none,pause[,offload][,audit]]
//          (offload: microVMs into the memory engine, process sandboxes into zram swap)
//          [--time-scale F] [--runtime process|kvm] [--out DIR] [--check]
//          [--external] [--combine A.json,B.json,...]
// Needs SANDGATE_BIN and SANDGATE_TESTS_TEMPLATES_DIR (as the e2e tests do;
// scripts/replay.sh sets them), and SANDGATE_GUEST_DIR for --runtime kvm. --check exits 1 unless every step ran,
// every tool step's output matched across policies, and the pause policy
// paused (what CI asserts).
// --external runs one policy against a sandgate started elsewhere with
// that policy's flags (SANDGATE_E2E_URL and SANDGATE_E2E_KEY: the KVM
// harness, scripts/replay-kvm.sh); its model calls are made from inside
// each sandbox (curl to $OPENAI_BASE_URL), as no virtual key can be made
// there. --combine merges such one-policy reports into one. Arguments may
// also come in SANDGATE_REPLAY_ARGS (space-separated; the harness runs the
// file with `node --test`, which passes none).
import { readFileSync, writeFileSync, mkdirSync, mkdtempSync, rmSync } from 'node:fs';
import { execFileSync } from 'node:child_process';
import { cpus, totalmem, release, tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { createHash } from 'node:crypto';

const HERE = dirname(fileURLToPath(import.meta.url));
const ROOT = resolve(HERE, '../../..');
const { Sandbox } = await import(pathToFileURL(join(ROOT, 'tests/e2e/node_modules/e2b/dist/index.mjs')).href);
const { Sandbox: CodeSandbox } = await import(pathToFileURL(join(ROOT, 'tests/e2e/node_modules/@e2b/code-interpreter/dist/index.mjs')).href);
const { startSandgate } = await import(pathToFileURL(join(ROOT, 'tests/e2e/server.mjs')).href);
const { startMockModelServer } = await import(pathToFileURL(join(ROOT, 'tests/e2e/fixtures/mock_model_server.mjs')).href);

// ---- arguments --------------------------------------------------------------

function parseArgs(argv) {
  const a = { n: 4, mode: 'rollout', trajectories: 'coding,data', policies: 'none,pause', timeScale: 1,
    runtime: 'process', out: join(ROOT, 'docs/bench'), check: false, name: 'replay' };
  for (let i = 0; i < argv.length; i++) {
    const k = argv[i];
    const v = () => { if (i + 1 >= argv.length) throw new Error(`${k} needs a value`); return argv[++i]; };
    if (k === '--n') a.n = Number(v());
    else if (k === '--mode') a.mode = v();
    else if (k === '--trajectories') a.trajectories = v();
    else if (k === '--policies') a.policies = v();
    else if (k === '--time-scale') a.timeScale = Number(v());
    else if (k === '--runtime') a.runtime = v();
    else if (k === '--out') a.out = v();
    else if (k === '--name') a.name = v();
    else if (k === '--check') a.check = true;
    else if (k === '--external') a.external = true;
    else if (k === '--combine') a.combine = v();
    else throw new Error(`unknown argument ${k} (see the usage at the top of replay.mjs)`);
  }
  if (!Number.isInteger(a.n) || a.n < 1 || a.n > 200) throw new Error('--n wants an integer from 1 to 200');
  if (!['rollout', 'group'].includes(a.mode)) throw new Error('--mode wants rollout or group');
  if (!(a.timeScale > 0 && a.timeScale <= 10)) throw new Error('--time-scale wants a number in (0, 10]');
  a.policies = a.policies.split(',');
  for (const p of a.policies) if (!POLICIES[p]) throw new Error(`unknown policy ${p} (${Object.keys(POLICIES).join(', ')})`);
  a.trajectories = a.trajectories.split(',');
  return a;
}

// What each policy changes in `sandgate serve`.
const POLICIES = {
  none: ['--no-llm-pause'],
  pause: ['--memory-offload', 'off'],
  // Every wait pause offloaded; a process sandbox idle 5 s (no traffic, no
  // CPU: a task that ended) goes out too.
  offload: ['--memory-offload', 'always', '--offload-min-wait-ms', '0', '--idle-offload-ms', '5000'],
  // offload without the idle offload: the waits only (the A/B of the idle offload).
  offload_waits: ['--memory-offload', 'always', '--offload-min-wait-ms', '0', '--idle-offload-ms', '0'],
  // offload, and the engine's codecs on every page a wait puts out to zram
  // (--swap-codec-audit, process backend): a measurement, not a timing run.
  audit: ['--memory-offload', 'always', '--offload-min-wait-ms', '0', '--idle-offload-ms', '5000', '--swap-codec-audit'],
};
const AUDIT_CODECS = ['raw', 'device_uncompressed', 'device', 'engine_plain', 'engine_cohort'];

// ---- trajectories -------------------------------------------------------------

// A trajectory file (docs/replay.md): { name, description, tool_ms, setup:
// [cmd], steps: [{tool, expect_exit?, tool_ms?} | {model: {latency_ms,
// prompt_tokens, completion_tokens}}] }. {EXPR} in a command is an integer
// expression over `seed` (digits, + - * and parentheses only).
function loadTrajectory(name) {
  const t = JSON.parse(readFileSync(join(HERE, 'trajectories', `${name}.json`), 'utf8'));
  if (!t.name || !Array.isArray(t.steps) || !Array.isArray(t.setup)) throw new Error(`${name}.json: not a trajectory`);
  for (const [i, s] of t.steps.entries()) {
    if (typeof s.tool !== 'string' && typeof s.cell !== 'string' && !(s.model && Number.isFinite(s.model.latency_ms)))
      throw new Error(`${name}.json: step ${i} is neither a tool, a cell nor a model step`);
    if (typeof s.cell === 'string' && !t.template) throw new Error(`${name}.json: step ${i} is a cell, and no template has a kernel`);
  }
  for (const [i, s] of t.setup.entries())
    if (typeof s !== 'string' && typeof s?.cell !== 'string') throw new Error(`${name}.json: setup ${i} is neither a command nor a cell`);
  return t;
}

function subst(cmd, seed) {
  return cmd.replace(/\{([0-9seed+\-*() ]+)\}/g, (m, expr) => {
    const e = expr.replaceAll('seed', String(seed));
    if (!/^[0-9+\-*() ]+$/.test(e)) return m;
    return String(Function(`"use strict"; return (${e});`)());
  });
}

// Deterministic per (seed, step) jitter of a latency: group candidates think
// for different times, rollout copies for the same.
function jitter(ms, seed, step) {
  const h = createHash('sha256').update(`${seed}:${step}`).digest();
  return Math.round(ms * (0.8 + 0.4 * (h.readUInt32BE(0) / 2 ** 32)));
}

// ---- measurement helpers ------------------------------------------------------

const pct = (v, p) => {
  if (!v.length) return null;
  const s = [...v].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.max(0, Math.ceil((p / 100) * s.length) - 1))];
};
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const MiB = (b) => (b / 1048576).toFixed(1);

function metricValue(text, name) {
  const m = new RegExp(`^${name.replace(/[{}]/g, '\\$&')} (\\S+)$`, 'm').exec(text);
  return m ? Number(m[1]) : null;
}

// ---- one policy run -------------------------------------------------------------

async function runPolicy(args, policy, trajectories, progress) {
  const tmp = mkdtempSync(join(tmpdir(), 'sg-replay-'));
  let mock = null, sg;
  if (args.external) {
    const { SANDGATE_E2E_URL: url, SANDGATE_E2E_KEY: key } = process.env;
    sg = { url, key, opts: { apiUrl: url, sandboxUrl: url, apiKey: key } };
  } else {
    mock = await startMockModelServer({ apiKey: 'sk-replay-upstream' });
    const keyFile = join(tmp, 'upstream.key');
    writeFileSync(keyFile, 'sk-replay-upstream\n', { mode: 0o600 });
    sg = await startSandgate([
      '--runtime', args.runtime, '--rate', '0', '--create-rate', '0', '--llm-rate', '0', '--llm-tokens-per-min', '0',
      '--openai-base-url', mock.url, '--openai-key-file', keyFile, ...POLICIES[policy],
      ...(process.env.SANDGATE_GUEST_DIR ? ['--guest-dir', process.env.SANDGATE_GUEST_DIR] : []),
    ]);
  }
  const result = { policy, sandgate_args: POLICIES[policy], tasks: [], samples: [], errors: [] };
  const boxes = [];
  const state = { done: 0, steps: 0, totalSteps: 0, mem: 0, stop: false };
  let sampler;
  try {
    const vkey = args.external ? null : execFileSync(process.env.SANDGATE_BIN, ['llm', 'key', 'create', 'local',
      '--name', 'replay', '--data-dir', join(sg.dir, 'data')], { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] }).trim();
    // The task list: rollout = N copies of each trajectory (seed 1), group =
    // N candidates with seeds 1..N.
    const tasks = [];
    for (const t of trajectories)
      for (let i = 0; i < args.n; i++) tasks.push({ traj: t, index: i, seed: args.mode === 'group' ? i + 1 : 1 });
    const opts = { ...sg.opts, requestTimeoutMs: 300_000 };
    for (const task of tasks) {
      // A trajectory with cells runs in a template with a Jupyter kernel
      // (the code interpreter's); its cells go to the kernel's default
      // context, as an agent's runCode calls do.
      const Kind = task.traj.template ? CodeSandbox : Sandbox;
      const sbx = await Kind.create(task.traj.template ?? 'base', { ...opts, timeoutMs: 3_600_000 });
      boxes.push(sbx);
      task.sbx = sbx;
      for (const step of task.traj.setup) {
        if (typeof step === 'string') {
          const r = await sbx.commands.run(subst(step, task.seed), { timeoutMs: 120_000 });
          if (r.exitCode !== 0) throw new Error(`${task.traj.name} setup failed: ${r.stderr}`);
        } else {
          const e = await sbx.runCode(subst(step.cell, task.seed), { timeoutMs: 120_000 });
          if (e.error) throw new Error(`${task.traj.name} setup cell failed: ${e.error.name}: ${e.error.value}`);
        }
      }
    }
    // sandgate reads each sandbox's memory once a second: start the clock
    // once every sandbox has a reading in the sum (at most 10 s).
    for (const deadline = Date.now() + 10_000; Date.now() < deadline; await sleep(100)) {
      const text = await (await fetch(sg.url + '/metrics')).text();
      if ((metricValue(text, 'sandgate_sandboxes_memory_bytes') ?? 0) > 0) break;
    }
    await sleep(1100);  // one more tick: the last sandbox created is in it too
    const t0 = performance.now();
    state.totalSteps = tasks.reduce((n, t) => n + t.traj.steps.length, 0);
    // M(t) from the host: sandgate's per-second reading (cgroup memory, or
    // the VMM's RSS, plus pool bytes), summed over sandboxes, on /metrics;
    // on the process backend plus the RAM its zram swap device takes (the
    // device holds only sandboxes' pages: sandgate made it).
    sampler = (async () => {
      while (!state.stop) {
        const t = (performance.now() - t0) / 1000;
        try {
          const text = await (await fetch(sg.url + '/metrics')).text();
          const rss = metricValue(text, 'sandgate_sandboxes_memory_bytes');
          const v = rss === null ? null : rss + (metricValue(text, 'sandgate_swap_memory_bytes') ?? 0);
          if (v !== null) {
            result.samples.push([Number(t.toFixed(2)), v]);
            state.mem = v;
          }
        } catch (e) {
          result.errors.push(`sample at ${t.toFixed(1)} s: ${e.message}`);
        }
        progress(policy, state, t);
        await sleep(1000);
      }
    })();
    await Promise.all(tasks.map(async (task) => {
      const rec = { trajectory: task.traj.name, index: task.index, seed: task.seed, sandbox: task.sbx.sandboxId,
        outputs: [], model_ms: 0, tool_ms: 0, model_added_ms: [] };
      const start = performance.now();
      for (const [i, step] of task.traj.steps.entries()) {
        if (step.model) {
          const latency = Math.round(jitter(step.model.latency_ms, task.seed, i) * args.timeScale);
          const words = Array.from({ length: step.model.prompt_tokens ?? 100 }, (_, k) => `w${k % 97}`).join(' ');
          const body = JSON.stringify({ model: 'mock-gpt', max_completion_tokens: step.model.completion_tokens ?? 20,
            messages: [{ role: 'user', content: words }] });
          const m0 = performance.now();
          let status, text;
          if (vkey) {
            const r = await fetch(sg.url + '/v1/chat/completions', { method: 'POST', body, headers: {
              'content-type': 'application/json', authorization: `Bearer ${vkey}`,
              'x-sandgate-sandbox': task.sbx.sandboxId, 'x-mock-latency-ms': String(latency) } });
            status = r.status;
            text = await r.text();
          } else {
            // From inside the sandbox, through its own proxy address.
            const r = await task.sbx.commands.run(`curl -sS -o /dev/null -w '%{http_code}' -H 'content-type: application/json' ` +
              `-H 'x-mock-latency-ms: ${latency}' --data '${body}' "$OPENAI_BASE_URL/chat/completions"`,
            { timeoutMs: 300_000 }).catch((e) => e);
            status = Number(r.stdout ?? r.result?.stdout ?? 0);
            text = r.stderr ?? r.message ?? '';
          }
          const took = performance.now() - m0;
          if (status !== 200) throw new Error(`${task.traj.name}#${task.index} step ${i}: model call ${status}: ${text.slice(0, 200)}`);
          rec.model_ms += took;
          rec.model_added_ms.push(took - latency);
        } else if (step.cell) {
          // A cell in the kernel: its result, output and error are the
          // step's output.
          const s0 = performance.now();
          const e = await task.sbx.runCode(subst(step.cell, task.seed), { timeoutMs: 300_000 }).catch((err) => ({ error: { name: 'client', value: err.message } }));
          if (e.error) result.errors.push(`${task.traj.name}#${task.index} step ${i}: ${e.error.name}: ${String(e.error.value).slice(0, 200)}`);
          const out = JSON.stringify([e.text ?? null, e.logs?.stdout ?? [], e.error?.name ?? null]);
          rec.outputs.push({ step: i, exit: e.error ? 1 : 0, sha256: createHash('sha256').update(out).digest('hex').slice(0, 16) });
          const left = (step.tool_ms ?? task.traj.tool_ms ?? 0) * args.timeScale - (performance.now() - s0);
          if (left > 20) await sleep(left);  // the kernel idles meanwhile, as while an agent reads its output
          rec.tool_ms += performance.now() - s0;
        } else {
          const s0 = performance.now();
          const r = await task.sbx.commands.run(subst(step.tool, task.seed), { timeoutMs: 300_000 }).catch((e) => e);
          const exit = r.exitCode ?? r.result?.exitCode ?? -1;
          const stdout = r.stdout ?? r.result?.stdout ?? '';
          const want = step.expect_exit ?? 0;
          if (exit !== want) result.errors.push(`${task.traj.name}#${task.index} step ${i}: exit ${exit}, want ${want}: ${(r.stderr ?? r.message ?? '').slice(0, 200)}`);
          rec.outputs.push({ step: i, exit, sha256: createHash('sha256').update(stdout).digest('hex').slice(0, 16) });
          // The recorded tool time, where the command itself was quicker:
          // the rest is spent in the sandbox (the tool still running).
          const want_ms = (step.tool_ms ?? task.traj.tool_ms ?? 0) * args.timeScale;
          const left = want_ms - (performance.now() - s0);
          if (left > 20) await task.sbx.commands.run(`sleep ${(left / 1000).toFixed(3)}`, { timeoutMs: 300_000 });
          rec.tool_ms += performance.now() - s0;
        }
        state.steps++;
      }
      rec.wall_ms = performance.now() - start;
      rec.finished_s = (performance.now() - t0) / 1000;
      state.done++;
      result.tasks.push(rec);
    }));
    result.window_s = (performance.now() - t0) / 1000;
    state.stop = true;
    await sampler;
    progress(policy, state, result.window_s, true);
    // Wait transitions, from the host's record: pauses and resume latency
    // (resuming -> the next state), per sandbox.
    const resume = [];
    let pauses = 0, offloads = 0;
    for (const task of tasks) {
      const r = await fetch(`${sg.url}/sandboxes/${task.sbx.sandboxId}/events`, { headers: { 'X-API-KEY': sg.key } });
      const evs = (await r.json()).filter((e) => e.kind === 'wait');
      for (let i = 0; i < evs.length; i++) {
        const d = evs[i].detail;
        if (d.from === 'pausing' && d.to === 'paused') pauses++;
        if (d.from === 'offloading' && d.to === 'offloaded') offloads++;
        if (d.to === 'resuming') {
          const next = evs.slice(i + 1).find((e) => e.detail.from === 'resuming');
          if (next) resume.push((next.detail.mono_ns - d.mono_ns) / 1e6);
        }
      }
    }
    result.pauses = pauses;
    result.offloads = offloads;
    result.resume_latency_ms = { n: resume.length, p50: pct(resume, 50), p99: pct(resume, 99) };
    const added = result.tasks.flatMap((t) => t.model_added_ms);
    result.model_call_added_ms = { n: added.length, p50: pct(added, 50), p99: pct(added, 99) };
    const metrics = await (await fetch(sg.url + '/metrics')).text();
    result.final_metrics = Object.fromEntries(['sandgate_wait_pauses_total', 'sandgate_memory_offloads_total',
      'sandgate_memory_pages_stored_total', 'sandgate_memory_faults_total', 'sandgate_memory_offloads_cancelled_total',
      'sandgate_memory_offload_seconds_total', 'sandgate_wait_offloads_total{result="skipped"}', 'sandgate_swap_offloads_total', 'sandgate_swap_idle_offloads_total',
      'sandgate_swap_out_pages_total', 'sandgate_swap_in_pages_total', 'sandgate_swap_audit_pages_total',
      'sandgate_swap_audit_unread_pages_total', ...AUDIT_CODECS.map((c) => `sandgate_swap_audit_bytes{codec="${c}"}`),
      'sandgate_swap_audit_pages_by_kind{codec="engine_plain",kind="zero"}']
      .map((k) => [k, metricValue(metrics, k)]).filter(([, v]) => v !== null));
  } finally {
    state.stop = true;
    await sampler;
    for (const b of boxes) await b.kill().catch(() => {});
    if (!args.external) {
      const st = await sg.stop();
      if (st.code !== 0) result.errors.push(`sandgate exited with ${JSON.stringify(st)}`);
      await mock.close();
    }
    rmSync(tmp, { recursive: true, force: true });
  }
  // Time-averaged memory: the samples' trapezoid integral over the window.
  const s = result.samples;
  let area = 0;
  for (let i = 1; i < s.length; i++) area += ((s[i][1] + s[i - 1][1]) / 2) * (s[i][0] - s[i - 1][0]);
  const span = s.length > 1 ? s.at(-1)[0] - s[0][0] : 0;
  result.mem_avg_bytes = span > 0 ? area / span : (s[0]?.[1] ?? 0);
  result.mem_peak_bytes = Math.max(0, ...s.map((x) => x[1]));
  for (const t of result.tasks) delete t.model_added_ms;
  result.tasks.sort((a, b) => a.trajectory.localeCompare(b.trajectory) || a.index - b.index);
  return result;
}

// ---- report and plot ------------------------------------------------------------------

// The codec audit's figures (policy audit): the pages that went out, and
// what zram and the engine's codecs store for them. zram's change over a
// page-out is net of what other sandboxes' faults freed meanwhile and
// leaves out zero pages (zram keeps them as a flag): its estimate is its
// measured ratio over the non-zero pages.
function auditSummary(fm) {
  const b = (c) => fm?.[`sandgate_swap_audit_bytes{codec="${c}"}`];
  if (!(b('raw') > 0)) return undefined;
  const zero = (fm['sandgate_swap_audit_pages_by_kind{codec="engine_plain",kind="zero"}'] ?? 0) * 4096;
  const ratio = b('device_uncompressed') > 0 ? b('device') / b('device_uncompressed') : null;
  return {
    raw_bytes: b('raw'), zero_bytes: zero, device_uncompressed_bytes: b('device_uncompressed'), device_bytes: b('device'),
    zram_ratio_nonzero: ratio, zram_bytes: ratio === null ? null : Math.round((b('raw') - zero) * ratio),
    engine_plain_bytes: b('engine_plain'), engine_cohort_bytes: b('engine_cohort'),
  };
}

function compare(runs) {
  const base = runs.none ?? Object.values(runs)[0];
  const key = (t) => `${t.trajectory}#${t.index}`;
  const baseByKey = new Map(base.tasks.map((t) => [key(t), t]));
  const mismatches = [];
  for (const [p, r] of Object.entries(runs)) {
    const slow = [];
    for (const t of r.tasks) {
      const b = baseByKey.get(key(t));
      if (!b) continue;
      slow.push(t.wall_ms / b.wall_ms);
      for (const o of t.outputs) {
        const bo = b.outputs.find((x) => x.step === o.step);
        if (!bo || bo.sha256 !== o.sha256 || bo.exit !== o.exit)
          mismatches.push(`${p} ${key(t)} step ${o.step}: ${JSON.stringify(o)} vs ${JSON.stringify(bo)}`);
      }
    }
    r.slowdown = { vs: base.policy, mean: slow.reduce((a, b) => a + b, 0) / (slow.length || 1), p50: pct(slow, 50), max: Math.max(...slow) };
    r.mem_avg_vs_base = r.mem_avg_bytes / base.mem_avg_bytes;
  }
  return mismatches;
}

function svg(runs, title) {
  const W = 760, H = 360, L = 70, R = 20, T = 40, B = 50;
  const colors = { none: '#d62728', pause: '#1f77b4', offload: '#2ca02c', audit: '#9467bd', offload_waits: '#ff7f0e' };
  const all = Object.values(runs).flatMap((r) => r.samples);
  const tmax = Math.max(1, ...all.map((s) => s[0]));
  const mmax = Math.max(1, ...all.map((s) => s[1])) * 1.1;
  const x = (t) => L + (t / tmax) * (W - L - R);
  const y = (m) => H - B - (m / mmax) * (H - T - B);
  let out = `<svg xmlns="http://www.w3.org/2000/svg" width="${W}" height="${H}" font-family="sans-serif" font-size="12">\n`;
  out += `<rect width="${W}" height="${H}" fill="white"/>\n<text x="${W / 2}" y="20" text-anchor="middle" font-size="14">${title}</text>\n`;
  out += `<line x1="${L}" y1="${H - B}" x2="${W - R}" y2="${H - B}" stroke="black"/><line x1="${L}" y1="${T}" x2="${L}" y2="${H - B}" stroke="black"/>\n`;
  for (let i = 0; i <= 5; i++) {
    const m = (mmax / 5) * i, t = (tmax / 5) * i;
    out += `<text x="${L - 6}" y="${y(m) + 4}" text-anchor="end">${MiB(m)}</text><line x1="${L}" y1="${y(m)}" x2="${W - R}" y2="${y(m)}" stroke="#eee"/>\n`;
    out += `<text x="${x(t)}" y="${H - B + 16}" text-anchor="middle">${t.toFixed(0)}</text>\n`;
  }
  out += `<text x="${W / 2}" y="${H - 12}" text-anchor="middle">seconds</text><text x="16" y="${H / 2}" transform="rotate(-90 16 ${H / 2})" text-anchor="middle">M(t), MiB (all sandboxes)</text>\n`;
  let ly = T + 10;
  for (const [p, r] of Object.entries(runs)) {
    const pts = r.samples.map((s) => `${x(s[0]).toFixed(1)},${y(s[1]).toFixed(1)}`).join(' ');
    out += `<polyline fill="none" stroke="${colors[p] ?? 'black'}" stroke-width="2" points="${pts}"/>\n`;
    out += `<rect x="${W - R - 210}" y="${ly - 9}" width="12" height="12" fill="${colors[p] ?? 'black'}"/><text x="${W - R - 192}" y="${ly + 2}">${p}: avg ${MiB(r.mem_avg_bytes)} MiB, peak ${MiB(r.mem_peak_bytes)}</text>\n`;
    ly += 18;
  }
  return out + '</svg>\n';
}

// ---- main ---------------------------------------------------------------------------

const args = parseArgs([...process.argv.slice(2), ...(process.env.SANDGATE_REPLAY_ARGS ?? '').split(' ').filter(Boolean)]);
if (args.external) {
  if (!process.env.SANDGATE_E2E_URL || !process.env.SANDGATE_E2E_KEY) {
    console.error('replay --external: set SANDGATE_E2E_URL and SANDGATE_E2E_KEY (the KVM harness does)');
    process.exit(2);
  }
  if (args.policies.length !== 1) {
    console.error('replay --external: one policy (the flags the sandgate at SANDGATE_E2E_URL runs with)');
    process.exit(2);
  }
} else if (!args.combine && (!process.env.SANDGATE_BIN || !process.env.SANDGATE_TESTS_TEMPLATES_DIR)) {
  console.error('replay: set SANDGATE_BIN and SANDGATE_TESTS_TEMPLATES_DIR (scripts/replay.sh does)');
  process.exit(2);
}
const runs = {};
let machine = { cpu: cpus()[0]?.model, cores: cpus().length, memory_bytes: totalmem(), kernel: release(), runtime: args.runtime };
let config = { n: args.n, mode: args.mode, trajectories: args.trajectories, policies: args.policies, time_scale: args.timeScale,
  external: Boolean(args.external) };
if (args.combine) {
  // One-policy reports (--external runs) into one: the same tasks, policy by policy.
  const reports = args.combine.split(',').map((f) => JSON.parse(readFileSync(f, 'utf8')));
  ({ machine, config } = reports[0]);
  for (const rep of reports)
    for (const [p, r] of Object.entries(rep.policies)) runs[p] = { ...r, policy: p };
  config = { ...config, policies: Object.keys(runs) };
  args.trajectories = config.trajectories;
  args.n = config.n;
  args.mode = config.mode;
  args.runtime = machine.runtime;
  args.timeScale = config.time_scale;
}
const trajectories = args.trajectories.map(loadTrajectory);
const tty = process.stderr.isTTY;
let lastLine = 0;
const progress = (policy, st, t, final = false) => {
  const line = `replay [${policy}] ${t.toFixed(0)} s: tasks ${st.done}/${trajectories.length * args.n}, ` +
    `steps ${st.steps}/${st.totalSteps}, M(t) ${MiB(st.mem)} MiB`;
  if (tty) process.stderr.write(`\r${line}   ${final ? '\n' : ''}`);
  else if (final || t - lastLine >= 10) { process.stderr.write(line + '\n'); lastLine = t; }
};
if (!args.combine) {
  for (const p of args.policies) {
    lastLine = 0;
    runs[p] = await runPolicy(args, p, trajectories, progress);
  }
}
const mismatches = compare(runs);
const report = {
  benchmark: 'replay of agent trajectories with model waits (docs/replay.md)',
  date: new Date().toISOString(),
  machine,
  config,
  outputs_match: mismatches.length === 0,
  mismatches,
  policies: Object.fromEntries(Object.entries(runs).map(([p, r]) => [p, {
    mem_avg_bytes: Math.round(r.mem_avg_bytes), mem_peak_bytes: r.mem_peak_bytes, mem_avg_vs_none: r.mem_avg_vs_base,
    window_s: r.window_s, slowdown: r.slowdown, pauses: r.pauses, offloads: r.offloads,
    resume_latency_ms: r.resume_latency_ms, model_call_added_ms: r.model_call_added_ms,
    model_share: r.tasks.reduce((a, t) => a + t.model_ms, 0) / r.tasks.reduce((a, t) => a + t.wall_ms, 0),
    final_metrics: r.final_metrics, audit: auditSummary(r.final_metrics), errors: r.errors, tasks: r.tasks, samples: r.samples,
  }])),
};
mkdirSync(args.out, { recursive: true });
const jsonPath = join(args.out, `${args.name}.json`), svgPath = join(args.out, `${args.name}.svg`);
writeFileSync(jsonPath, JSON.stringify(report, null, 1) + '\n');
writeFileSync(svgPath, svg(runs, `M(t), ${args.n} x {${args.trajectories.join(', ')}} (${args.mode}), ${args.runtime} backend${config.external && args.runtime === 'kvm' ? ' in the KVM harness (times emulated)' : ''}, time scale ${args.timeScale}`));
for (const [p, r] of Object.entries(report.policies)) {
  console.log(`${p}: M avg ${MiB(r.mem_avg_bytes)} MiB (x${r.mem_avg_vs_none.toFixed(3)} of none), peak ${MiB(r.mem_peak_bytes)} MiB, ` +
    `window ${r.window_s.toFixed(1)} s, slowdown mean x${r.slowdown.mean.toFixed(3)} max x${r.slowdown.max.toFixed(3)}, ` +
    `pauses ${r.pauses}, offloads ${r.offloads}, resume p50 ${r.resume_latency_ms.p50?.toFixed(2) ?? '-'} ms ` +
    `p99 ${r.resume_latency_ms.p99?.toFixed(2) ?? '-'} ms, model share ${(100 * r.model_share).toFixed(0)} %` +
    (r.errors.length ? `, ${r.errors.length} errors` : ''));
  if (r.audit) {
    const a = r.audit, pc = (x) => `${(100 * (1 - x / a.raw_bytes)).toFixed(1)} %`;
    console.log(`  ${p} audit: ${MiB(a.raw_bytes)} MiB went out (${MiB(a.zero_bytes)} MiB zero pages); saved: ` +
      `zram ${pc(a.zram_bytes)} (est.), engine plain ${pc(a.engine_plain_bytes)}, engine cohort ${pc(a.engine_cohort_bytes)}`);
  }
}
console.log(`outputs matched across policies: ${report.outputs_match}; report ${jsonPath}, plot ${svgPath}`);
if (args.check) {
  const problems = [];
  if (!report.outputs_match) problems.push(`outputs differ: ${mismatches.slice(0, 3).join('; ')}`);
  for (const [p, r] of Object.entries(report.policies)) {
    if (r.errors.length) problems.push(`${p}: ${r.errors.slice(0, 3).join('; ')}`);
    if (r.tasks.length !== trajectories.length * args.n) problems.push(`${p}: ${r.tasks.length} tasks finished`);
    if (r.samples.length < 2) problems.push(`${p}: ${r.samples.length} memory samples`);
    if (p === 'none' && r.pauses !== 0) problems.push(`none: ${r.pauses} pauses`);
    if (p !== 'none' && r.pauses === 0) problems.push(`${p}: no pause recorded`);
    if ((p === 'offload' || p === 'audit') && r.offloads === 0) problems.push(`${p}: no offload recorded`);
  }
  if (problems.length) {
    console.error(`replay --check FAILED:\n  ${problems.join('\n  ')}`);
    process.exit(1);
  }
  console.log('replay --check: ok');
}
