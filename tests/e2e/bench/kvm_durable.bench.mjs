// Benchmark (issue 21), kvm backend, through the official E2B JS SDK: a
// pause to disk of a microVM whose processes hold T MiB (random bytes,
// which no codec shrinks, and repetitive text): the pause's time, the
// bytes its packed memory stores (the "paused" event's account,
// docs/vmm.md "Pause memory"), and the resume by connect to a first
// command p50/p99, the held memory checked after each; then a fork of 8
// until each fork answered a command. Run inside the KVM test harness by
// scripts/bench-kvm.sh (QEMU TCG: emulated timings, for comparing runs and
// parts, not for real KVM speed; the stored bytes are real); prints
// "BENCH-RESULT {json}".
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { Sandbox } from 'e2b';

const url = process.env.SANDGATE_E2E_URL;
const RUNS = Number(process.env.SANDGATE_BENCH_RUNS ?? 5);
const pct = (v, p) => { const s = [...v].sort((a, b) => a - b); return s[Math.min(s.length - 1, Math.floor(s.length * p))]; };
const round = (x) => Math.round(x * 10) / 10;

// Holds T MiB of kind ("random" or "text") in memory; writes its
// SHA-256 to /tmp/held.sum at start and on each SIGUSR1.
const holder = (mib, kind) => 'import hashlib, os, signal\n' +
  (kind === 'random' ? `b = os.urandom(${mib} << 20)\n`
    : `line = b"sandgate pause bench: the quick brown fox jumps over the lazy dog 0123456789\\n"\n` +
      `b = bytearray((line * ((${mib} << 20) // len(line) + 1))[:${mib} << 20])\n`) +
  'def again(*_):\n' +
  '    open("/tmp/held.tmp", "w").write(hashlib.sha256(b).hexdigest())\n' +
  '    os.rename("/tmp/held.tmp", "/tmp/held.sum")\n' +
  'again()\n' +
  'signal.signal(signal.SIGUSR1, again)\n' +
  'while True:\n' +
  '    signal.pause()\n';

async function waitSum(s) {
  const deadline = Date.now() + 300_000;
  while (!(await s.files.exists('/tmp/held.sum'))) {
    if (Date.now() > deadline) assert.fail('the holder never wrote its sum');
    await s.commands.run('sleep 0.2');
  }
  return s.files.read('/tmp/held.sum');
}

test('durable microVMs: pause to disk, resume, fork', { skip: url ? false : 'runs inside the KVM harness (scripts/bench-kvm.sh)', timeout: 3_000_000 }, async () => {
  const opts = { apiUrl: url, sandboxUrl: url, apiKey: process.env.SANDGATE_E2E_KEY, requestTimeoutMs: 600_000 };
  const lastPause = async (id) => {
    const evs = await (await fetch(`${url}/sandboxes/${id}/events`, { headers: { 'X-API-KEY': opts.apiKey } })).json();
    const d = evs.filter((e) => e.kind === 'paused').map((e) => String(e.detail?.message)).at(-1);
    const m = d?.match(/memory ([0-9.]+) MiB packed into ([0-9.]+) MiB \((\d+) pages differ/);
    assert.ok(m, `the pause's account: ${d}`);
    return { ramMiB: Number(m[1]), storedMiB: Number(m[2]), pagesDiffer: Number(m[3]) };
  };
  const report = {
    benchmark: 'pause to disk, resume and fork of microVMs through the E2B JS SDK, inside the KVM test harness (QEMU TCG: times emulated, bytes real)',
    date: new Date().toISOString(),
    runs: RUNS,
    pause: [],
  };
  for (const [mib, kind] of [[0, 'idle'], [64, 'random'], [64, 'text']]) {
    const sbx = await Sandbox.create('base', { ...opts, timeoutMs: 1_800_000 });
    let sum = null, pid = 0;
    if (mib) {
      await sbx.files.write('/home/user/holder.py', holder(mib, kind));
      const h = await sbx.commands.run('python3 /home/user/holder.py', { background: true, timeoutMs: 0 });
      await h.disconnect();
      pid = h.pid;
      sum = await waitSum(sbx);
    }
    const pauses = [], resumes = [], stored = [];
    let account;
    for (let i = 0; i < RUNS; i++) {
      const t0 = performance.now();
      assert.equal(await sbx.pause(), true);
      pauses.push(performance.now() - t0);
      account = await lastPause(sbx.sandboxId);
      stored.push(account.storedMiB);
      const t1 = performance.now();
      // (connect gives the sandbox a fresh timeout: keep it long.)
      const back = await Sandbox.connect(sbx.sandboxId, { ...opts, timeoutMs: 1_800_000 });
      assert.equal((await back.commands.run('echo back')).stdout, 'back\n');
      resumes.push(performance.now() - t1);
      if (mib) {
        await back.commands.run(`rm -f /tmp/held.sum; kill -USR1 ${pid}`);
        assert.equal(await waitSum(back), sum, 'the held memory came back');
      }
    }
    const row = {
      held_mib: mib, kind, ram_mib: account.ramMiB,
      stored_mib_p50: round(pct(stored, 0.5)), pages_differ_last: account.pagesDiffer,
      pause_ms: { p50: Math.round(pct(pauses, 0.5)), p99: Math.round(pct(pauses, 0.99)) },
      resume_to_command_ms: { p50: Math.round(pct(resumes, 0.5)), p99: Math.round(pct(resumes, 0.99)) },
    };
    console.log(`# ${JSON.stringify(row)}`);
    report.pause.push(row);
    if (mib) await sbx.kill();
    else report.forkParent = sbx;
  }
  // A fork of 8 of the idle sandbox, until each answered a command.
  const parent = report.forkParent;
  delete report.forkParent;
  const t0 = performance.now();
  const forks = await parent.fork({ count: 8, timeoutMs: 600_000, requestTimeoutMs: 1_800_000 });
  const made = performance.now() - t0;
  try {
    await Promise.all(forks.map(async (f) => {
      assert.ok(f instanceof Sandbox, String(f));
      assert.equal((await f.commands.run('echo fork')).stdout, 'fork\n');
    }));
    report.fork8 = { answered_ms: Math.round(performance.now() - t0), created_ms: Math.round(made) };
  } finally {
    for (const f of forks) if (f instanceof Sandbox) await f.kill().catch(() => {});
    await parent.kill().catch(() => {});
  }
  console.log('BENCH-RESULT ' + JSON.stringify(report));
});
