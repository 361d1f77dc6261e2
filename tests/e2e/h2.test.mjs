// HTTP/2 over TLS (node:http2): ALPN picks h2; control plane and envd relay
// on one connection, streaming Connect responses, large bodies both ways,
// error answers (502 unknown sandbox, 413 over the control-plane limit).
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { fileURLToPath } from 'node:url';
import { readFileSync } from 'node:fs';
import { randomBytes } from 'node:crypto';
import http2 from 'node:http2';
import { startSandgate } from './server.mjs';

const tls = (f) => fileURLToPath(new URL('./tls/' + f, import.meta.url));
let server;
let session;

before(async () => {
  server = await startSandgate(['--tls-cert', tls('server.pem'), '--tls-key', tls('server.key')]);
  session = http2.connect(server.url, { ca: readFileSync(tls('ca.pem')) });
  await new Promise((resolve, reject) => { session.once('connect', resolve); session.once('error', reject); });
});

after(async () => {
  if (session) await new Promise((r) => session.close(r));
  if (server) await server.stop();
});

// One request; resolves with status, headers, body (Buffer) and the time
// of each data event.
function request(headers, body, onData) {
  return new Promise((resolve, reject) => {
    const req = session.request(headers);
    const chunks = [];
    let res = {};
    req.on('response', (h) => { res = h; });
    req.on('data', (d) => { chunks.push(d); if (onData) onData(d); });
    req.on('end', () => resolve({ status: res[':status'], headers: res, body: Buffer.concat(chunks) }));
    req.on('error', reject);
    if (body !== undefined) req.end(body); else req.end();
  });
}

const json = (r) => JSON.parse(r.body.toString());

async function createSandbox() {
  const r = await request({ ':method': 'POST', ':path': '/v2/sandboxes', 'x-api-key': server.key,
    'content-type': 'application/json' }, JSON.stringify({ templateID: 'base' }));
  assert.equal(r.status, 201, r.body.toString());
  return json(r);
}

const envd = (sbx) => ({ 'e2b-sandbox-id': sbx.sandboxID, 'e2b-sandbox-port': '49983',
  'x-access-token': sbx.envdAccessToken ?? '' });

function envelope(obj, flags = 0) {
  const msg = Buffer.from(JSON.stringify(obj));
  const head = Buffer.alloc(5);
  head[0] = flags;
  head.writeUInt32BE(msg.length, 1);
  return Buffer.concat([head, msg]);
}

function envelopes(buf) {
  const out = [];
  for (let i = 0; i + 5 <= buf.length;) {
    const n = buf.readUInt32BE(i + 1);
    out.push({ flags: buf[i], msg: JSON.parse(buf.subarray(i + 5, i + 5 + n).toString() || '{}') });
    i += 5 + n;
  }
  return out;
}

test('ALPN selects h2; health and the control plane answer', async () => {
  assert.equal(session.alpnProtocol, 'h2');
  const h = await request({ ':path': '/health' });
  assert.equal(h.status, 200);
  const sbx = await createSandbox();
  assert.ok(sbx.sandboxID);
  const list = await request({ ':path': '/v2/sandboxes', 'x-api-key': server.key });
  assert.equal(list.status, 200);
  assert.ok(json(list).some((s) => s.sandboxID === sbx.sandboxID));
});

test('20 concurrent requests on one connection', async () => {
  const all = await Promise.all(Array.from({ length: 20 }, (_, i) =>
    request({ ':path': i % 2 ? '/health' : '/v2/sandboxes', 'x-api-key': server.key })));
  for (const r of all) assert.equal(r.status, 200);
});

test('envd: Connect server stream arrives envelope by envelope', async () => {
  const sbx = await createSandbox();
  const start = Date.now();
  let firstData = 0;
  const r = await request({ ':method': 'POST', ':path': '/process.Process/Start', ...envd(sbx),
    'content-type': 'application/connect+json', 'connect-protocol-version': '1' },
  envelope({ process: { cmd: '/bin/bash', args: ['-l', '-c', 'for i in 1 2 3; do echo $i; sleep 0.2; done'] } }),
  () => { if (!firstData) firstData = Date.now(); });
  const end = Date.now();
  assert.equal(r.status, 200, r.body.toString());
  const evs = envelopes(r.body);
  const last = evs[evs.length - 1];
  assert.equal(last.flags & 2, 2, 'end-of-stream envelope last');
  const out = evs.map((e) => e.msg?.event?.data?.stdout).filter(Boolean)
    .map((b) => Buffer.from(b, 'base64').toString()).join('');
  assert.equal(out, '1\n2\n3\n', JSON.stringify(evs));
  assert.ok(evs.some((e) => e.msg?.event?.end), 'end event');
  assert.ok(end - firstData >= 300, `first data ${firstData - start} ms, end ${end - start} ms: not streamed`);
});

