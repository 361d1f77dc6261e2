// Issue 21 item 1: a restart of sandgate loses nothing. Sandboxes made
// through the official E2B JS SDK outlive a crash (SIGKILL) and a clean
// stop (SIGTERM) of the server; the next sandgate on the same data
// directory takes them back, with their files and running processes, and a
// paused one stays paused and resumes with its files. A second sandgate on
// a data directory in use is refused and changes nothing.
// Run by CTest (`e2e_js_restart`).
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { Sandbox } from 'e2b';
import { startSandgate } from './server.mjs';

const N = 20;
let server;
const boxes = [];  // { id, token, pid }
let pausedId;

before(async () => {
  server = await startSandgate([], { keep: true });
});

after(async () => {
  if (!server) return;
  // The last start does not keep sandboxes: it marks them lost and
  // removes them, and its stop leaves nothing behind.
  try {
    await server.signal('SIGTERM');
  } catch {}
  try {
    await server.restart(false);
  } catch {}
  await server.stop();
});

// Each sandbox's file, its background process and its envd answering.
async function checkAll(label) {
  await Promise.all(boxes.map(async (b) => {
    const sbx = await Sandbox.connect(b.id, server.opts);
    assert.equal(await sbx.files.read('/home/user/kept.txt'), `kept ${b.id}\n`, `${label}: ${b.id} file`);
    const procs = await sbx.commands.list();
    assert.ok(procs.some((p) => p.pid === b.pid), `${label}: ${b.id} lost its background process ${b.pid}`);
    const r = await sbx.commands.run(`kill -0 ${b.pid} && echo alive`);
    assert.equal(r.stdout, 'alive\n', `${label}: ${b.id}`);
  }));
}

test(`${N} sandboxes with files and background processes survive SIGKILL and SIGTERM of sandgate`, async () => {
  for (let i = 0; i < N; i++) {
    const sbx = await Sandbox.create('base', { ...server.opts, timeoutMs: 600_000 });
    await sbx.files.write('/home/user/kept.txt', `kept ${sbx.sandboxId}\n`);
    const h = await sbx.commands.run('sleep 100000', { background: true });
    boxes.push({ id: sbx.sandboxId, pid: h.pid });
  }
  const p = await Sandbox.create('base', { ...server.opts, timeoutMs: 600_000 });
  await p.files.write('/home/user/paused.txt', 'still here\n');
  assert.equal(await p.pause(), true);
  pausedId = p.sandboxId;

  // A crash: nothing is stopped in order.
  const killed = await server.signal('SIGKILL');
  assert.equal(killed.signal, 'SIGKILL');
  const t0 = Date.now();
  await server.restart();
  await checkAll('after SIGKILL');
  console.log(`# restart after SIGKILL: ${N} sandboxes serving again ${Date.now() - t0} ms after the new start`);

  const listed = await Sandbox.list({ ...server.opts, limit: 100 }).nextItems();
  const byId = new Map(listed.map((s) => [s.sandboxId, s.state]));
  for (const b of boxes) assert.equal(byId.get(b.id), 'running', b.id);
  assert.equal(byId.get(pausedId), 'paused');

  // A clean stop (an upgrade) keeps them as well.
  const stopped = await server.signal('SIGTERM');
  assert.equal(stopped.code, 0);
  await server.restart();
  await checkAll('after SIGTERM');
});

test('a paused sandbox stays paused across a restart and resumes with its files', async () => {
  const info = await Sandbox.getInfo(pausedId, server.opts);
  assert.equal(info.state, 'paused');
  const sbx = await Sandbox.connect(pausedId, server.opts);
  assert.equal(await sbx.files.read('/home/user/paused.txt'), 'still here\n');
  assert.equal((await sbx.getInfo()).state, 'running');
});

test('a filesystem-only pause (keepMemory false) frees the processes, survives a crash, and resumes from its files', async () => {
  const sbx = await Sandbox.create('base', { ...server.opts, timeoutMs: 600_000 });
  await sbx.files.write('/home/user/disk.txt', 'on disk\n');
  await sbx.commands.run('sleep 100000', { background: true });
  assert.ok((await sbx.commands.run('ps -eo args')).stdout.split('\n').includes('sleep 100000'));
  assert.equal(await sbx.pause({ keepMemory: false }), true);
  assert.equal((await sbx.getInfo()).state, 'paused');
  // Its processes are gone: nothing of the runtime sandbox is left.
  assert.equal(existsSync(join(server.dir, 'data', 'sandboxes', sbx.sandboxId)), false);
  // Traffic does not resume it (E2B: only connect does).
  await assert.rejects(sbx.files.read('/home/user/disk.txt'));

  await server.signal('SIGKILL');
  await server.restart();
  assert.equal((await Sandbox.getInfo(sbx.sandboxId, server.opts)).state, 'paused');
  const back = await Sandbox.connect(sbx.sandboxId, server.opts);
  assert.equal(await back.files.read('/home/user/disk.txt'), 'on disk\n');
  // A fresh start: the background process is not there.
  assert.deepEqual(await back.commands.list(), []);
  const ps = (await back.commands.run('ps -eo args')).stdout.split('\n');
  assert.ok(!ps.includes('sleep 100000'), ps.join('; '));
  assert.equal((await back.commands.run('echo $((6*7))')).stdout, '42\n');
  await back.kill();
  await checkAll('after a filesystem-only pause and a crash');
});

test('SIGTERM drains: a command in progress finishes before sandgate exits, and the sandbox runs on', async () => {
  const sbx = await Sandbox.create('base', { ...server.opts, timeoutMs: 600_000 });
  // Two seconds of work, in progress when the SIGTERM comes: the drain
  // lets it finish (without it, its stream is cut and run() rejects).
  const running = sbx.commands.run('sleep 2; echo drained');
  for (const deadline = Date.now() + 20000; ;) {
    if ((await sbx.commands.list()).some((p) => (p.args ?? []).join(' ').includes('sleep 2'))) break;
    if (Date.now() > deadline) assert.fail('the command never started');
  }
  const stopped = server.signal('SIGTERM');
  const r = await running;
  assert.equal(r.stdout, 'drained\n');
  assert.equal((await stopped).code, 0);
  await server.restart();
  const back = await Sandbox.connect(sbx.sandboxId, server.opts);
  assert.equal((await back.commands.run('echo still')).stdout, 'still\n');
  await back.kill();
});

test('a second sandgate on the same data directory is refused and touches nothing', async () => {
  const second = await server.second();
  assert.notEqual(second.code, 0);
  assert.match(second.out, /in use by another sandgate/);
  await checkAll('after a refused second instance');
});

test('a killed sandbox stays killed across a restart; one whose processes died meanwhile is lost', async () => {
  const gone = boxes.pop();
  await Sandbox.kill(gone.id, server.opts);
  const dies = boxes.pop();
  const stopped = await server.signal('SIGTERM');
  assert.equal(stopped.code, 0);
  // While no sandgate runs, its init dies (the host's pid, from the record
  // the runtime keeps beside its files).
  const rec = JSON.parse(readFileSync(join(server.dir, 'data', 'sandboxes', dies.id, 'sandbox.json'), 'utf8'));
  process.kill(rec.pid, 'SIGKILL');
  await server.restart();
  await assert.rejects(Sandbox.connect(gone.id, server.opts));
  await assert.rejects(Sandbox.connect(dies.id, server.opts));
  const listed = await Sandbox.list({ ...server.opts, limit: 100 }).nextItems();
  assert.ok(!listed.some((s) => s.sandboxId === dies.id || s.sandboxId === gone.id));
  await checkAll('after a kill and a restart');
});
