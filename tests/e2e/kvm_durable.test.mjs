// Issue 21 on microVMs through the official E2B JS SDK, in the KVM harness
// (tests/kvm-harness; CTest kvm_harness_durable, with kvm_restart.test.mjs
// after it in the same boot): a snapshot of a running microVM and a fork
// of 4 carry its files, its running processes and their memory (clones of
// a microVM snapshot, docs/vmm.md "Snapshots of sandboxes, fork and pause
// to disk"); the parent runs on. Harness mode only: where /dev/kvm works
// for real, run it with SANDGATE_E2E_URL and SANDGATE_E2E_KEY pointing at a
// kvm sandgate.
import { test, after } from 'node:test';
import assert from 'node:assert/strict';
import { counterAdvances, startCounter, startMemProc, sumNow } from './kvm_common.mjs';
import { Sandbox } from 'e2b';

const remote = process.env.SANDGATE_E2E_URL;
const STEP = { timeout: 240_000 };

if (!remote) {
  test('kvm durable (harness mode only)', { skip: 'needs a kvm sandgate: SANDGATE_E2E_URL (tests/kvm-harness/harness.sh)' }, () => {});
} else {
  const opts = { apiUrl: remote, sandboxUrl: remote, apiKey: process.env.SANDGATE_E2E_KEY, requestTimeoutMs: 120_000 };
  let sbx;

  after(async () => {
    if (sbx) await sbx.kill().catch(() => {});
  });

  test('a microVM with a file and a background process', STEP, async () => {
    sbx = await Sandbox.create('base', { ...opts, timeoutMs: 900_000 });
    const body = 'kvm harness\n' + 'x'.repeat(64 * 1024) + '\n';
    await sbx.files.write('/home/user/state.txt', body);
    await startCounter(sbx);
    await counterAdvances(sbx);
  });

  // A snapshot and a fork carry the sandbox's memory and running processes
  // (a clone of a VM snapshot), not only its files: the proof is the
  // memory process of kvm_common.mjs, whose checksum must come back equal.
  let memPid, memSum;

  test('snapshot of a microVM: a sandbox made from it runs on with the memory and processes; the parent too', { timeout: 600_000 }, async () => {
    ({ pid: memPid, sum: memSum } = await startMemProc(sbx));
    assert.match(memSum, /^[0-9a-f]{64}$/);
    assert.equal(await sumNow(sbx, memPid), memSum);

    const snap = await sbx.createSnapshot({ requestTimeoutMs: 600_000 });
    assert.match(snap.snapshotId, /^[a-z0-9]{20}:default$/);
    // The parent runs on, its process and streams too.
    await counterAdvances(sbx);
    assert.equal((await sbx.commands.run('echo parent')).stdout, 'parent\n');

    const child = await Sandbox.create(snap.snapshotId, { ...opts, timeoutMs: 300_000 });
    try {
      assert.notEqual(child.sandboxId, sbx.sandboxId);
      assert.equal(await child.files.read('/home/user/state.txt').then((t) => t.slice(0, 12)), 'kvm harness\n');
      assert.equal(await sumNow(child, memPid), memSum, 'the child has the process and its memory');
      await counterAdvances(child);
      // Its own from here on.
      await child.files.write('/home/user/child-only', 'c');
      await assert.rejects(sbx.files.read('/home/user/child-only'));
    } finally {
      await child.kill().catch(() => {});
    }
    assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId, opts), true);
  });

  test('fork of 4 microVMs: each has the parent\'s files, its running process and that process\'s memory', { timeout: 900_000 }, async () => {
    const results = await sbx.fork({ count: 4, timeoutMs: 300_000, requestTimeoutMs: 900_000 });
    assert.equal(results.length, 4);
    const ids = new Set();
    try {
      for (const f of results) {
        assert.ok(f instanceof Sandbox, String(f));
        ids.add(f.sandboxId);
        assert.equal(await f.files.read('/home/user/state.txt').then((t) => t.slice(0, 12)), 'kvm harness\n');
        assert.equal(await sumNow(f, memPid), memSum, `fork ${f.sandboxId} has the process's memory`);
        await f.files.write('/home/user/own', f.sandboxId);
      }
      assert.equal(ids.size, 4);
      assert.ok(!ids.has(sbx.sandboxId));
      for (const f of results) assert.equal(await f.files.read('/home/user/own'), f.sandboxId);
      assert.equal(await sumNow(sbx, memPid), memSum, 'the parent runs on');
    } finally {
      for (const f of results) if (f instanceof Sandbox) await f.kill().catch(() => {});
    }
  });

}
