// envd through the gateway with the unmodified official E2B JS SDK:
// commands, files, transparent resume of a paused sandbox, any sandbox port
// (HTTP and WebSocket) and the 502 answer for unknown sandboxes.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import WebSocket from 'ws';
import { Sandbox, CommandExitError } from 'e2b';
import { startSandgate } from './server.mjs';

let server, opts, sbx;

before(async () => {
  server = await startSandgate();
  opts = server.opts;
  sbx = await Sandbox.create('base', { ...opts, envs: { SANDBOX_WIDE: 'yes' } });
});

after(async () => {
  if (sbx) await sbx.kill().catch(() => {});
  if (server) await server.stop();
});

test('commands.run: stdout, exit codes, envs, cwd, default env', async () => {
  const r = await sbx.commands.run('echo hi');
  assert.equal(r.stdout, 'hi\n');
  assert.equal(r.exitCode, 0);
  await assert.rejects(sbx.commands.run('echo oops >&2; exit 3'), (e) => {
    assert.ok(e instanceof CommandExitError);
    assert.equal(e.exitCode, 3);
    assert.equal(e.stderr, 'oops\n');
    return true;
  });
  const env = await sbx.commands.run('echo $FOO $SANDBOX_WIDE; pwd; whoami', { envs: { FOO: 'bar' }, cwd: '/tmp' });
  assert.equal(env.stdout, 'bar yes\n/tmp\nuser\n');
  const root = await sbx.commands.run('whoami', { user: 'root' });
  assert.equal(root.stdout, 'root\n');
});

test('background command, list and kill', async () => {
  const h = await sbx.commands.run('sleep 600', { background: true });
  assert.ok(h.pid > 0);
  const procs = await sbx.commands.list();
  assert.ok(procs.some((p) => p.pid === h.pid));
  assert.equal(await sbx.commands.kill(h.pid), true);
  await assert.rejects(h.wait(), CommandExitError);
});

test('commands: stdin, sendStdin, closeStdin', async () => {
  const h = await sbx.commands.run('cat', { background: true, stdin: true });
  await sbx.commands.sendStdin(h.pid, 'typed\n');
  await sbx.commands.closeStdin(h.pid);
  const r = await h.wait();
  assert.equal(r.stdout, 'typed\n');
});

test('pty: create, input, resize, kill', async () => {
  let out = '';
  let sawIt;
  const saw = new Promise((r) => { sawIt = r; });
  const h = await sbx.pty.create({ cols: 100, rows: 30, onData: (d) => {
    out += new TextDecoder().decode(d);
    if (out.includes('size=30x100') || out.includes('size=40x120')) sawIt();
  } });
  await sbx.pty.sendInput(h.pid, new TextEncoder().encode('echo size=$(stty size | tr " " x)\n'));
  await saw;
  assert.match(out, /size=30x100/);
  await sbx.pty.resize(h.pid, { cols: 120, rows: 40 });
  assert.equal(await sbx.pty.kill(h.pid), true);
});

test('files: large file, rename, watch', async () => {
  const big = new Uint8Array(8 * 1024 * 1024);
  for (let i = 0; i < big.length; i++) big[i] = (i * 7919) & 0xff;
  await sbx.files.write('/tmp/big.bin', big.buffer);
  const back = new Uint8Array(await sbx.files.read('/tmp/big.bin', { format: 'bytes' }));
  assert.equal(back.length, big.length);
  assert.ok(back.every((b, i) => b === big[i]));
  await sbx.files.rename('/tmp/big.bin', '/tmp/big2.bin');
  assert.equal(await sbx.files.exists('/tmp/big.bin'), false);
  assert.equal((await sbx.files.getInfo('/tmp/big2.bin')).size, big.length);

  await sbx.files.makeDir('/tmp/watched');
  const seen = [];
  let gotIt;
  const got = new Promise((r) => { gotIt = r; });
  const w = await sbx.files.watchDir('/tmp/watched', (ev) => { seen.push(ev); if (ev.name === 'new.txt') gotIt(); });
  await sbx.files.write('/tmp/watched/new.txt', 'n');
  await got;
  await w.stop();
  assert.ok(seen.some((e) => e.name === 'new.txt'));
});

test('files: procfs files read whole (st_size 0, short and past 64 KiB)', async () => {
  assert.match(await sbx.files.read('/proc/version'), /^Linux version /);
  // A process whose environment is 100 KB: its /proc/PID/environ is sent
  // chunked to its end, through the gateway.
  const a = 'a'.repeat(100_000);
  const h = await sbx.commands.run(`X=${a} exec sleep 600`, { background: true });
  const deadline = Date.now() + 30_000;
  let env = '';
  while (!env.includes(`X=${a}\0`)) {
    if (Date.now() > deadline) assert.fail(`/proc/${h.pid}/environ never held X (${env.length} bytes)`);
    env = await sbx.files.read(`/proc/${h.pid}/environ`);
  }
  assert.ok(env.length > 100_000);
  await h.kill();
});

