// The model API proxy and the wait coordinator on the KVM runtime (issue 5),
// in the KVM harness (tests/kvm-harness/harness.sh, CTest kvm_harness_e2e):
// `sandgate serve --runtime=kvm` runs inside a QEMU TCG guest, its model
// upstream is the mock model server the harness runs on the host
// (tests/kvm-harness/model-upstream.mjs). Inside a microVM sandbox, curl
// reaches the proxy at $OPENAI_BASE_URL (127.0.0.1:49982, forwarded over the
// sandbox's channel); a wait pause is the VMM stopping the vCPUs.
// The microVM has curl and python3, not node: the clients are curl, the
// background process is python3. tests/e2e/llm_gateway.test.mjs is the same
// ground on the process backend, with the SDK clients.
//
// Asserted: the bytes curl gets equal what the mock returns for the same
// body (non-streaming and streaming), the recorded transitions show
// pausing -> paused and then a resume for each wait, usage was recorded for
// the sandbox, and a background process kept its secret across the pauses
// and stood still while paused (its clock jumped by about the paused time).
//
// Needs SANDGATE_E2E_URL, SANDGATE_E2E_KEY, SANDGATE_E2E_MODEL_URL and
// SANDGATE_E2E_MODEL_KEY (the harness sets them); skips without them: exit 77
// when run as `node kvm_llm.test.mjs`, a skipped test under `node --test`.
// Timeouts are generous: under TCG everything is much slower than on
// hardware.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { Sandbox } from 'e2b';

const STEP = { timeout: 240_000 };
const { SANDGATE_E2E_URL: url, SANDGATE_E2E_KEY: key, SANDGATE_E2E_MODEL_URL: modelUrl,
  SANDGATE_E2E_MODEL_KEY: modelKey } = process.env;
// The mock holds its answer this long: time for the gateway to see the
// sandbox idle and stop it.
const LATENCY_MS = 1500;

const skip = url && key && modelUrl && modelKey ? null
  : 'needs the KVM harness (SANDGATE_E2E_URL/KEY, SANDGATE_E2E_MODEL_URL/KEY): run tests/kvm-harness/harness.sh';
if (skip && !process.env.NODE_TEST_CONTEXT) {
  console.log(`SKIP kvm model-proxy e2e: ${skip}`);
  process.exit(77);
}

let opts, sbx, keeper;
let keeperOut = '';

async function getJson(path) {
  const r = await fetch(url + path, { headers: { 'X-API-KEY': key } });
  assert.equal(r.status, 200, await r.clone().text());
  return r.json();
}

async function poll(what, fn, ok, ms = 60_000) {
  const deadline = Date.now() + ms;
  for (;;) {
    const v = await fn();
    if (ok(v)) return v;
    if (Date.now() > deadline) assert.fail(`${what}: not within ${ms / 1000} s; last: ${JSON.stringify(v)}`);
    await new Promise((r) => setTimeout(r, 200));
  }
}

const waitEvents = async (id, afterSeq) =>
  (await getJson(`/sandboxes/${id}/events`)).filter((e) => e.kind === 'wait' && e.seq > afterSeq);
async function lastSeq(id) {
  const evs = await getJson(`/sandboxes/${id}/events`);
  return evs.length ? evs.at(-1).seq : 0;
}
const stepName = (e) => `${e.detail.from}->${e.detail.to}`;
// A pause that completed, then a resume after it, in record order.
function pauseThenResume(evs) {
  const paused = evs.findIndex((e) => stepName(e) === 'pausing->paused');
  const resumed = evs.findIndex((e, i) => i > paused && e.detail.from === 'resuming');
  return paused >= 0 && resumed > paused ? { paused: evs[paused], resumed: evs[resumed] } : null;
}

async function direct(body) {
  const r = await fetch(modelUrl + '/v1/chat/completions', {
    method: 'POST', body, headers: { 'content-type': 'application/json', authorization: `Bearer ${modelKey}` },
  });
  assert.equal(r.status, 200);
  return r.text();
}

// curl inside the microVM against the proxy; returns what it printed.
async function curlInside(file, body, latencyMs = LATENCY_MS) {
  await sbx.files.write(`/home/user/${file}`, body);
  const r = await sbx.commands.run(
    `curl -sS -N --max-time 100 -H 'Content-Type: application/json' -H 'x-mock-latency-ms: ${latencyMs}' ` +
      `--data-binary @${file} "$OPENAI_BASE_URL/chat/completions"`,
    { cwd: '/home/user', timeoutMs: 120_000 },
  );
  assert.equal(r.exitCode, 0, r.stderr);
  return r.stdout;
}

