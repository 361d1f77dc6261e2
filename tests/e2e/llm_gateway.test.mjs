// The model API proxy and the wait coordinator end to end (issue 5): the
// real sandgate binary (process backend: a wait pause is a cgroup freeze),
// the mock upstream model server from fixtures/, and inside a sandbox the
// unmodified official `openai` and `@anthropic-ai/sdk` npm clients (run by
// the host's node binary, uploaded) and curl, reaching the proxy at
// 127.0.0.1:49982 through the sandbox's channel. From the host: curl with a
// virtual key and the X-Sandgate-Sandbox binding header.
//
// Asserted: the sandbox was paused during the wait and running again
// before the answer arrived (recorded transitions), the bytes delivered
// equal the upstream's, usage was recorded per sandbox, a background
// process kept its state, and every bad input gets the provider's error.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync, execFile } from 'node:child_process';
import net from 'node:net';
import tls from 'node:tls';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, dirname } from 'node:path';
import { fileURLToPath } from 'node:url';
import { Sandbox } from 'e2b';
import { startSandgate } from './server.mjs';
import { startMockModelServer } from './fixtures/mock_model_server.mjs';

const UPSTREAM_KEY = 'sk-upstream-secret-0123456789';
const HERE = dirname(fileURLToPath(import.meta.url));
let sg, mock, down, sbx, llmKey, tmp, modelsUrl;

const cli = (...args) =>
  execFileSync(process.env.SANDGATE_BIN, [...args, '--data-dir', join(sg.dir, 'data')], { encoding: 'utf8' }).trim();

before(async () => {
  tmp = mkdtempSync(join(tmpdir(), 'sg-llm-'));
  mock = await startMockModelServer({ apiKey: UPSTREAM_KEY });
  const keyFile = join(tmp, 'upstream.key');
  writeFileSync(keyFile, UPSTREAM_KEY + '\n', { mode: 0o600 });
  // TLS upstreams are verified against the trust store: this run's is the
  // test CA (OpenSSL reads SSL_CERT_FILE).
  process.env.SSL_CERT_FILE = join(HERE, 'tls', 'ca.pem');
  sg = await startSandgate([
    '--openai-base-url', mock.url, '--openai-key-file', keyFile,
    '--anthropic-base-url', mock.url, '--anthropic-key-file', keyFile,
    '--llm-grace-ms', '20', '--llm-cooldown-ms', '0', '--llm-body-limit', '65536',
  ]);
  modelsUrl = sg.url;
  llmKey = cli('llm', 'key', 'create', 'local', '--name', 'e2e');
  assert.match(llmKey, /^sk-sg-[0-9a-f]{48}$/);

  sbx = await Sandbox.create('base', { ...sg.opts, timeoutMs: 300_000 });
  // The clients: the host's node and the test tree's node_modules.
  await sbx.files.write('/home/user/node', new Blob([readFileSync(process.execPath)]));
  const tgz = join(tmp, 'modules.tgz');
  execFileSync('tar', ['czf', tgz, '-C', HERE, 'node_modules']);
  await sbx.files.write('/home/user/modules.tgz', new Blob([readFileSync(tgz)]));
  await sbx.commands.run('chmod +x /home/user/node && tar xzf /home/user/modules.tgz -C /home/user && rm /home/user/modules.tgz');
});

after(async () => {
  if (sbx) await sbx.kill().catch(() => {});
  if (sg) assert.deepEqual(await sg.stop(), { code: 0, signal: null }, 'sandgate stops cleanly');
  if (mock) await mock.close();
  if (down) await down.close?.();
  if (tmp) rmSync(tmp, { recursive: true, force: true });
});

async function getJson(path) {
  const r = await fetch(sg.url + path, { headers: { 'X-API-KEY': sg.key } });
  assert.equal(r.status, 200, await r.clone().text());
  return r.json();
}

// Wait transitions recorded for the sandbox after event seq `after`,
// polled until `want` holds (the writer batches them into SQLite).
async function waitEvents(id, afterSeq, want) {
  const deadline = Date.now() + 10_000;
  for (;;) {
    const evs = (await getJson(`/sandboxes/${id}/events`)).filter((e) => e.kind === 'wait' && e.seq > afterSeq);
    if (want(evs) || Date.now() > deadline) return evs;
    await new Promise((r) => setTimeout(r, 50));
  }
}
async function lastSeq(id) {
  const evs = await getJson(`/sandboxes/${id}/events`);
  return evs.length ? evs.at(-1).seq : 0;
}
const pausedThenResumed = (evs) =>
  evs.some((e) => e.detail.to === 'paused') && evs.some((e) => e.detail.from === 'resuming');

