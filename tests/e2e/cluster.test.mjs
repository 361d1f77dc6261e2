// Issue 22: cluster mode. Three sandgate nodes and a three-member etcd
// cluster, all started here, each in a network namespace of its own with
// its own address (tests/e2e/fixtures/cluster.mjs); the official E2B JS SDK talks to
// one node only (n1, with n1's key) and reaches sandboxes on all three:
// commands, files, an HTTP server and a WebSocket server in the sandbox,
// pause/resume, list, kill; tenants, keys and a quota that hold across the
// nodes. Then the faults: a forged forwarded request, an etcd member lost,
// a node partitioned away (and healed), a node lost (its sandbox reported
// lost, never running; creates go on elsewhere).
// Run by CTest (`e2e_js_cluster`).
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, spawnSync } from 'node:child_process';
import http from 'node:http';
import http2 from 'node:http2';
import https from 'node:https';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import WebSocket from 'ws';
import { Sandbox, Template } from 'e2b';
import { startCluster, until } from './fixtures/cluster.mjs';

let cluster;
let nodes;  // id -> server
let etcd;   // the members: { name, client, peer, proc }
let etcdUrl;
let opts;  // the SDK's options: n1 only
const nodeOf = (id) => cluster.nodeOf(id);
const drain = (id, on) => cluster.drain(id, on);

before(async () => {
  cluster = await startCluster({ extra: ['--cluster-lease-ttl', '2', '--cluster-lost-grace', '0'], tls: ['n3'], keep: ['n2'] });
  ({ nodes, etcd, etcdUrl } = cluster);
  opts = { ...nodes.n1.opts, timeoutMs: 300_000 };
});

after(async () => {
  if (cluster) await cluster.stop();
});

const placed = {};  // node id -> a Sandbox created through n1 that landed there

// A create through n1 that lands on node `id`: the other nodes drained
// for it (placement reads the drain marks from its mirror of etcd).
async function createOn(id, o = opts, template = 'base') {
  const others = ['n1', 'n2', 'n3'].filter((x) => x !== id);
  for (const x of others) await drain(x, true);
  try {
    return await until(async () => {
      const s = await Sandbox.create(template, o);
      if ((await nodeOf(s.sandboxId)) === id) return s;
      await s.kill();
      return null;
    }, `a create on ${id}`);
  } finally {
    for (const x of others) await drain(x, false);
  }
}

// The status of a GET at a node, over HTTPS with the test's certificate
// where the node serves TLS (n3).
function statusAt(id, path, headers) {
  const url = new URL(nodes[id].url + path);
  const mod = url.protocol === 'https:' ? https : http;
  return new Promise((resolve, reject) => {
    const req = mod.get(url, { headers, ca: cluster.tlsCert }, (res) => {
      res.resume();
      res.on('end', () => resolve(res.statusCode));
    });
    req.on('error', reject);
  });
}

function cli(args) {
  return new Promise((resolve, reject) => {
    const p = spawn(process.env.SANDGATE_BIN, args);
    let out = '';
    let err = '';
    p.stdout.on('data', (c) => { out += c; });
    p.stderr.on('data', (c) => { err += c; });
    p.on('exit', (code) => (code === 0 ? resolve(out) : reject(new Error(`sandgate ${args.join(' ')}: ${code} ${err}`))));
  });
}

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
  for (const id of ['n1', 'n2', 'n3']) placed[id] ??= await createOn(id);
  const out = await cli(['node', 'list', '--cluster', etcdUrl]);
  for (const id of ['n1', 'n2', 'n3']) {
    // n3 serves clients over TLS: the others reach it on its cluster port.
    const port = id === 'n3' ? 3001 : 3000;
    assert.match(out, new RegExp(`^${id}\\t${cluster.spaces[id].addr.replaceAll('.', '\\.')}:${port}\\tprocess\\t`, 'm'));
  }
});

