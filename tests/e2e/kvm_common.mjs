// What the kvm e2e files share: a background counter (a running process),
// a process that holds 4 MiB of random bytes only in its memory (the
// proof that a microVM's memory came through a snapshot, fork or restart)
// and a restart of sandgate in the harness.
import assert from 'node:assert/strict';
import { writeFileSync } from 'node:fs';
import net from 'node:net';

// Waits until path exists in sandbox s (at most 120 s); returns its text.
export async function waitFile(s, path) {
  const deadline = Date.now() + 120_000;
  while (!(await s.files.exists(path))) {
    if (Date.now() > deadline) assert.fail(`${path} never appeared in ${s.sandboxId}`);
    await s.commands.run('sleep 0.2');
  }
  return s.files.read(path);
}

// Starts a loop writing an increasing number to /tmp/counter every 0.1 s,
// in the background; returns its pid once the file exists.
export async function startCounter(s) {
  const h = await s.commands.run('i=0; while :; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.1; done',
    { background: true, timeoutMs: 0 });
  await h.disconnect();
  await waitFile(s, '/tmp/counter');
  return h.pid;
}

// Reads the background counter twice and checks it moved: the process
// runs (is not merely present, e.g. still frozen).
export async function counterAdvances(s) {
  const first = Number((await s.files.read('/tmp/counter')).trim());
  const deadline = Date.now() + 60_000;
  for (;;) {
    const now = Number((await s.files.read('/tmp/counter')).trim());
    if (now > first) return;
    if (Date.now() > deadline) assert.fail(`/tmp/counter stuck at ${now} for 60 s`);
    await s.commands.run('sleep 0.2');
  }
}

// 4 MiB of random bytes kept only in the process's memory; their SHA-256
// written (atomically) to /tmp/sum at start and again on each SIGUSR1.
const memProc = 'import hashlib, os, signal\n' +
  'b = os.urandom(4 << 20)\n' +
  'def again(*_):\n' +
  '    open("/tmp/sum.tmp", "w").write(hashlib.sha256(b).hexdigest())\n' +
  '    os.rename("/tmp/sum.tmp", "/tmp/sum")\n' +
  'again()\n' +
  'signal.signal(signal.SIGUSR1, again)\n' +
  'while True:\n' +
  '    signal.pause()\n';

// Starts the memory process in s; returns its pid and first checksum.
export async function startMemProc(s) {
  await s.files.write('/home/user/mem.py', memProc);
  const h = await s.commands.run('python3 /home/user/mem.py', { background: true, timeoutMs: 0 });
  await h.disconnect();
  return { pid: h.pid, sum: await waitFile(s, '/tmp/sum') };
}

// The memory process's checksum now, asked with SIGUSR1.
export async function sumNow(s, pid) {
  await s.commands.run(`rm -f /tmp/sum; kill -USR1 ${pid}`, { timeoutMs: 120_000 });
  return waitFile(s, '/tmp/sum');
}

// Asks the KVM harness (its control file, SANDGATE_HARNESS_CTL) to end
// sandgate (kind "kill": SIGKILL, "term": SIGTERM) and start it again;
// returns once the old one is gone (an idle connection to it closes) and
// the new one answers.
export async function restartSandgate(remote, ctl, kind) {
  const u = new URL(remote);
  const sock = net.connect(Number(u.port), u.hostname);
  sock.on('error', () => {});
  await new Promise((res, rej) => { sock.once('connect', res); sock.once('error', rej); });
  const closed = new Promise((res) => sock.once('close', res));
  writeFileSync(ctl, `restart-${kind}\n`);
  await Promise.race([closed, new Promise((_, rej) => setTimeout(() => rej(new Error(`sandgate did not go within 120 s of restart-${kind}`)), 120_000))]);
  const deadline = Date.now() + 300_000;
  for (;;) {
    try {
      const r = await fetch(`${remote}/health`, { signal: AbortSignal.timeout(5000) });
      if (r.ok) return;
    } catch {}
    if (Date.now() > deadline) assert.fail(`sandgate did not come back within 300 s after restart-${kind}`);
    await new Promise((r) => setTimeout(r, 250));  // polling a server coming up, not synchronising
  }
}