async function usageRows(id) {
  return (await getJson(`/llm/usage?sandboxID=${id}`)).requests;
}
async function waitUsage(id, n) {
  const deadline = Date.now() + 10_000;
  for (;;) {
    const rows = await usageRows(id);
    if (rows.length >= n || Date.now() > deadline) return rows;
    await new Promise((r) => setTimeout(r, 50));
  }
}

// A background process that holds a secret in memory across the wait.
async function startKeeper() {
  const h = await sbx.commands.run(
    'python3 -c "import secrets,sys; s=secrets.token_hex(8); print(s, flush=True); sys.stdin.readline(); print(s, flush=True)"',
    { background: true, stdin: true },
  );
  return h;
}
async function checkKeeper(h) {
  await sbx.commands.sendStdin(h.pid, 'go\n');
  const r = await h.wait();
  const lines = r.stdout.trim().split('\n');
  assert.equal(lines.length, 2, r.stdout);
  assert.match(lines[0], /^[0-9a-f]{16}$/);
  assert.equal(lines[1], lines[0], 'the background process kept its memory');
}

test('the sandbox sees the proxy in its default environment', async () => {
  const r = await sbx.commands.run('echo $OPENAI_BASE_URL $ANTHROPIC_BASE_URL');
  assert.equal(r.stdout, 'http://127.0.0.1:49982/v1 http://127.0.0.1:49982\n');
});

test('openai SDK inside the sandbox: non-streaming and streaming; paused during the wait', async () => {
  const keeper = await startKeeper();
  const seq = await lastSeq(sbx.sandboxId);
  const before = mock.requests.length;
  await sbx.files.write('/home/user/oa.mjs', `
import OpenAI from 'openai';
const c = new OpenAI({ maxRetries: 0, defaultHeaders: { 'x-mock-latency-ms': '1200' } });
const r = await c.chat.completions.create({ model: 'mock-gpt', messages: [{ role: 'user', content: 'hello there' }] });
const s = await c.chat.completions.create({ model: 'mock-gpt', stream: true, stream_options: { include_usage: true },
  messages: [{ role: 'user', content: 'stream please' }] });
let text = '', usage = null;
for await (const ch of s) { text += ch.choices[0]?.delta?.content ?? ''; if (ch.usage) usage = ch.usage; }
console.log(JSON.stringify({ a: r.choices[0].message.content, u: r.usage, b: text, su: usage }));
`);
  const out = await sbx.commands.run('./node oa.mjs', { cwd: '/home/user', timeoutMs: 60_000 });
  const got = JSON.parse(out.stdout);
  assert.equal(got.a, 'mock reply 1 2 3');
  assert.deepEqual([got.u.prompt_tokens, got.u.completion_tokens], [2, 5]);
  assert.equal(got.b, 'mock reply 1 2 3');
  assert.equal(got.su.completion_tokens, 5);

  // The upstream got the gateway's key, none of the sandbox's, no sandgate headers.
  const seen = mock.requests.slice(before);
  assert.equal(seen.length, 2);
  for (const q of seen) {
    assert.equal(q.headers.authorization, `Bearer ${UPSTREAM_KEY}`);
    assert.ok(!Object.keys(q.headers).some((h) => h.startsWith('x-sandgate')));
  }

  // Paused during each wait (1.2 s each, grace 20 ms), resumed before delivery.
  // (Events reach SQLite in batches: poll until both waits are recorded whole.)
  const evs = await waitEvents(sbx.sandboxId, seq, (e) => e.filter((x) => x.detail.to === 'paused').length >= 2 &&
    e.filter((x) => x.detail.from === 'resuming').length >= 2);
  const states = evs.map((e) => `${e.detail.from}->${e.detail.to}`);
  assert.ok(states.filter((s) => s === 'pausing->paused').length >= 2, states.join(' '));
  assert.ok(states.filter((s) => s.startsWith('resuming->')).length >= 2, states.join(' '));

  const rows = await waitUsage(sbx.sandboxId, 2);
  const chat = rows.filter((r) => r.route === '/v1/chat/completions');
  assert.ok(chat.length >= 2);
  const [ns, st] = chat.slice(-2);
  assert.deepEqual([ns.stream, ns.input_tokens, ns.output_tokens, ns.outcome, ns.status], [false, 2, 5, 'completed', 200]);
  assert.deepEqual([st.stream, st.input_tokens, st.output_tokens, st.usage_found], [true, 2, 5, true]);
  await checkKeeper(keeper);
});

