// Issue 21 items 3 and 4 through the official E2B JS SDK: createSnapshot,
// listSnapshots, deleteSnapshot, Sandbox.create from a snapshot, and fork.
// On the process backend a snapshot holds the sandbox's files (its
// writable layer over its template's); memory and processes are not kept.
// Run by CTest (`e2e_js_snapshots`).
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import { join } from 'node:path';
import { Sandbox, SandboxNotFoundError } from 'e2b';
import { startSandgate } from './server.mjs';

let server, opts;

before(async () => {
  server = await startSandgate();
  opts = server.opts;
  // At most 12 live sandboxes, for the fork past the quota.
  execFileSync(process.env.SANDGATE_BIN, ['tenant', 'set-quota', 'local', '--max-sandboxes', '12',
    '--max-memory-mb', '65536', '--data-dir', join(server.dir, 'data')]);
});

after(async () => {
  if (server) await server.stop();
});

async function api(method, path, body) {
  const r = await fetch(server.url + path, {
    method,
    headers: { 'X-API-Key': server.key, 'Content-Type': 'application/json' },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  return { status: r.status, headers: r.headers, body: await r.json().catch(() => null) };
}

test('snapshot -> create from it -> the same files; the sandbox runs on', async () => {
  const sbx = await Sandbox.create('base', { ...opts, envs: { FROM_PARENT: 'yes' } });
  await sbx.files.write('/home/user/notes/a.txt', 'alpha\n');
  await sbx.commands.run('mkdir -p /home/user/bin && printf "#!/bin/sh\\necho tool\\n" > /home/user/bin/t && chmod 755 /home/user/bin/t && ln -s a.txt /home/user/notes/link');
  await sbx.commands.run('rm /etc/motd', { user: 'root' });
  const snap = await sbx.createSnapshot();
  assert.match(snap.snapshotId, /^[a-z0-9]{20}:default$/);
  assert.deepEqual(snap.names, []);
  const layer = join(server.dir, 'data', 'layers', 'snapshot-' + snap.snapshotId.split(':')[0]);
  assert.ok(existsSync(layer));
  // The sandbox was not stopped by it.
  assert.equal((await sbx.getInfo()).state, 'running');
  await sbx.files.write('/home/user/notes/a.txt', 'changed after the snapshot\n');

  const child = await Sandbox.create(snap.snapshotId, opts);
  assert.equal(await child.files.read('/home/user/notes/a.txt'), 'alpha\n');
  assert.equal(await child.files.read('/home/user/notes/link'), 'alpha\n');
  assert.equal((await child.commands.run('/home/user/bin/t')).stdout, 'tool\n');
  assert.equal((await child.commands.run('stat -c %U:%a /home/user/bin/t')).stdout, 'user:755\n');
  await assert.rejects(child.commands.run('test -e /etc/motd'));  // the deletion is kept
  const ls = await child.commands.run('ls /home/user/notes');
  assert.equal(ls.stdout, 'a.txt\nlink\n');

  // Listed, for its sandbox and by itself.
  const mine = await Sandbox.listSnapshots({ ...opts, sandboxId: sbx.sandboxId }).nextItems();
  assert.deepEqual(mine.map((s) => s.snapshotId), [snap.snapshotId]);
  const none = await Sandbox.listSnapshots({ ...opts, sandboxId: child.sandboxId }).nextItems();
  assert.deepEqual(none, []);
  // Not a template in the template list.
  const templates = await api('GET', '/templates');
  assert.ok(!templates.body.some((t) => snap.snapshotId.startsWith(t.templateID)));

  // A snapshot a sandbox runs cannot be deleted; once it is gone, it can.
  await assert.rejects(Sandbox.deleteSnapshot(snap.snapshotId, opts), /in use/);
  await child.kill();
  assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId, opts), true);
  // Its layer is collected (by the build service's worker, soon after).
  for (const deadline = Date.now() + 20000; existsSync(layer);) {
    if (Date.now() > deadline) assert.fail(`${layer} was not collected`);
    await new Promise((r) => setTimeout(r, 50));
  }
  assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId, opts), false);
  await assert.rejects(Sandbox.create(snap.snapshotId, opts), /not found/);
  assert.deepEqual(await Sandbox.listSnapshots({ ...opts, sandboxId: sbx.sandboxId }).nextItems(), []);
  await sbx.kill();
});

