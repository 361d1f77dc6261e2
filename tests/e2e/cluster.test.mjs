// Issue 22: cluster mode. Three sandgate nodes and a three-member etcd
// cluster, all started here on loopback; the official E2B JS SDK talks to
// one node only (n1, with n1's key) and reaches sandboxes on all three:
// commands, files, an HTTP server and a WebSocket server in the sandbox,
// pause/resume, list, kill. Then the faults: a forged forwarded request, an
// etcd member lost, a node lost (its sandbox reported lost, never running;
// creates go on elsewhere).
// Run by CTest (`e2e_js_cluster`).
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { mkdtempSync, rmSync, writeFileSync, readFileSync } from 'node:fs';
import { createServer } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { randomBytes } from 'node:crypto';
import WebSocket from 'ws';
import { Sandbox } from 'e2b';
import { startSandgate } from './server.mjs';

const dir = mkdtempSync(join(tmpdir(), 'sandgate-cluster-'));
const etcd = [];  // { name, client, peer, proc }
const nodes = {};  // id -> server
let opts;  // the SDK's options: n1 only
let etcdUrl;

function freePort() {
  return new Promise((resolve, reject) => {
    const s = createServer();
    s.on('error', reject);
    s.listen(0, '127.0.0.1', () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });
}

async function etcdAnswers(port) {
  try {
    const r = await fetch(`http://127.0.0.1:${port}/v3/kv/range`, { method: 'POST', body: '{"key":"AA=="}' });
    return r.status === 200;
  } catch {
    return false;
  }
}

async function until(cond, what, ms = 30000) {
  const deadline = Date.now() + ms;
  for (;;) {
    const v = await cond();
    if (v) return v;
    if (Date.now() > deadline) throw new Error('timed out waiting for ' + what);
    await new Promise((r) => setTimeout(r, 100));
  }
}

// The node the cluster catalog names for a sandbox (read from etcd).
async function nodeOf(id) {
  const key = Buffer.from(`/sandgate/sandboxes/${id}`).toString('base64');
  for (const m of etcd) {
    if (!m.proc) continue;
    try {
      const r = await fetch(`http://127.0.0.1:${m.client}/v3/kv/range`, { method: 'POST', body: JSON.stringify({ key }) });
      const j = await r.json();
      if (!j.kvs) return null;
      return JSON.parse(Buffer.from(j.kvs[0].value, 'base64').toString()).node;
    } catch {}
  }
  throw new Error('no etcd member answered');
}

async function drain(id, on) {
  const key = Buffer.from(`/sandgate/drain/${id}`).toString('base64');
  const m = etcd.find((x) => x.proc);
  const path = on ? 'put' : 'deleterange';
  const body = on ? { key, value: Buffer.from('1').toString('base64') } : { key };
  const r = await fetch(`http://127.0.0.1:${m.client}/v3/kv/${path}`, { method: 'POST', body: JSON.stringify(body) });
  assert.equal(r.status, 200);
}

before(async () => {
  for (let i = 0; i < 3; i++) etcd.push({ name: `e${i}`, client: await freePort(), peer: await freePort() });
  const initial = etcd.map((m) => `${m.name}=http://127.0.0.1:${m.peer}`).join(',');
  for (const m of etcd) {
    m.proc = spawn('etcd', ['--name', m.name, '--data-dir', join(dir, m.name),
      '--listen-client-urls', `http://127.0.0.1:${m.client}`, '--advertise-client-urls', `http://127.0.0.1:${m.client}`,
      '--listen-peer-urls', `http://127.0.0.1:${m.peer}`, '--initial-advertise-peer-urls', `http://127.0.0.1:${m.peer}`,
      '--initial-cluster', initial, '--initial-cluster-state', 'new', '--initial-cluster-token', 'sg-e2e',
      '--heartbeat-interval', '50', '--election-timeout', '500', '--logger', 'zap', '--log-outputs', join(dir, m.name + '.log')],
      { stdio: 'ignore' });
  }
  await until(async () => (await Promise.all(etcd.map((m) => etcdAnswers(m.client)))).every(Boolean), 'etcd');
  etcdUrl = 'etcd://' + etcd.map((m) => `127.0.0.1:${m.client}`).join(',');
  const secret = join(dir, 'cluster-secret');
  writeFileSync(secret, randomBytes(24).toString('hex') + '\n', { mode: 0o600 });
  for (const id of ['n1', 'n2', 'n3']) {
    nodes[id] = await startSandgate(['--cluster', etcdUrl, '--cluster-secret-file', secret, '--node-id', id,
      '--cluster-lease-ttl', '2', '--cluster-lost-grace', '0', '--warm-pool', '0', '--code-interpreter', 'off']);
  }
  opts = { ...nodes.n1.opts, timeoutMs: 300_000 };
});

after(async () => {
  for (const s of Object.values(nodes)) {
    try { await s.stop(); } catch {}
  }
  for (const m of etcd) if (m.proc) m.proc.kill('SIGKILL');
  rmSync(dir, { recursive: true, force: true });
});

const placed = {};  // node id -> a Sandbox created through n1 that landed there

test('creates through one node land on every node; node list shows them', async (t) => {
  const seen = new Set();
  const spread = [];
  for (let i = 0; i < 6; i++) {
    const sbx = await Sandbox.create('base', opts);
    const at = await nodeOf(sbx.sandboxId);
    assert.ok(['n1', 'n2', 'n3'].includes(at), `sandbox ${sbx.sandboxId} on ${at}`);
    seen.add(at);
    spread.push(at);
    placed[at] ??= sbx;
  }
  t.diagnostic(`6 creates through n1 landed on ${spread.join(' ')}`);
  assert.ok(seen.size >= 2, `6 creates all landed on ${[...seen]}`);
  // Each node gets at least one: the others drained for a create.
  for (const id of ['n1', 'n2', 'n3']) {
    if (placed[id]) continue;
    const others = ['n1', 'n2', 'n3'].filter((x) => x !== id);
    for (const o of others) await drain(o, true);
    // Placement reads the drain marks from its mirror of etcd.
    const sbx = await until(async () => {
      const s = await Sandbox.create('base', opts);
      if ((await nodeOf(s.sandboxId)) === id) return s;
      await s.kill();
      return null;
    }, `a create on ${id}`);
    placed[id] = sbx;
    for (const o of others) await drain(o, false);
  }
  const out = await new Promise((resolve, reject) => {
    const p = spawn(process.env.SANDGATE_BIN, ['node', 'list', '--cluster', etcdUrl]);
    let s = '';
    p.stdout.on('data', (c) => { s += c; });
    p.on('exit', (code) => (code === 0 ? resolve(s) : reject(new Error('node list: ' + code))));
  });
  for (const id of ['n1', 'n2', 'n3']) assert.match(out, new RegExp(`^${id}\\t127\\.0\\.0\\.1:\\d+\\tprocess\\t`, 'm'));
});

test('commands, files, an HTTP and a WebSocket server in sandboxes on other nodes, through n1', async () => {
  const wsScript = readFileSync(fileURLToPath(new URL('./fixtures/ws_echo.py', import.meta.url)), 'utf8');
  for (const [id, sbx] of Object.entries(placed)) {
    const r = await sbx.commands.run('echo hello from $(hostname)');
    assert.equal(r.exitCode, 0);
    assert.match(r.stdout, /^hello from /);
    await sbx.files.write('/home/user/node.txt', `on ${id}\n`);
    assert.equal(await sbx.files.read('/home/user/node.txt'), `on ${id}\n`);
    // Streaming output crosses the hop as it comes.
    const lines = [];
    await sbx.commands.run('for i in 1 2 3; do echo line$i; sleep 0.1; done', { onStdout: (l) => lines.push(l) });
    assert.deepEqual(lines.join('').trim().split('\n'), ['line1', 'line2', 'line3']);
  }
  const sbx = placed.n3;
  await sbx.files.write('/tmp/ws_echo.py', wsScript);
  await sbx.commands.run('python3 /tmp/ws_echo.py 8765 >/tmp/ws.log 2>&1', { background: true });
  await sbx.commands.run('mkdir -p /tmp/www && echo served > /tmp/www/index.txt');
  await sbx.commands.run('cd /tmp/www && python3 -m http.server 8000 --bind 127.0.0.1 >/tmp/http.log 2>&1', { background: true });
  await sbx.commands.run('for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/8765 && exec 4<>/dev/tcp/127.0.0.1/8000) 2>/dev/null && exit 0; sleep 0.05; done; exit 1');
  const headers = (port) => ({ 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': String(port) });
  const res = await fetch(nodes.n1.url + '/index.txt', { headers: headers(8000) });
  assert.equal(res.status, 200);
  assert.equal(await res.text(), 'served\n');
  const ws = new WebSocket(nodes.n1.url.replace('http', 'ws') + '/echo', { headers: headers(8765) });
  await new Promise((resolve, reject) => { ws.on('open', resolve); ws.on('error', reject); });
  const echoed = await new Promise((resolve) => { ws.once('message', (m) => resolve(m.toString())); ws.send('ping'); });
  assert.equal(echoed, 'ping');
  const big = 'z'.repeat(300000);
  const echoedBig = await new Promise((resolve) => { ws.once('message', (m) => resolve(m.toString())); ws.send(big); });
  assert.equal(echoedBig.length, big.length);
  ws.close();
});

test('pause and resume, list and kill of sandboxes on other nodes, through n1', async () => {
  const sbx = placed.n2;
  await sbx.files.write('/home/user/kept.txt', 'kept\n');
  assert.equal(await sbx.pause(), true);
  assert.equal((await Sandbox.getInfo(sbx.sandboxId, opts)).state, 'paused');
  const back = await Sandbox.connect(sbx.sandboxId, opts);
  assert.equal(await back.files.read('/home/user/kept.txt'), 'kept\n');
  assert.equal((await Sandbox.getInfo(sbx.sandboxId, opts)).state, 'running');

  const listed = [];
  const paginator = Sandbox.list(opts);
  while (paginator.hasNext) listed.push(...(await paginator.nextItems()));
  const ids = new Set(listed.map((s) => s.sandboxId));
  for (const s of Object.values(placed)) assert.ok(ids.has(s.sandboxId), `list misses ${s.sandboxId}`);

  const extra = await until(async () => {
    const s = await Sandbox.create('base', opts);
    if ((await nodeOf(s.sandboxId)) !== 'n1') return s;
    await s.kill();
    return null;
  }, 'a create off n1');
  await extra.kill();
  assert.equal(await nodeOf(extra.sandboxId), null);
  await assert.rejects(Sandbox.getInfo(extra.sandboxId, opts));
});

test('a forwarded request or tunnel without the cluster key is refused', async () => {
  const target = placed.n2;
  const forged = await fetch(`${nodes.n2.url}/sandboxes/${target.sandboxId}`, {
    headers: { 'X-Sandgate-Cluster-Key': 'not-the-secret', 'X-Sandgate-Tenant': 'local' },
  });
  assert.equal(forged.status, 401);
  assert.match((await forged.json()).message, /forged/);
  const killed = await fetch(`${nodes.n2.url}/sandboxes/${target.sandboxId}`, {
    method: 'DELETE', headers: { 'X-Sandgate-Cluster-Key': '', 'X-Sandgate-Tenant': 'local' },
  });
  assert.equal(killed.status, 401);
  // A raw CONNECT tunnel with a wrong key.
  const { connect } = await import('node:net');
  const port = Number(new URL(nodes.n2.url).port);
  const answer = await new Promise((resolve, reject) => {
    const s = connect(port, '127.0.0.1', () => {
      s.write(`CONNECT ${target.sandboxId}:49983 HTTP/1.1\r\nHost: x\r\nX-Sandgate-Cluster-Key: wrong\r\n\r\n`);
    });
    let got = '';
    s.on('data', (c) => { got += c; if (got.includes('\r\n\r\n')) { s.destroy(); resolve(got); } });
    s.on('error', reject);
  });
  assert.match(answer, /^HTTP\/1\.1 401 /);
  // The sandbox is untouched.
  assert.equal((await Sandbox.getInfo(target.sandboxId, opts)).state, 'running');
});

test('an etcd member lost: the cluster goes on', async () => {
  etcd[0].proc.kill('SIGKILL');
  etcd[0].proc = null;
  const sbx = await Sandbox.create('base', opts);
  assert.equal((await sbx.commands.run('echo ok')).stdout, 'ok\n');
  assert.ok(['n1', 'n2', 'n3'].includes(await nodeOf(sbx.sandboxId)));
  await sbx.kill();
});

test('a node lost: its sandbox is reported lost, never running; creates go elsewhere', async () => {
  const victim = placed.n3;
  await nodes.n3.signal('SIGKILL');
  // Once its lease (2 s) is gone: 404, and the SDK cannot connect.
  await until(async () => {
    const r = await fetch(`${nodes.n1.url}/sandboxes/${victim.sandboxId}`, { headers: { 'X-API-KEY': nodes.n1.key } });
    const body = await r.json();
    assert.notEqual(body.state, 'running');
    return r.status === 404 && /lost/.test(body.message);
  }, 'the sandbox on n3 reported lost', 20000);
  await assert.rejects(Sandbox.connect(victim.sandboxId, opts));
  for (let i = 0; i < 4; i++) {
    const sbx = await Sandbox.create('base', opts);
    assert.notEqual(await nodeOf(sbx.sandboxId), 'n3');
    assert.equal((await sbx.commands.run('echo ok')).stdout, 'ok\n');
    await sbx.kill();
  }
});