test('tenants and keys are the cluster\'s: any node\'s key works on every node', async () => {
  // n3 printed its own key for tenant "local": it works through n1.
  const viaN3Key = await Sandbox.create('base', { ...opts, apiKey: nodes.n3.key });
  assert.equal((await viaN3Key.commands.run('echo k')).stdout, 'k\n');
  await viaN3Key.kill();
  const bad = await fetch(`${nodes.n2.url}/v2/sandboxes`, { headers: { 'X-API-KEY': 'e2b_' + '0'.repeat(40) } });
  assert.equal(bad.status, 401);
  // Keys of the cluster, listed from etcd; a model-proxy key likewise.
  assert.equal((await cli(['key', 'list', 'local', '--cluster', etcdUrl])).match(/\tactive\t/g).length, 3);
  const llmKey = (await cli(['llm', 'key', 'create', 'local', '--name', 'agent', '--cluster', etcdUrl])).trim();
  assert.match(llmKey, /^sk-sg-[0-9a-f]{48}$/);
  assert.match(await cli(['llm', 'key', 'list', 'local', '--cluster', etcdUrl]), /\tagent\tactive\t/);
});

test('a tenant\'s quota holds across nodes; revoking it reaches every node', async () => {
  const key = (await cli(['tenant', 'create', 'team2', '--max-sandboxes', '3', '--cluster', etcdUrl])).trim();
  assert.match(key, /^e2b_[0-9a-f]{40}$/);
  const t2 = { ...opts, apiKey: key };
  // One on each node: with per-node quotas each node would allow 3.
  const boxes = [];
  for (const id of ['n1', 'n2', 'n3']) boxes.push(await createOn(id, t2));
  for (const b of boxes) assert.equal((await b.commands.run('echo q')).stdout, 'q\n');
  // The fourth, through any node, is over the cluster-wide limit.
  for (const entry of ['n1', 'n2']) {
    const r = await fetch(`${nodes[entry].url}/sandboxes`, {
      method: 'POST', headers: { 'X-API-KEY': key, 'Content-Type': 'application/json' },
      body: JSON.stringify({ templateID: 'base' }),
    });
    assert.equal(r.status, 429, `create through ${entry}`);
    assert.match((await r.json()).message, /across the cluster/);
  }
  // A kill frees a slot for a create anywhere.
  await boxes[0].kill();
  const again = await Sandbox.create('base', t2);
  boxes[0] = again;
  // Revoked in etcd: every node refuses the key and ends the sandboxes.
  await cli(['tenant', 'revoke', 'team2', '--cluster', etcdUrl]);
  for (const entry of ['n1', 'n2', 'n3']) {
    await until(async () => (await statusAt(entry, '/v2/sandboxes', { 'X-API-KEY': key })) === 401,
      `${entry} refusing the revoked key`, 10000);
  }
  await until(async () => {
    const r = await fetch(`${nodes.n1.url}/v2/sandboxes?state=running`, { headers: { 'X-API-KEY': nodes.n1.key } });
    return r.status === 200;
  }, 'n1 answering');
  for (const b of boxes) {
    await until(async () => (await nodeOf(b.sandboxId)) === null, `sandbox ${b.sandboxId} of the revoked tenant ended`, 15000);
  }
  // A forwarded request for it, with the right cluster key, is refused too.
  const secret = readFileSync(join(cluster.dir, 'cluster-secret'), 'utf8').trim();
  const forwarded = await fetch(`${nodes.n2.url}/v2/sandboxes`, {
    headers: { 'X-Sandgate-Cluster-Key': secret, 'X-Sandgate-Tenant': 'team2' },
  });
  assert.equal(forwarded.status, 401);
  assert.match((await forwarded.json()).message, /revoked/);
});