test('envd: 5 MiB upload and download round trip', async () => {
  const sbx = await createSandbox();
  const big = randomBytes(5 * 1024 * 1024);
  const up = await request({ ':method': 'POST', ':path': '/files?path=/tmp/h2big.bin', ...envd(sbx),
    'content-type': 'application/octet-stream' }, big);
  assert.equal(up.status, 200, up.body.toString());
  const down = await request({ ':path': '/files?path=/tmp/h2big.bin', ...envd(sbx) });
  assert.equal(down.status, 200);
  assert.equal(down.body.length, big.length);
  assert.ok(down.body.equals(big));
});

test('unknown sandbox: 502 JSON', async () => {
  const r = await request({ ':path': '/health', 'e2b-sandbox-id': 'aaaaaaaaaaaaaaaaaaaa', 'e2b-sandbox-port': '49983' });
  assert.equal(r.status, 502);
  assert.equal(json(r).code, 502);
  assert.equal(json(r).sandboxId, 'aaaaaaaaaaaaaaaaaaaa');
});

test('control-plane body over the limit: 413', async () => {
  const big = Buffer.alloc(2 * 1024 * 1024, 'a');
  const withLength = await request({ ':method': 'POST', ':path': '/v2/sandboxes', 'x-api-key': server.key,
    'content-type': 'application/json', 'content-length': String(big.length) }, big);
  assert.equal(withLength.status, 413);
  assert.equal(json(withLength).code, 413);
  const streamed = await request({ ':method': 'POST', ':path': '/v2/sandboxes', 'x-api-key': server.key,
    'content-type': 'application/json' }, big);
  assert.equal(streamed.status, 413);
  // The connection is still good.
  assert.equal((await request({ ':path': '/health' })).status, 200);
});

test('client RST_STREAM closes the upstream; the connection goes on', async () => {
  const sbx = await createSandbox();
  const req = session.request({ ':method': 'POST', ':path': '/process.Process/Start', ...envd(sbx),
    'content-type': 'application/connect+json', 'connect-protocol-version': '1' });
  req.end(envelope({ process: { cmd: '/bin/bash', args: ['-l', '-c', 'while true; do echo tick; sleep 0.1; done'] } }));
  await new Promise((resolve, reject) => { req.once('data', resolve); req.once('error', reject); });
  req.close(http2.constants.NGHTTP2_CANCEL);
  await new Promise((r) => req.on('close', r));
  assert.equal((await request({ ':path': '/health' })).status, 200);
  // The process ends with its stream (envd kills it when the channel closes)
  // or keeps running; either way the gateway holds no buffer for it.
  const list = await request({ ':method': 'POST', ':path': '/process.Process/List', ...envd(sbx),
    'content-type': 'application/json' }, '{}');
  assert.equal(list.status, 200);
});

const rssKiB = () => Number(/VmRSS:\s+(\d+)/.exec(readFileSync(`/proc/${server.pid}/status`, 'utf8'))[1]);

test('flow control: a paused h2 reader does not grow the gateway', async () => {
  const sbx = await createSandbox();
  const req = session.request({ ':method': 'POST', ':path': '/process.Process/Start', ...envd(sbx),
    'content-type': 'application/connect+json', 'connect-protocol-version': '1' });
  req.end(envelope({ process: { cmd: '/bin/bash', args: ['-l', '-c', 'yes'] } }));
  await new Promise((resolve, reject) => { req.once('data', resolve); req.once('error', reject); });
  req.pause();
  await new Promise((r) => setTimeout(r, 500));
  const before = rssKiB();
  // `yes` could produce gigabytes meanwhile; the window and the 256 KiB
  // stream buffer hold the gateway still.
  await new Promise((r) => setTimeout(r, 3000));
  const grown = rssKiB() - before;
  assert.ok(grown < 4 * 1024, `gateway RSS grew by ${grown} KiB while the client was paused`);
  req.resume();
  let more = 0;
  await new Promise((resolve) => req.on('data', (d) => { more += d.length; if (more > 1 << 20) resolve(); }));
  req.close(http2.constants.NGHTTP2_CANCEL);
  await new Promise((r) => req.on('close', r));
  assert.equal((await request({ ':path': '/health' })).status, 200);
});

test('model API routes over h2 answer 505 in the provider\'s shape (they are served over HTTP/1.1)', async () => {
  let r = await request({ ':method': 'POST', ':path': '/v1/chat/completions', 'content-type': 'application/json',
    authorization: 'Bearer sk-sg-' + '0'.repeat(48) }, '{"model":"m","messages":[]}');
  assert.equal(r.status, 505);
  assert.equal(json(r).error.type, 'invalid_request_error');
  assert.match(json(r).error.message, /HTTP\/1\.1/);
  r = await request({ ':method': 'POST', ':path': '/v1/messages', 'content-type': 'application/json',
    'anthropic-version': '2023-06-01', 'x-api-key': 'sk-sg-' + '0'.repeat(48) }, '{"model":"m"}');
  assert.equal(r.status, 505);
  assert.equal(json(r).type, 'error');
  // The connection carries on.
  r = await request({ ':method': 'GET', ':path': '/health' });
  assert.equal(r.status, 200);
});