test('files: write, read, list, exists, makeDir, remove', async () => {
  await sbx.files.write('/tmp/e2e/a.txt', 'x');
  assert.equal(await sbx.files.read('/tmp/e2e/a.txt'), 'x');
  const bytes = new Uint8Array([0, 1, 2, 255, 254]);
  await sbx.files.write('/tmp/e2e/b.bin', bytes.buffer);
  assert.deepEqual(new Uint8Array(await sbx.files.read('/tmp/e2e/b.bin', { format: 'bytes' })), bytes);
  const names = (await sbx.files.list('/tmp/e2e')).map((e) => e.name).sort();
  assert.deepEqual(names, ['a.txt', 'b.bin']);
  assert.equal(await sbx.files.exists('/tmp/e2e/nope'), false);
  assert.equal(await sbx.files.makeDir('/tmp/e2e/d'), true);
  assert.equal(await sbx.files.makeDir('/tmp/e2e/d'), false);
  await sbx.files.remove('/tmp/e2e/a.txt');
  assert.equal(await sbx.files.exists('/tmp/e2e/a.txt'), false);
  // Relative paths resolve in the user's home.
  await sbx.files.write('rel.txt', 'home');
  assert.equal((await sbx.commands.run('cat /home/user/rel.txt')).stdout, 'home');
});

test('traffic to a paused sandbox resumes it first', async () => {
  assert.equal(await sbx.pause(), true);
  assert.equal((await sbx.getInfo()).state, 'paused');
  const r = await sbx.commands.run('echo awake');
  assert.equal(r.stdout, 'awake\n');
  assert.equal((await sbx.getInfo()).state, 'running');
});

test('any port: an HTTP server and a WebSocket echo server inside the sandbox', async () => {
  const wsScript = readFileSync(fileURLToPath(new URL('./fixtures/ws_echo.py', import.meta.url)), 'utf8');
  await sbx.files.write('/tmp/ws_echo.py', wsScript);
  await sbx.commands.run('python3 /tmp/ws_echo.py 8765 >/tmp/ws.log 2>&1', { background: true });
  await sbx.commands.run('mkdir -p /tmp/www && echo served > /tmp/www/index.txt');
  await sbx.commands.run('cd /tmp/www && python3 -m http.server 8000 --bind 127.0.0.1 >/tmp/http.log 2>&1',
    { background: true });
  // Wait for both listeners from inside the sandbox (no sleeps on this side).
  await sbx.commands.run('for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/8765 && exec 4<>/dev/tcp/127.0.0.1/8000) 2>/dev/null && exit 0; sleep 0.05; done; exit 1');

  const headers = (port) => ({ 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': String(port) });
  const res = await fetch(server.url + '/index.txt', { headers: headers(8000) });
  assert.equal(res.status, 200);
  assert.equal(await res.text(), 'served\n');
  // HEAD: a length, no body; the connection stays usable.
  const head = await fetch(server.url + '/index.txt', { method: 'HEAD', headers: headers(8000) });
  assert.equal(head.status, 200);
  assert.equal(head.headers.get('content-length'), '7');
  assert.equal((await fetch(server.url + '/index.txt', { headers: headers(8000) })).status, 200);

  const ws = new WebSocket(server.url.replace('http', 'ws') + '/echo', { headers: headers(8765) });
  await new Promise((resolve, reject) => { ws.on('open', resolve); ws.on('error', reject); });
  const echoed = await new Promise((resolve) => { ws.once('message', (m) => resolve(m.toString())); ws.send('ping'); });
  assert.equal(echoed, 'ping');
  const big = 'z'.repeat(200000);
  const echoedBig = await new Promise((resolve) => { ws.once('message', (m) => resolve(m.toString())); ws.send(big); });
  assert.equal(echoedBig.length, big.length);
  ws.close();

  // A port nothing listens on: 502 as E2B's proxy answers.
  const closed = await fetch(server.url + '/', { headers: headers(9) });
  assert.equal(closed.status, 502);
  assert.equal((await closed.json()).code, 502);
});

test('unknown sandbox: JSON 502 with E2B proxy shape', async () => {
  const res = await fetch(server.url + '/health', { headers: { 'E2b-Sandbox-Id': 'aaaaaaaaaaaaaaaaaaaa', 'E2b-Sandbox-Port': '49983' } });
  assert.equal(res.status, 502);
  const body = await res.json();
  assert.equal(body.code, 502);
  assert.equal(body.sandboxId, 'aaaaaaaaaaaaaaaaaaaa');
  assert.equal(await Sandbox.connect('aaaaaaaaaaaaaaaaaaaa', opts).then(() => 'ok', () => 'rejected'), 'rejected');
});