test('anthropic SDK inside the sandbox: streaming messages; usage from message_delta', async () => {
  const seq = await lastSeq(sbx.sandboxId);
  await sbx.files.write('/home/user/an.mjs', `
import Anthropic from '@anthropic-ai/sdk';
const c = new Anthropic({ maxRetries: 0, defaultHeaders: { 'x-mock-latency-ms': '800', 'x-mock-chunks': '7', 'anthropic-beta': 'sandgate-test-1' } });
const s = c.messages.stream({ model: 'mock-claude', max_tokens: 100, messages: [{ role: 'user', content: 'one two three' }] });
const m = await s.finalMessage();
console.log(JSON.stringify({ text: m.content[0].text, usage: m.usage }));
`);
  const out = await sbx.commands.run('./node an.mjs', { cwd: '/home/user', timeoutMs: 60_000 });
  const got = JSON.parse(out.stdout);
  assert.equal(got.text, 'mock reply 1 2 3 4 5');
  // Provider headers reach the upstream; the gateway's key replaces the sandbox's.
  const seen = mock.requests.at(-1);
  assert.equal(seen.headers['anthropic-beta'], 'sandgate-test-1');
  assert.match(seen.headers['anthropic-version'], /^\d{4}-\d{2}-\d{2}$/);
  assert.equal(seen.headers['x-api-key'], UPSTREAM_KEY);
  assert.equal(seen.headers.authorization, undefined);
  const evs = await waitEvents(sbx.sandboxId, seq, pausedThenResumed);
  assert.ok(pausedThenResumed(evs), JSON.stringify(evs));
  const rows = await waitUsage(sbx.sandboxId, 3);
  const last = rows.filter((r) => r.route === '/v1/messages').at(-1);
  assert.deepEqual([last.provider, last.stream, last.input_tokens, last.output_tokens], ['anthropic', true, 3, 7]);
});

test('curl inside the sandbox: the streamed bytes equal the upstream\'s', async () => {
  const body = JSON.stringify({ model: 'mock-gpt', stream: true, stream_options: { include_usage: true },
    messages: [{ role: 'user', content: 'bytes please' }] });
  await sbx.files.write('/home/user/body.json', body);
  const seq = await lastSeq(sbx.sandboxId);
  const r = await sbx.commands.run(
    'curl -sS -N -H "Content-Type: application/json" -H "x-mock-latency-ms: 600" --data-binary @body.json ' +
      '"$OPENAI_BASE_URL/chat/completions"',
    { cwd: '/home/user', timeoutMs: 30_000 },
  );
  const direct = await fetch(mock.url + '/v1/chat/completions', {
    method: 'POST', body, headers: { 'content-type': 'application/json', authorization: `Bearer ${UPSTREAM_KEY}` },
  });
  assert.equal(r.stdout, await direct.text());
  assert.match(r.stdout, /data: \[DONE\]/);
  const evs = await waitEvents(sbx.sandboxId, seq, pausedThenResumed);
  assert.ok(pausedThenResumed(evs));
});

test('an agent loop outside the sandbox binds its requests with X-Sandgate-Sandbox (curl, virtual key)', async () => {
  const seq = await lastSeq(sbx.sandboxId);
  const body = JSON.stringify({ model: 'mock-gpt', messages: [{ role: 'user', content: 'from outside' }] });
  const out = await new Promise((resolve, reject) =>
    execFile('curl', ['-sS', '-H', `Authorization: Bearer ${llmKey}`, '-H', `X-Sandgate-Sandbox: ${sbx.sandboxId}`,
      '-H', 'content-type: application/json', '-H', 'x-mock-latency-ms: 700', '--data-binary', body,
      `${modelsUrl}/v1/chat/completions`], (err, stdout) => (err ? reject(err) : resolve(stdout))));
  const direct = await fetch(mock.url + '/v1/chat/completions', {
    method: 'POST', body, headers: { 'content-type': 'application/json', authorization: `Bearer ${UPSTREAM_KEY}` },
  });
  assert.equal(out, await direct.text());
  const evs = await waitEvents(sbx.sandboxId, seq, pausedThenResumed);
  assert.ok(pausedThenResumed(evs));
  // Traffic to the sandbox while nothing waits: it runs.
  assert.equal((await sbx.commands.run('echo alive')).stdout, 'alive\n');
});