test('a named snapshot, a paused sandbox\'s snapshot, and pagination', async () => {
  const sbx = await Sandbox.create('base', opts);
  await sbx.files.write('/home/user/x', 'x1');
  const named = await Sandbox.createSnapshot(sbx.sandboxId, { ...opts, name: 'my-snap' });
  assert.equal(named.snapshotId, 'local/my-snap:default');
  assert.deepEqual(named.names, ['local/my-snap:default']);
  // A template's name that is not a snapshot is refused.
  await assert.rejects(Sandbox.createSnapshot(sbx.sandboxId, { ...opts, name: 'base' }), /exists/);
  const bad = await api('POST', `/sandboxes/${sbx.sandboxId}/snapshots`, { name: 'Bad Name!' });
  assert.equal(bad.status, 400);
  const unknown = await api('POST', `/sandboxes/${sbx.sandboxId}/snapshots`, { nam: 'x' });
  assert.equal(unknown.status, 400);

  await sbx.pause();
  await sbx.files.write('/home/user/x', 'x2').catch(() => {});  // resumes it (autoResume)
  await sbx.pause();
  const second = await sbx.createSnapshot();
  assert.equal((await sbx.getInfo()).state, 'paused', 'a paused sandbox stays paused');
  const third = await sbx.createSnapshot();

  const pager = Sandbox.listSnapshots({ ...opts, sandboxId: sbx.sandboxId, limit: 1 });
  const seen = [];
  while (pager.hasNext) seen.push(...(await pager.nextItems()));
  assert.deepEqual(seen.map((s) => s.snapshotId), [named.snapshotId, second.snapshotId, third.snapshotId]);
  const byName = await Sandbox.listSnapshots({ ...opts, name: 'my-snap' }).nextItems();
  assert.deepEqual(byName.map((s) => s.snapshotId), [named.snapshotId]);

  const fromNamed = await Sandbox.create(named.snapshotId, opts);
  assert.equal(await fromNamed.files.read('/home/user/x'), 'x1');
  const fromSecond = await Sandbox.create(second.snapshotId, opts);
  assert.equal(await fromSecond.files.read('/home/user/x'), 'x2');
  for (const s of [fromNamed, fromSecond, sbx]) await s.kill();
  for (const s of [named, second, third]) assert.equal(await Sandbox.deleteSnapshot(s.snapshotId, opts), true);
});

test('a named snapshot taken again is a new build of the same snapshot; sandboxes of the older one keep its files', async () => {
  const sbx = await Sandbox.create('base', opts);
  await sbx.files.write('/home/user/v', 'one');
  const v1 = await sbx.createSnapshot({ name: 'versions' });
  const fromV1 = await Sandbox.create(v1.snapshotId, opts);
  await sbx.files.write('/home/user/v', 'two');
  const v2 = await sbx.createSnapshot({ name: 'versions' });
  assert.equal(v2.snapshotId, v1.snapshotId);
  const listed = await Sandbox.listSnapshots({ ...opts, name: 'versions' }).nextItems();
  assert.equal(listed.length, 1);
  const fromV2 = await Sandbox.create(v2.snapshotId, opts);
  assert.equal(await fromV2.files.read('/home/user/v'), 'two');
  // A collection (a deleted snapshot asks for one) keeps what fromV1 runs.
  const other = await sbx.createSnapshot();
  assert.equal(await Sandbox.deleteSnapshot(other.snapshotId, opts), true);
  const otherLayer = join(server.dir, 'data', 'layers', 'snapshot-' + other.snapshotId.split(':')[0]);
  for (const deadline = Date.now() + 20000; existsSync(otherLayer);) {
    if (Date.now() > deadline) assert.fail('no collection ran');
    await new Promise((r) => setTimeout(r, 50));
  }
  // v1's layer is snapshot-<template id> (the template was made by it).
  const tpl = await api('GET', '/templates/versions');
  assert.equal(tpl.status, 200);
  assert.ok(existsSync(join(server.dir, 'data', 'layers', 'snapshot-' + tpl.body.templateID)));
  assert.equal(await fromV1.files.read('/home/user/v'), 'one');
  assert.equal((await fromV1.commands.run('cat /home/user/v')).stdout, 'one');
  for (const s of [fromV1, fromV2, sbx]) await s.kill();
  assert.equal(await Sandbox.deleteSnapshot(v1.snapshotId, opts), true);
});

