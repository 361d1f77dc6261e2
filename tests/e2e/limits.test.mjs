// A sandbox's limits as the unmodified official E2B JS SDK meets them, on
// the process backend: the disk (a 64 MiB writable layer here) ends in the
// SDK's NotEnoughSpaceError for an upload and in ENOSPC for a command,
// without touching a sibling; root inside is not the host's root.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { Sandbox, CommandExitError, NotEnoughSpaceError } from 'e2b';
import { startSandgate } from './server.mjs';

let server, opts, a, b;

before(async () => {
  server = await startSandgate(['--sandbox-disk-mb', '64']);
  opts = server.opts;
  a = await Sandbox.create('base', opts);
  b = await Sandbox.create('base', opts);
});

after(async () => {
  for (const s of [a, b]) if (s) await s.kill().catch(() => {});
  if (server) await server.stop();
});

test('the disk: df shows its size, a big upload is NotEnoughSpaceError, a command gets ENOSPC, the sibling writes on', async (t) => {
  const df = await a.commands.run("df -Pk / | awk 'NR==2 {print $2}'");
  const kib = Number(df.stdout.trim());
  // No disk limit at all (no loop devices): / is the host's filesystem.
  // Anything smaller must be the 64 MiB asked for.
  if (kib > 4 * 1024 * 1024) {
    t.skip(`no disk limit on this host (/ is ${kib} KiB; loop devices missing?)`);
    return;
  }
  assert.ok(kib > 40000 && kib <= 65536, `disk of ${kib} KiB, not the 64 MiB of --sandbox-disk-mb`);
  await assert.rejects(a.files.write('/home/user/big.bin', new Uint8Array(80 << 20).fill(7)), (e) => {
    assert.ok(e instanceof NotEnoughSpaceError, `${e.constructor.name}: ${e.message}`);
    return true;
  });
  await assert.rejects(a.commands.run('dd if=/dev/zero of=/home/user/fill bs=1M count=100'), (e) => {
    assert.ok(e instanceof CommandExitError);
    assert.match(e.stderr, /No space left on device/);
    return true;
  });
  // The sandbox still works once space is freed; the sibling never noticed.
  await a.commands.run('rm -f /home/user/fill /home/user/big.bin');
  await a.files.write('/home/user/small.txt', 'still here');
  assert.equal(await a.files.read('/home/user/small.txt'), 'still here');
  await b.files.write('/home/user/f.bin', new Uint8Array(16 << 20));
  const size = await b.commands.run('stat -c %s /home/user/f.bin');
  assert.equal(size.stdout.trim(), String(16 << 20));
});

test('root inside is a user-namespace root: an unprivileged uid range of the host', async (t) => {
  const map = await a.commands.run('cat /proc/self/uid_map', { user: 'root' });
  const [inside, outside, count] = map.stdout.trim().split(/\s+/).map(Number);
  if (outside === 0) {
    t.skip('no user namespace on this host');
    return;
  }
  assert.equal(inside, 0);
  assert.ok(outside >= 65536, `host uid ${outside}`);
  assert.equal(count, 65536);
  const id = await a.commands.run('id -u', { user: 'root' });
  assert.equal(id.stdout.trim(), '0');
  // Another sandbox has a range of its own.
  const mapB = await b.commands.run('cat /proc/self/uid_map', { user: 'root' });
  assert.notEqual(Number(mapB.stdout.trim().split(/\s+/)[1]), outside);
});