test('other traffic resumes a wait-paused sandbox at once', async () => {
  const body = JSON.stringify({ model: 'mock-gpt', messages: [{ role: 'user', content: 'long one' }] });
  const seq = await lastSeq(sbx.sandboxId);
  const pending = fetch(`${modelsUrl}/v1/chat/completions`, {
    method: 'POST', body,
    headers: { authorization: `Bearer ${llmKey}`, 'x-sandgate-sandbox': sbx.sandboxId,
      'content-type': 'application/json', 'x-mock-latency-ms': '6000' },
  });
  // Order, not a stopwatch: the command's answer comes while the model
  // has not answered yet (6 s), however slow the machine is otherwise.
  let answered = false;
  pending.then(() => { answered = true; }, () => { answered = true; });
  await waitEvents(sbx.sandboxId, seq, (e) => e.some((x) => x.detail.to === 'paused'));
  assert.equal((await sbx.commands.run('echo during')).stdout, 'during\n');
  assert.equal(answered, false, 'the command ran before the model answered');
  const r = await pending;
  assert.equal(r.status, 200);
  await r.text();
  const evs = await waitEvents(sbx.sandboxId, seq, (e) => e.some((x) => x.detail.reason === 'other traffic for the sandbox'));
  assert.ok(evs.some((x) => x.detail.reason === 'other traffic for the sandbox'), JSON.stringify(evs));
});

test('a client that goes away during a wait leaves the sandbox running', async () => {
  const body = JSON.stringify({ model: 'mock-gpt', messages: [{ role: 'user', content: 'gone' }] });
  const seq = await lastSeq(sbx.sandboxId);
  const ac = new AbortController();
  const p = fetch(`${modelsUrl}/v1/chat/completions`, {
    method: 'POST', body, signal: ac.signal,
    headers: { authorization: `Bearer ${llmKey}`, 'x-sandgate-sandbox': sbx.sandboxId,
      'content-type': 'application/json', 'x-mock-latency-ms': '5000' },
  });
  await waitEvents(sbx.sandboxId, seq, (e) => e.some((x) => x.detail.to === 'paused'));
  ac.abort();
  await assert.rejects(p);
  const evs = await waitEvents(sbx.sandboxId, seq, (e) => e.some((x) => x.detail.to === 'running'));
  assert.ok(evs.some((x) => x.detail.to === 'running'), JSON.stringify(evs));
  assert.equal((await sbx.commands.run('echo still')).stdout, 'still\n');
});

test('a sandbox killed during a wait: the wait ends, the caller still gets its answer', async () => {
  const other = await Sandbox.create('base', { ...sg.opts });
  const seq = await lastSeq(other.sandboxId);
  const p = fetch(`${modelsUrl}/v1/chat/completions`, {
    method: 'POST', body: JSON.stringify({ model: 'mock-gpt', messages: [{ role: 'user', content: 'killed' }] }),
    headers: { authorization: `Bearer ${llmKey}`, 'x-sandgate-sandbox': other.sandboxId,
      'content-type': 'application/json', 'x-mock-latency-ms': '1500' },
  });
  const evs = await waitEvents(other.sandboxId, seq, (e) => e.some((x) => x.detail.to === 'paused'));
  assert.ok(evs.some((x) => x.detail.to === 'paused'), JSON.stringify(evs));
  await other.kill();
  const r = await p;
  assert.equal(r.status, 200);
  assert.equal((await r.json()).choices[0].message.content, 'mock reply 1 2 3');
  const after = await waitEvents(other.sandboxId, seq, (e) => e.some((x) => x.detail.to === 'dead'));
  assert.ok(after.some((x) => x.detail.to === 'dead' && x.detail.reason === 'sandbox killed'), JSON.stringify(after));
  // The other sandbox is unaffected.
  assert.equal((await sbx.commands.run('echo fine')).stdout, 'fine\n');
});

