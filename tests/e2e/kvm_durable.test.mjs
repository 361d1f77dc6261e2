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
import { counterAdvances } from './kvm_common.mjs';
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
    const h = await sbx.commands.run('i=0; while :; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.1; done',
      { background: true, timeoutMs: 0 });
    await h.disconnect();
    const deadline = Date.now() + 60_000;
    while (!(await sbx.files.exists('/tmp/counter'))) {
      if (Date.now() > deadline) assert.fail('the background process never wrote /tmp/counter');
      await sbx.commands.run('sleep 0.2');
    }
    await counterAdvances(sbx);
  });

  // Issue 21 on microVMs: a snapshot and a fork carry the sandbox's memory
  // and running processes (a clone of a VM snapshot), not only its files.
  // The proof is a process that holds 4 MiB of random bytes only in its
  // memory and, on SIGUSR1, writes their checksum again.
  const memProc = 'import hashlib, os, signal\n' +
    'b = os.urandom(4 << 20)\n' +
    'h = hashlib.sha256(b).hexdigest()\n' +
    'open("/tmp/mem-sum.tmp", "w").write(h)\n' +
    'os.rename("/tmp/mem-sum.tmp", "/tmp/mem-sum")\n' +
    'def again(*_):\n' +
    '    open("/tmp/mem-sum-now.tmp", "w").write(hashlib.sha256(b).hexdigest())\n' +
    '    os.rename("/tmp/mem-sum-now.tmp", "/tmp/mem-sum-now")\n' +
    'signal.signal(signal.SIGUSR1, again)\n' +
    'while True:\n' +
    '    signal.pause()\n';
  let memPid, memSum;

  // Asks the memory process in s for its checksum now; returns it.
  async function memSumNow(s) {
    await s.commands.run(`rm -f /tmp/mem-sum-now; kill -USR1 ${memPid}`, { timeoutMs: 120_000 });
    const deadline = Date.now() + 120_000;
    while (!(await s.files.exists('/tmp/mem-sum-now'))) {
      if (Date.now() > deadline) assert.fail(`pid ${memPid} did not answer SIGUSR1 in ${s.sandboxId}`);
      await s.commands.run('sleep 0.2');
    }
    return s.files.read('/tmp/mem-sum-now');
  }

  test('snapshot of a microVM: a sandbox made from it runs on with the memory and processes; the parent too', { timeout: 600_000 }, async () => {
    await sbx.files.write('/home/user/mem.py', memProc);
    const h = await sbx.commands.run('python3 /home/user/mem.py', { background: true, timeoutMs: 0 });
    memPid = h.pid;
    await h.disconnect();
    const deadline = Date.now() + 120_000;
    while (!(await sbx.files.exists('/tmp/mem-sum'))) {
      if (Date.now() > deadline) assert.fail('the memory process never wrote /tmp/mem-sum');
      await sbx.commands.run('sleep 0.2');
    }
    memSum = await sbx.files.read('/tmp/mem-sum');
    assert.match(memSum, /^[0-9a-f]{64}$/);
    assert.equal(await memSumNow(sbx), memSum);

    const snap = await sbx.createSnapshot({ requestTimeoutMs: 600_000 });
    assert.match(snap.snapshotId, /^[a-z0-9]{20}:default$/);
    // The parent runs on, its process and streams too.
    await counterAdvances(sbx);
    assert.equal((await sbx.commands.run('echo parent')).stdout, 'parent\n');

    const child = await Sandbox.create(snap.snapshotId, { ...opts, timeoutMs: 300_000 });
    try {
      assert.notEqual(child.sandboxId, sbx.sandboxId);
      assert.equal(await child.files.read('/home/user/state.txt').then((t) => t.slice(0, 12)), 'kvm harness\n');
      assert.equal(await memSumNow(child), memSum, 'the child has the process and its memory');
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
        assert.equal(await memSumNow(f), memSum, `fork ${f.sandboxId} has the process's memory`);
        await f.files.write('/home/user/own', f.sandboxId);
      }
      assert.equal(ids.size, 4);
      assert.ok(!ids.has(sbx.sandboxId));
      for (const f of results) assert.equal(await f.files.read('/home/user/own'), f.sandboxId);
      assert.equal(await memSumNow(sbx), memSum, 'the parent runs on');
    } finally {
      for (const f of results) if (f instanceof Sandbox) await f.kill().catch(() => {});
    }
  });

}