test('bad cluster flags are refused at start with a clear error', async () => {
  const dir = mkdtempSync(join(tmpdir(), 'sandgate-cluster-flags-'));
  try {
    const short = join(dir, 'short');
    writeFileSync(short, 'tooshort\n', { mode: 0o600 });
    const good = join(dir, 'good');
    writeFileSync(good, 'x'.repeat(32) + '\n', { mode: 0o600 });
    const cases = [
      [['--cluster', etcdUrl], /needs --cluster-secret-file/],
      [['--cluster', etcdUrl, '--cluster-secret-file', short], /shorter than 16 characters/],
      [['--cluster', 'etcd://no-port', '--cluster-secret-file', good], /--cluster: etcd endpoint: malformed address/],
      [['--cluster', etcdUrl, '--cluster-secret-file', good, '--node-id', 'bad id'], /--node-id "bad id"/],
      [['--cluster', etcdUrl, '--cluster-secret-file', good, '--tls-cert', good, '--tls-key', good], /needs --cluster-listen/],
    ];
    for (const [flags, message] of cases) {
      const r = spawnSync(process.env.SANDGATE_BIN, ['serve', '--listen', '127.0.0.1:0', '--data-dir', join(dir, 'data'),
        '--cgroup-parent', 'sgflags-' + process.pid, '--process-swap', 'off', '--code-interpreter', 'off', ...flags],
      { encoding: 'utf8', timeout: 60000 });
      assert.equal(r.status, 1, `${flags.join(' ')}: ${r.stderr}`);
      assert.match(r.stderr, message);
    }
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
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

test('HTTP/2 over TLS at one node reaches a sandbox on another; the cluster port serves nodes only', async () => {
  const sbx = placed.n1;
  await sbx.commands.run('mkdir -p /tmp/h2 && echo over-h2 > /tmp/h2/x.txt');
  await sbx.commands.run('cd /tmp/h2 && python3 -m http.server 8001 --bind 127.0.0.1 >/dev/null 2>&1', { background: true });
  await sbx.commands.run('for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/8001) 2>/dev/null && exit 0; sleep 0.05; done; exit 1');
  assert.match(nodes.n3.url, /^https:/);
  const client = http2.connect(nodes.n3.url, { ca: cluster.tlsCert });
  try {
    const get = (path) => new Promise((resolve, reject) => {
      const req = client.request({ ':path': path, 'e2b-sandbox-id': sbx.sandboxId, 'e2b-sandbox-port': '8001' });
      let data = '';
      let status;
      req.on('response', (h) => { status = h[':status']; });
      req.setEncoding('utf8');
      req.on('data', (c) => { data += c; });
      req.on('end', () => resolve({ status, data }));
      req.on('error', reject);
      req.end();
    });
    // Two streams at once on the one connection, each through the tunnel.
    const [a, b] = await Promise.all([get('/x.txt'), get('/x.txt')]);
    assert.equal(a.status, 200);
    assert.equal(a.data, 'over-h2\n');
    assert.equal(b.data, 'over-h2\n');
  } finally {
    client.close();
  }
  // The cluster port: no client requests, no sandbox traffic without the key.
  const direct = await fetch(`http://${cluster.spaces.n3.addr}:3001/v2/sandboxes`, { headers: { 'X-API-KEY': nodes.n1.key } });
  assert.equal(direct.status, 403);
});

test('pause and resume, list and kill of sandboxes on other nodes, through n1', async () => {
  const sbx = placed.n2;
  await sbx.files.write('/home/user/kept.txt', 'kept\n');
  assert.equal(await sbx.pause(), true);
  assert.equal((await Sandbox.getInfo(sbx.sandboxId, opts)).state, 'paused');
  const back = await Sandbox.connect(sbx.sandboxId, opts);
  assert.equal(await back.files.read('/home/user/kept.txt'), 'kept\n');
  assert.equal((await Sandbox.getInfo(sbx.sandboxId, opts)).state, 'running');
  // sandgate's own routes: the sandbox's events from its node, model usage
  // from every node.
  const ev = await fetch(`${nodes.n1.url}/sandboxes/${sbx.sandboxId}/events`, { headers: { 'X-API-KEY': nodes.n1.key } });
  assert.equal(ev.status, 200);
  const kinds = (await ev.json()).map((e) => e.kind);
  for (const k of ['created', 'paused', 'resumed']) assert.ok(kinds.includes(k), `events: ${kinds.join(',')}`);
  const usage = await fetch(`${nodes.n1.url}/llm/usage`, { headers: { 'X-API-KEY': nodes.n1.key } });
  assert.equal(usage.status, 200);
  assert.equal(usage.headers.get('x-sandgate-missing-nodes'), null);
  assert.ok(Array.isArray((await usage.json()).requests));

  // A fork of it, through n1: the forks are on its node and in the
  // catalog at once.
  const forks = await sbx.fork({ count: 2, timeoutMs: 120_000 });
  assert.equal(forks.length, 2);
  for (const f of forks) {
    assert.equal(await cluster.nodeOf(f.sandboxId), 'n2');
    assert.equal(await f.files.read('/home/user/kept.txt'), 'kept\n');
    await f.kill();
  }

  const listed = [];
  const paginator = Sandbox.list(opts);
  while (paginator.hasNext) listed.push(...(await paginator.nextItems()));
  const ids = new Set(listed.map((s) => s.sandboxId));
  for (const s of Object.values(placed)) assert.ok(ids.has(s.sandboxId), `list misses ${s.sandboxId}`);

  const extra = await createOn('n2');
  await extra.kill();
  assert.equal(await nodeOf(extra.sandboxId), null);
  await assert.rejects(Sandbox.getInfo(extra.sandboxId, opts));
});

test('a template built through n1 is copied to the node a create lands on; a new build and a delete reach the copies', async (t) => {
  const version = (v) => Template().fromTemplate('base').runCmd(`echo ${v} > /etc/cluster-tpl`, { user: 'root' });
  const built = await Template.build(version('v1'), 'tpl-cluster', opts);
  // Published by n1 as the build ends (the creates below go to drained-for
  // nodes only, so they wait for it rather than fall back to n1).
  const record = () => spawnSync('etcdctl', ['--endpoints', etcdUrl, 'get', `/sandgate/templates/${built.templateId}`]).stdout.toString();
  await until(async () => record().includes('"tpl-cluster"'), 'the template\'s record in etcd');
  const pulled = async (id) => {
    const m = (await (await fetch(`${nodes[id].url}/metrics`)).text()).match(/^sandgate_cluster_template_files_pulled_total (\d+)$/m);
    return Number(m[1]);
  };
  const before2 = await pulled('n2');
  const first = await createOn('n2', opts, 'tpl-cluster');
  assert.equal((await first.commands.run('cat /etc/cluster-tpl')).stdout, 'v1\n');
  assert.ok((await pulled('n2')) > before2, 'n2 pulled the template\'s layer from n1');
  // On n3 too (TLS for clients, the node port between nodes).
  const third = await createOn('n3', opts, 'tpl-cluster');
  assert.equal((await third.commands.run('cat /etc/cluster-tpl')).stdout, 'v1\n');
  await third.kill();

  // A copy refuses changes: it names the node that built the template.
  const del = await fetch(`${nodes.n2.url}/templates/${built.templateId}`, { method: 'DELETE', headers: { 'X-API-KEY': nodes.n1.key } });
  assert.equal(del.status, 409);
  assert.match((await del.json()).message, /built on cluster node n1/);

  // A new build moves "default": the next create on n2 runs it, the
  // sandbox made before keeps its files.
  await Template.build(version('v2'), 'tpl-cluster', opts);
  const second = await until(async () => {
    const s = await createOn('n2', opts, 'tpl-cluster');
    if ((await s.commands.run('cat /etc/cluster-tpl')).stdout === 'v2\n') return s;
    await s.kill();
    return null;
  }, 'a create on n2 of the new build');
  assert.equal((await first.commands.run('cat /etc/cluster-tpl')).stdout, 'v1\n');
  await first.kill();
  await second.kill();

  // Deleted on n1: the copies go, and no node creates it any more.
  const gone = await fetch(`${nodes.n1.url}/templates/${built.templateId}`, { method: 'DELETE', headers: { 'X-API-KEY': nodes.n1.key } });
  assert.equal(gone.status, 204);
  await until(async () => {
    const r = await fetch(`${nodes.n2.url}/templates`, { headers: { 'X-API-KEY': nodes.n1.key } });
    return !(await r.json()).some((x) => x.templateID === built.templateId);
  }, 'n2 dropped its copy');
  for (const entry of ['n1', 'n2']) {
    const r = await fetch(`${nodes[entry].url}/sandboxes`, {
      method: 'POST', headers: { 'X-API-KEY': nodes.n1.key, 'Content-Type': 'application/json' },
      body: JSON.stringify({ templateID: 'tpl-cluster' }),
    });
    assert.equal(r.status, 404, `create of the deleted template through ${entry}`);
  }
  t.diagnostic(`n2 pulled ${(await pulled('n2')) - before2} template files`);
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
  const { hostname, port } = new URL(nodes.n2.url);
  const answer = await new Promise((resolve, reject) => {
    const s = connect(Number(port), hostname, () => {
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

test('a node restarted after a crash takes its id back and serves its sandboxes again', async () => {
  const sbx = await createOn('n2');
  await sbx.files.write('/home/user/r.txt', 'kept\n');
  await nodes.n2.signal('SIGKILL');
  // Started again at once: its old lease has not expired yet, and the same
  // address takes the id back.
  await nodes.n2.restart();
  const back = await until(async () => {
    try {
      return await Sandbox.connect(sbx.sandboxId, opts);
    } catch {
      return null;
    }
  }, 'the sandbox on n2 served through n1 after the restart', 20000);
  assert.equal(await back.files.read('/home/user/r.txt'), 'kept\n');
  assert.equal((await back.commands.run('echo again')).stdout, 'again\n');
  await back.kill();
});

test('a partitioned node stops taking creates and its sandbox is reported lost; healed, it serves it again', async () => {
  const sbx = await createOn('n2');
  await sbx.files.write('/home/user/p.txt', 'before\n');
  const member = async (id) => /^sandgate_cluster_member 1$/m.test(await (await fetch(`${nodes[id].url}/metrics`)).text());
  cluster.partition('n2');
  try {
    // n2 (which the test still reaches) counts itself out once its lease
    // is gone, and refuses creates.
    await until(async () => !(await member('n2')), 'n2 out of the cluster', 20000);
    const refused = await fetch(`${nodes.n2.url}/sandboxes`, {
      method: 'POST', headers: { 'X-API-KEY': nodes.n2.key, 'Content-Type': 'application/json' },
      body: JSON.stringify({ templateID: 'base' }),
    });
    assert.equal(refused.status, 503);
    assert.match((await refused.json()).message, /lost contact with the cluster/);
    // The others: n2's sandbox is lost (grace 0), never running; creates
    // go to the nodes that are there.
    await until(async () => {
      const r = await fetch(`${nodes.n1.url}/sandboxes/${sbx.sandboxId}`, { headers: { 'X-API-KEY': nodes.n1.key } });
      const body = await r.json();
      assert.notEqual(body.state, 'running');
      return r.status === 404 && /lost/.test(body.message);
    }, 'n1 reporting the sandbox on n2 lost', 20000);
    const elsewhere = await Sandbox.create('base', opts);
    assert.notEqual(await nodeOf(elsewhere.sandboxId), 'n2');
    await elsewhere.kill();
  } finally {
    cluster.heal('n2');
  }
  // Healed: n2 registers again and serves its sandbox, files and all.
  await until(async () => (await member('n2')), 'n2 back in the cluster', 20000);
  await until(async () => (await fetch(`${nodes.n1.url}/sandboxes/${sbx.sandboxId}`, { headers: { 'X-API-KEY': nodes.n1.key } })).status === 200,
    'n1 serving the sandbox on n2 again', 20000);
  const back = await Sandbox.connect(sbx.sandboxId, opts);
  assert.equal(await back.files.read('/home/user/p.txt'), 'before\n');
  await back.kill();
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