test('bad input gets the provider-shaped error and never reaches the upstream', async () => {
  const post = (path, body, headers = {}) =>
    fetch(`${modelsUrl}${path}`, { method: 'POST', body,
      headers: { authorization: `Bearer ${llmKey}`, 'content-type': 'application/json', ...headers } });
  const before = mock.requests.length;
  let r = await post('/v1/chat/completions', '{"model": ');
  assert.equal(r.status, 400);
  let j = await r.json();
  assert.equal(j.error.type, 'invalid_request_error');
  assert.match(j.error.message, /JSON/);
  r = await post('/v1/messages', '{"messages": []}', { 'anthropic-version': '2023-06-01' });
  assert.equal(r.status, 400);
  j = await r.json();
  assert.deepEqual([j.type, j.error.type], ['error', 'invalid_request_error']);
  r = await post('/v1/chat/completions', JSON.stringify({ model: 'x', pad: 'p'.repeat(70_000) }));
  assert.equal(r.status, 413);
  assert.ok((await r.json()).error.message.includes('limit'));
  r = await post('/v1/chat/completions', '{"model":"mock-gpt"}', { authorization: '' });
  assert.equal(r.status, 401);
  assert.equal((await r.json()).error.code, 'invalid_api_key');
  r = await post('/v1/messages', '{"model":"mock-claude"}', { authorization: 'Bearer sk-sg-' + '0'.repeat(48), 'anthropic-version': '2023-06-01' });
  assert.equal(r.status, 401);
  assert.equal((await r.json()).error.type, 'authentication_error');
  // An E2B API key is not a model key.
  r = await post('/v1/chat/completions', '{"model":"mock-gpt"}', { authorization: `Bearer ${sg.key}` });
  assert.equal(r.status, 401);
  // A binding to a sandbox this tenant does not have.
  r = await post('/v1/chat/completions', '{"model":"mock-gpt","messages":[]}', { 'x-sandgate-sandbox': 'nosuchsandbox0000000' });
  assert.equal(r.status, 404);
  assert.equal(mock.requests.length, before, 'none of these reached the upstream');
  // Unknown model: the upstream's own 404, unchanged.
  r = await post('/v1/chat/completions', '{"model":"no-such-model","messages":[{"role":"user","content":"x"}]}');
  const direct = await fetch(mock.url + '/v1/chat/completions', { method: 'POST',
    body: '{"model":"no-such-model","messages":[{"role":"user","content":"x"}]}',
    headers: { authorization: `Bearer ${UPSTREAM_KEY}`, 'content-type': 'application/json' } });
  assert.equal(r.status, direct.status);
  assert.equal(await r.text(), await direct.text());
  // Upstream errors pass through with their headers.
  r = await post('/v1/chat/completions', '{"model":"mock-gpt","messages":[]}', { 'x-mock-status': '429', 'x-mock-retry-after': '7' });
  assert.equal(r.status, 429);
  assert.equal(r.headers.get('retry-after'), '7');
});

test('upstream down: 502 in the provider\'s shape', async () => {
  // A tenant whose upstream listens nowhere.
  const key = cli('tenant', 'create', 'downstream');
  assert.match(key, /^e2b_/);
  // Another tenant sees none of this sandbox's events or usage.
  const ev = await fetch(`${sg.url}/sandboxes/${sbx.sandboxId}/events`, { headers: { 'X-API-KEY': key } });
  assert.equal(ev.status, 404);
  const us = await (await fetch(`${sg.url}/llm/usage?sandboxID=${sbx.sandboxId}`, { headers: { 'X-API-KEY': key } })).json();
  assert.deepEqual([us.requests.length, us.totals.requests], [0, 0]);
  const keyFile = join(tmp, 'k2');
  writeFileSync(keyFile, 'sk-whatever-0123456789\n');
  cli('llm', 'upstream', 'set', 'anthropic', '--tenant', 'downstream', '--base-url', 'http://127.0.0.1:1', '--key-file', keyFile);
  const vk = cli('llm', 'key', 'create', 'downstream');
  const r = await fetch(`${modelsUrl}/v1/messages`, { method: 'POST',
    body: '{"model":"mock-claude","max_tokens":5,"messages":[{"role":"user","content":"x"}]}',
    headers: { 'x-api-key': vk, 'anthropic-version': '2023-06-01', 'content-type': 'application/json' } });
  assert.equal(r.status, 502);
  const j = await r.json();
  assert.deepEqual([j.type, j.error.type], ['error', 'api_error']);
});

// A TLS front for the mock: the certificate names 127.0.0.1, not 127.0.0.2.
async function tlsFront(host) {
  const srv = tls.createServer({ key: readFileSync(join(HERE, 'tls', 'server.key')), cert: readFileSync(join(HERE, 'tls', 'server.pem')) },
    (c) => { const u = net.connect(new URL(mock.url).port, '127.0.0.1'); c.pipe(u).pipe(c); c.on('error', () => u.destroy()); u.on('error', () => c.destroy()); });
  await new Promise((r) => srv.listen(0, host, r));
  return srv;
}

