// Issue 21 item 1 on microVMs, in the KVM harness (tests/kvm-harness): the
// running microVMs outlive sandgate. The harness's outer guest kills
// sandgate (SIGKILL, as a crash) or stops it (SIGTERM, as an upgrade) and
// starts it again on the same data directory (SANDGATE_HARNESS_CTL: the
// harness's control port); the next sandgate takes every VMM back
// (sandgate-vmm --outlive, docs/vmm.md "Restarts"), and each sandbox
// answers through the official E2B JS SDK with its files, its running
// background process and that process's memory. A sandbox paused to disk
// stays paused and resumes with its memory after the restarts.
//
// Runs only in harness mode (it needs the harness to restart sandgate);
// CTest kvm_harness_durable runs it after kvm_durable.test.mjs, in the same boot.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { Sandbox } from 'e2b';
import { restartSandgate, startMemProc, sumNow } from './kvm_common.mjs';

const remote = process.env.SANDGATE_E2E_URL;
const ctl = process.env.SANDGATE_HARNESS_CTL;
const N = 3;  // microVMs of 512 MiB in the harness's 4 GiB outer guest

if (!remote || !ctl) {
  test('kvm restart (harness mode only)', { skip: 'needs tests/kvm-harness/harness.sh (SANDGATE_HARNESS_CTL)' }, () => {});
} else {
  const opts = { apiUrl: remote, sandboxUrl: remote, apiKey: process.env.SANDGATE_E2E_KEY, requestTimeoutMs: 120_000 };
  const boxes = [];  // { id, pid, sum }
  let pausedId, pausedPid, pausedSum;

  const restart = (kind) => restartSandgate(remote, ctl, kind);

  async function checkAll(label) {
    for (const b of boxes) {
      const s = await Sandbox.connect(b.id, opts);
      assert.equal((await s.getInfo()).state, 'running', `${label}: ${b.id}`);
      assert.equal(await s.files.read('/home/user/kept.txt'), `kept ${b.id}\n`, `${label}: ${b.id} file`);
      assert.equal(await sumNow(s, b.pid), b.sum, `${label}: ${b.id} process memory`);
    }
  }

  test(`${N} microVMs with files and a process in memory survive SIGKILL and SIGTERM of sandgate; a paused one stays paused`, { timeout: 1_200_000 }, async () => {
    for (let i = 0; i < N; i++) {
      const s = await Sandbox.create('base', { ...opts, timeoutMs: 1_200_000 });
      await s.files.write('/home/user/kept.txt', `kept ${s.sandboxId}\n`);
      const { pid, sum } = await startMemProc(s);
      boxes.push({ id: s.sandboxId, pid, sum });
    }
    const p = await Sandbox.create('base', { ...opts, timeoutMs: 1_200_000 });
    ({ pid: pausedPid, sum: pausedSum } = await startMemProc(p));
    assert.equal(await p.pause(), true);
    pausedId = p.sandboxId;
    // Its RAM is kept as what differs from the template's snapshot, packed
    // (docs/vmm.md, "Pause memory"): far less than the guest's memory.
    const evs = await (await fetch(`${remote}/sandboxes/${pausedId}/events`, { headers: { 'X-API-KEY': opts.apiKey } })).json();
    const paused = evs.filter((e) => e.kind === 'paused').map((e) => String(e.detail?.message));
    const m = paused.at(-1)?.match(/memory ([0-9.]+) MiB packed into ([0-9.]+) MiB/);
    assert.ok(m, `the pause packed its memory: ${JSON.stringify(paused)}`);
    assert.ok(Number(m[2]) < Number(m[1]) / 4, `packed ${m[2]} MiB of ${m[1]} MiB`);
    console.log(`# pause: ${paused.at(-1)}`);

    await restart('kill');
    await checkAll('after SIGKILL');
    assert.equal((await Sandbox.getInfo(pausedId, opts)).state, 'paused');

    await restart('term');
    await checkAll('after SIGTERM');
    assert.equal((await Sandbox.getInfo(pausedId, opts)).state, 'paused');

    const back = await Sandbox.connect(pausedId, opts);
    assert.equal((await back.getInfo()).state, 'running');
    assert.equal(await sumNow(back, pausedPid), pausedSum, 'the paused one resumes with its process memory');
    await back.kill();
    for (const b of boxes) await Sandbox.kill(b.id, opts);
  });
}