// One model request from inside: the bytes, then the recorded wait.
async function oneWait(file, body) {
  const seq = await lastSeq(sbx.sandboxId);
  const got = await curlInside(file, body);
  assert.equal(got, await direct(body), 'the proxy delivers the upstream\'s bytes unchanged');
  const evs = await poll('a recorded pause and resume', () => waitEvents(sbx.sandboxId, seq),
    (e) => pauseThenResume(e) && e.at(-1).detail.to === 'running', 30_000);
  console.log(`transitions for ${file}: ${evs.map(stepName).join(' ')}`);
  return { got, evs, ...pauseThenResume(evs) };
}

if (skip) {
  test('kvm model-proxy e2e', { skip }, () => {});
} else {
  before(async () => {
    opts = { apiUrl: url, sandboxUrl: url, apiKey: key, requestTimeoutMs: 120_000 };
  });

  after(async () => {
    if (sbx) await sbx.kill().catch(() => {});
  });

  test('create a microVM sandbox; it sees the proxy in its environment', STEP, async () => {
    sbx = await Sandbox.create('base', { ...opts, timeoutMs: 900_000 });
    const r = await sbx.commands.run('echo $OPENAI_BASE_URL $ANTHROPIC_BASE_URL', { timeoutMs: 120_000 });
    assert.equal(r.stdout, 'http://127.0.0.1:49982/v1 http://127.0.0.1:49982\n');
  });

  test('a background process holds a secret in memory', STEP, async () => {
    // It prints the secret, then, until told on stdin, the longest time one
    // 0.25 s sleep of its clock thread took (a stopped VM shows as a jump),
    // then the secret again.
    keeper = await sbx.commands.run(
      'python3 -c "\n' +
        'import secrets, sys, threading, time\n' +
        's = secrets.token_hex(8); print(s, flush=True); gap = [0.0]\n' +
        'def tick():\n' +
        '  last = time.monotonic()\n' +
        '  while True:\n' +
        '    time.sleep(0.25); now = time.monotonic(); gap[0] = max(gap[0], now - last); last = now\n' +
        'threading.Thread(target=tick, daemon=True).start()\n' +
        'sys.stdin.readline(); print(round(gap[0], 3), flush=True); print(s, flush=True)\n"',
      { background: true, stdin: true, timeoutMs: 0, onStdout: (d) => { keeperOut += d; } },
    );
    await poll('the secret printed', () => keeperOut, (o) => /^[0-9a-f]{16}\n/.test(o));
  });

  let nonStreaming, streaming;

  test('curl, non-streaming: the upstream\'s bytes; paused during the wait, resumed before delivery', STEP, async () => {
    const body = JSON.stringify({ model: 'mock-gpt', messages: [{ role: 'user', content: 'hello from the microvm' }] });
    nonStreaming = await oneWait('plain.json', body);
    assert.equal(JSON.parse(nonStreaming.got).choices[0].message.content, 'mock reply 1 2 3');
  });

  test('curl, streaming: the upstream\'s SSE bytes; paused during the wait, resumed before delivery', STEP, async () => {
    const body = JSON.stringify({ model: 'mock-gpt', stream: true, stream_options: { include_usage: true },
      messages: [{ role: 'user', content: 'stream from the microvm' }] });
    streaming = await oneWait('stream.json', body);
    assert.match(streaming.got, /^data: \{.*\n\n/);
    assert.match(streaming.got, /data: \[DONE\]\n\n$/);
  });

  test('a long wait offloads the microVM\'s memory; it is back, whole, before the answer', STEP, async () => {
    // sandgate runs with --memory-offload always --offload-min-wait-ms 0
    // here (tests/CMakeLists.txt): every wait pause offloads. The short
    // waits above end while the offload runs (it is cancelled); this one
    // lasts long enough for it to finish under TCG.
    let out = '';
    const holder = await sbx.commands.run(
      'python3 -c "\n' +
        'import hashlib, os, sys\n' +
        'b = bytearray(os.urandom(16 << 20)); print(hashlib.sha256(b).hexdigest(), flush=True)\n' +
        'sys.stdin.readline(); print(hashlib.sha256(b).hexdigest(), flush=True)\n"',
      { background: true, stdin: true, timeoutMs: 0, onStdout: (d) => { out += d; } },
    );
    await poll('the checksum printed', () => out, (o) => /^[0-9a-f]{64}\n/.test(o));
    const seq = await lastSeq(sbx.sandboxId);
    const body = JSON.stringify({ model: 'mock-gpt', messages: [{ role: 'user', content: 'a long think' }] });
    const got = await curlInside('long.json', body, 40_000);
    assert.equal(got, await direct(body));
    const evs = await poll('an offload and a resume', () => waitEvents(sbx.sandboxId, seq),
      (e) => e.some((x) => stepName(x) === 'offloading->offloaded') && e.at(-1).detail.to === 'running', 30_000);
    console.log(`transitions for long.json: ${evs.map(stepName).join(' ')}`);
    const off = evs.findIndex((x) => stepName(x) === 'offloading->offloaded');
    assert.ok(evs.findIndex((x, i) => i > off && stepName(x) === 'offloaded->resuming') > off);
    const metrics = await (await fetch(url + '/metrics')).text();
    const num = (name) => Number((metrics.match(new RegExp(`^${name} (\\S+)$`, 'm')) || [])[1]);
    console.log(`offloads ${num('sandgate_memory_offloads_total')}, pages stored ` +
      `${num('sandgate_memory_pages_stored_total')}, faults ${num('sandgate_memory_faults_total')}, ` +
      `cancelled ${num('sandgate_memory_offloads_cancelled_total')}`);
    assert.ok(num('sandgate_memory_offloads_total') >= 1);
    assert.ok(num('sandgate_memory_pages_stored_total') >= 4096, 'at least the 16 MiB of random bytes');
    assert.ok(num('sandgate_memory_faults_total') > 0);
    assert.equal(num('sandgate_memory_lost_total'), 0);
    await sbx.commands.sendStdin(holder.pid, 'go\n');
    const r = await holder.wait();
    const [h1, h2] = r.stdout.trim().split('\n');
    assert.equal(h2, h1, 'the 16 MiB came back byte for byte');
  });

  test('usage was recorded for the sandbox', STEP, async () => {
    const rows = await poll('two usage rows', async () => (await getJson(`/llm/usage?sandboxID=${sbx.sandboxId}`)).requests,
      (r) => r.filter((x) => x.route === '/v1/chat/completions').length >= 3, 30_000);
    const [ns, st] = rows.filter((r) => r.route === '/v1/chat/completions').slice(0, 2);
    assert.deepEqual([ns.provider, ns.stream, ns.input_tokens, ns.output_tokens, ns.outcome, ns.status],
      ['openai', false, 4, 5, 'completed', 200]);
    assert.deepEqual([st.provider, st.stream, st.input_tokens, st.output_tokens, st.usage_found, st.status],
      ['openai', true, 4, 5, true, 200]);
  });

  test('the background process kept its secret and stood still while paused', STEP, async () => {
    await sbx.commands.sendStdin(keeper.pid, 'go\n');
    const r = await keeper.wait();
    const [secret, gap, again] = r.stdout.trim().split('\n');
    assert.match(secret, /^[0-9a-f]{16}$/, r.stdout);
    assert.equal(again, secret, 'the background process kept its memory');
    // Paused time by the gateway's clock: from paused to the resume's start.
    const stoppedS = (w) => (w.resumed.detail.mono_ns - w.paused.detail.mono_ns) / 1e9;
    const longest = Math.max(stoppedS(nonStreaming), stoppedS(streaming));
    console.log(`longest paused ${longest.toFixed(3)} s; the keeper's longest tick ${gap} s`);
    assert.ok(Number(gap) >= 0.8 * longest, `a tick took ${gap} s, the sandbox was paused ${longest.toFixed(3)} s`);
  });

  test('egress from a microVM: the host-side proxy lets allowOut through and refuses the rest', STEP, async () => {
    // sandgate runs with --egress --egress-allow-private here
    // (tests/CMakeLists.txt): the mock upstream is on QEMU's host address.
    const inGuest = modelUrl.replace('127.0.0.1', '10.0.2.2');
    const want = String((await fetch(modelUrl + '/v1/models')).status);
    const net = await Sandbox.create('base', { ...opts, timeoutMs: 300_000, allowInternetAccess: false,
      network: { allowOut: ['10.0.2.2'] } });
    try {
      const code = async (u) => (await net.commands.run(
        `curl -s -o /dev/null -w '%{http_code}' --max-time 60 ${u} || true`, { timeoutMs: 120_000 })).stdout;
      assert.equal(await code(inGuest + '/v1/models'), want, 'the mock answers through the proxy');
      assert.equal(await code('http://10.0.2.3:53/'), '403', 'not in allowOut');
      assert.equal(await code(`--noproxy '*' ${inGuest}/v1/models`), '000', 'no way around the proxy');
    } finally {
      await net.kill();
    }
  });

  test('the sandbox runs after the waits', STEP, async () => {
    assert.equal((await sbx.getInfo()).state, 'running');
    assert.equal((await sbx.commands.run('echo alive')).stdout, 'alive\n');
    assert.equal(await sbx.kill(), true);
    sbx = null;
  });
}