test('TLS upstreams: verified certificate and host name, else 502', async () => {
  const good = await tlsFront('127.0.0.1');
  const bad = await tlsFront('127.0.0.2');
  try {
    const keyFile = join(tmp, 'k3');
    writeFileSync(keyFile, UPSTREAM_KEY + '\n');
    cli('tenant', 'create', 'tlsok');
    cli('tenant', 'create', 'tlsbad');
    cli('llm', 'upstream', 'set', 'openai', '--tenant', 'tlsok', '--base-url', `https://127.0.0.1:${good.address().port}`, '--key-file', keyFile);
    cli('llm', 'upstream', 'set', 'openai', '--tenant', 'tlsbad', '--base-url', `https://127.0.0.2:${bad.address().port}`, '--key-file', keyFile);
    const body = '{"model":"mock-gpt","messages":[{"role":"user","content":"over tls"}]}';
    const ask = (vk) => fetch(`${modelsUrl}/v1/chat/completions`, { method: 'POST', body,
      headers: { authorization: `Bearer ${vk}`, 'content-type': 'application/json' } });
    const before = mock.requests.length;
    let r = await ask(cli('llm', 'key', 'create', 'tlsok'));
    assert.equal(r.status, 200, await r.clone().text());
    assert.equal((await r.json()).choices[0].message.content, 'mock reply 1 2 3');
    assert.equal(mock.requests.at(-1).headers.host, `127.0.0.1:${good.address().port}`);
    r = await ask(cli('llm', 'key', 'create', 'tlsbad'));
    assert.equal(r.status, 502);
    assert.equal((await r.json()).error.type, 'server_error');
    assert.equal(mock.requests.length, before + 1, 'the unverified upstream got nothing');
  } finally {
    good.close();
    bad.close();
  }
});

test('inside the sandbox only the model API is served on the proxy address', async () => {
  const r = await sbx.commands.run(
    `curl -s -o /dev/null -w '%{http_code}' -H 'E2b-Sandbox-Id: ${sbx.sandboxId}' http://127.0.0.1:49982/sandboxes; ` +
      `echo; curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:49982/health`,
  );
  assert.equal(r.stdout, '404\n404');
});

test('/metrics: pauses, paused seconds, resume latency, waits by outcome, tokens', async () => {
  const r = await fetch(`${sg.url}/metrics`);
  assert.equal(r.status, 200);
  assert.match(r.headers.get('content-type'), /^text\/plain; version=0\.0\.4/);
  const t = await r.text();
  const val = (re) => Number((t.match(re) ?? [])[1]);
  assert.ok(val(/^sandgate_wait_pauses_total (\d+)/m) >= 5, t);
  assert.ok(val(/^sandgate_wait_paused_seconds_total ([\d.e+-]+)/m) > 2);
  assert.ok(val(/^sandgate_wait_resume_latency_seconds_count (\d+)/m) >= 5);
  assert.ok(val(/^sandgate_waits_total\{outcome="completed"\} (\d+)/m) >= 5);
  assert.ok(val(/^sandgate_waits_total\{outcome="client_gone"\} (\d+)/m) >= 1);
  assert.ok(val(/^sandgate_llm_tokens_total\{provider="openai",kind="output"\} (\d+)/m) >= 10);
  assert.ok(val(/^sandgate_llm_resume_to_delivery_seconds_count (\d+)/m) >= 3);
});

// Last: it spends the tenant's request budget (--llm-rate 50/s, burst 100).
test('the tenant request rate limit answers 429 with Retry-After in the provider shape', async () => {
  const before = mock.requests.length;
  // Three bursts' worth at once: whatever the machine's speed, the bucket
  // (100) plus its refill while they are served cannot cover them all.
  const rs = await Promise.all(Array.from({ length: 300 }, () =>
    fetch(`${modelsUrl}/v1/models`, { headers: { authorization: `Bearer ${llmKey}` } })));
  const limited = rs.filter((r) => r.status === 429);
  assert.ok(limited.length >= 1, 'none of 300 was limited');
  assert.ok(rs.filter((r) => r.status === 200).length >= 90);
  assert.equal(rs.filter((r) => r.status !== 200 && r.status !== 429).length, 0);
  const j = await limited[0].json();
  assert.equal(j.error.type, 'rate_limit_exceeded');
  assert.ok(Number(limited[0].headers.get('retry-after')) >= 1);
  assert.equal(mock.requests.length - before, rs.filter((r) => r.status === 200).length, 'refused requests never reach the upstream');
  await Promise.all(rs.filter((r) => !r.bodyUsed).map((r) => r.text()));
});