test('fork of 4: each has the parent\'s files, environment and metadata; counted against the quota', async () => {
  const parent = await Sandbox.create('base', { ...opts, envs: { FORKED: 'from-parent' }, metadata: { role: 'parent' } });
  await parent.files.write('/home/user/state.json', '{"step":7}');
  const results = await parent.fork({ count: 4, timeoutMs: 120_000 });
  assert.equal(results.length, 4);
  const ids = new Set();
  for (const f of results) {
    assert.ok(f instanceof Sandbox, String(f));
    const s = f;
    ids.add(s.sandboxId);
    assert.equal(await s.files.read('/home/user/state.json'), '{"step":7}');
    assert.equal((await s.commands.run('echo $FORKED')).stdout, 'from-parent\n');
    assert.equal((await s.getInfo()).metadata.role, 'parent');
    // Each fork is its own: writes stay in it.
    await s.files.write('/home/user/own', s.sandboxId);
  }
  assert.equal(ids.size, 4);
  assert.ok(!ids.has(parent.sandboxId));
  assert.equal((await parent.getInfo()).state, 'running');
  await assert.rejects(parent.files.read('/home/user/own'));
  // The forks' snapshot is not listed.
  assert.deepEqual(await Sandbox.listSnapshots({ ...opts, sandboxId: parent.sandboxId }).nextItems(), []);

  // 12 sandboxes at most: 5 live, a fork of 10 gets 7 and 3 quota errors.
  const many = await Sandbox.fork(parent.sandboxId, { ...opts, count: 10 });
  const ok = many.filter((f) => !(f instanceof Error));
  const failed = many.filter((f) => f instanceof Error);
  assert.equal(ok.length, 7);
  assert.equal(failed.length, 3);
  for (const e of failed) assert.match(e.message, /quota|limit/i);
  for (const f of [...ok, ...results]) await Sandbox.kill(f.sandboxId, opts);
  await parent.kill();
});

test('snapshot and fork of unknown, killed or other tenants\' sandboxes; bad fork bodies', async () => {
  await assert.rejects(Sandbox.createSnapshot('nosuchsandbox0000000', opts), SandboxNotFoundError);
  await assert.rejects(Sandbox.fork('nosuchsandbox0000000', { ...opts, count: 1 }), SandboxNotFoundError);
  const sbx = await Sandbox.create('base', opts);
  await sbx.kill();
  await assert.rejects(sbx.createSnapshot(), SandboxNotFoundError);
  await assert.rejects(Sandbox.fork(sbx.sandboxId, { ...opts, count: 2 }), SandboxNotFoundError);
  const live = await Sandbox.create('base', opts);
  for (const body of [{ count: 0 }, { count: 65 }, { count: 'two' }, { timeout: -1 }, { extra: 1 }]) {
    const r = await api('POST', `/sandboxes/${live.sandboxId}/fork`, body);
    assert.equal(r.status, 400, JSON.stringify(body));
  }
  const list = await api('GET', '/snapshots?limit=0');
  assert.equal(list.status, 400);
  await live.kill();
});
