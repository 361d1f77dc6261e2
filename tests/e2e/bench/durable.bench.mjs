// Benchmark (issue 21), process backend, through the official E2B JS SDK:
//   restart: N sandboxes, each with a background process; sandgate killed
//     (SIGKILL) or stopped (SIGTERM) and started again on the same data
//     directory; the time from the new start (spawn) to every sandbox
//     answering a command again (envd through the re-attached channel).
//   pause to disk: a filesystem-only pause (keepMemory false) of a sandbox
//     that wrote W MiB to its disk: the pause's time and the bytes it
//     stores; resume from disk (connect, then a first command) p50/p99.
//     The process backend keeps no memory in a pause to disk (E2B's full
//     pause stores memory: about 4 s per GiB by its own account).
//   snapshot of a sandbox that wrote 64 MiB, a create from it, and a fork
//     of 8 until each fork answered a command.
// Usage (scripts/bench.sh): SANDGATE_BIN=... SANDGATE_TESTS_TEMPLATES_DIR=... node durable.bench.mjs OUT.json [N] [RUNS]
import { writeFileSync } from 'node:fs';
import { execFileSync } from 'node:child_process';
import { cpus, release, totalmem } from 'node:os';
import { join } from 'node:path';
import { Sandbox } from 'e2b';
import { startSandgate } from '../server.mjs';

const out = process.argv[2] ?? 'durable.json';
const n = Number(process.argv[3] ?? 50);
const runs = Number(process.argv[4] ?? 20);
const pct = (v, p) => { const s = [...v].sort((a, b) => a - b); return s[Math.min(s.length - 1, Math.floor(s.length * p))]; };
const round = (x) => Math.round(x * 10) / 10;
const p50p99 = (v) => ({ p50: round(pct(v, 0.5)), p99: round(pct(v, 0.99)) });
const p50max = (v) => ({ p50: round(pct(v, 0.5)), max: round(Math.max(...v)) });
const diskBytes = (p) => Number(execFileSync('du', ['-s', '--block-size=1', p]).toString().split('\t')[0]);

const server = await startSandgate(['--rate', '0', '--create-rate', '0', '--warm-pool', '0'], { keep: true });
const result = {
  machine: `${cpus().length} x ${cpus()[0].model}, ${Math.round(totalmem() / 2 ** 30)} GiB, Linux ${release()}`,
  backend: 'process',
  build: process.env.SANDGATE_BIN,
  date: new Date().toISOString(),
};
try {
  execFileSync(process.env.SANDGATE_BIN, ['tenant', 'set-quota', 'local', '--max-sandboxes', String(n + 20),
    '--max-memory-mb', String((n + 20) * 1024), '--data-dir', join(server.dir, 'data')]);
  let opts = { ...server.opts, timeoutMs: 1_800_000 };
  const ids = [];
  for (let i = 0; i < n; i++) {
    const s = await Sandbox.create('base', opts);
    await s.commands.run('sleep 100000', { background: true });
    ids.push(s.sandboxId);
  }
  const allServing = async () => {
    await Promise.all(ids.map(async (id) => {
      const s = await Sandbox.connect(id, server.opts);
      const r = await s.commands.run('echo ok');
      if (r.stdout !== 'ok\n') throw new Error(`sandbox ${id}: ${r.stdout}`);
    }));
  };
  result.restart = { sandboxes: n };
  for (const sig of ['SIGKILL', 'SIGTERM']) {
    const t0 = performance.now();
    await server.signal(sig);
    const t1 = performance.now();
    await server.restart();
    const t2 = performance.now();
    await allServing();
    const t3 = performance.now();
    result.restart[sig] = { stop_ms: round(t1 - t0), start_to_banner_ms: round(t2 - t1), start_to_all_serving_ms: round(t3 - t1) };
    console.log(sig, result.restart[sig]);
  }
  opts = { ...server.opts, timeoutMs: 1_800_000 };
  for (const id of ids) await Sandbox.kill(id, opts);

  result.pause_to_disk = [];
  for (const mib of [0, 64, 512]) {
    const pause = [], resume = [];
    let stored = 0;
    for (let i = 0; i < (mib === 512 ? 5 : runs); i++) {
      const s = await Sandbox.create('base', opts);
      if (mib) await s.commands.run(`head -c ${mib}M /dev/urandom > /home/user/blob`);
      const t0 = performance.now();
      await s.pause({ keepMemory: false });
      const t1 = performance.now();
      const layer = execFileSync('sh', ['-c', `ls -td ${join(server.dir, 'data', 'layers')}/pause-* | head -1`]).toString().trim();
      stored = diskBytes(layer);
      const t2 = performance.now();
      const back = await Sandbox.connect(s.sandboxId, opts);
      await back.commands.run('true');
      const t3 = performance.now();
      pause.push(t1 - t0);
      resume.push(t3 - t2);
      await back.kill();
    }
    const row = { written_mib: mib, pause_ms: p50p99(pause), stored_bytes: stored,
      resume_from_disk_ms: p50p99(resume), n: pause.length };
    console.log(row);
    result.pause_to_disk.push(row);
  }

  const parent = await Sandbox.create('base', opts);
  await parent.commands.run('head -c 64M /dev/urandom > /home/user/blob');
  const snap = [], fromSnap = [];
  for (let i = 0; i < 5; i++) {
    const t0 = performance.now();
    const info = await parent.createSnapshot();
    const t1 = performance.now();
    const c = await Sandbox.create(info.snapshotId, opts);
    await c.commands.run('true');
    const t2 = performance.now();
    snap.push(t1 - t0);
    fromSnap.push(t2 - t1);
    await c.kill();
    await Sandbox.deleteSnapshot(info.snapshotId, opts);
  }
  result.snapshot_64mib = { snapshot_ms: p50max(snap), create_from_it_to_first_command_ms: p50max(fromSnap) };
  console.log(result.snapshot_64mib);
  const fork8 = [];
  for (let i = 0; i < 5; i++) {
    const t0 = performance.now();
    const forks = await parent.fork({ count: 8, timeoutMs: 120_000 });
    await Promise.all(forks.map((f) => {
      if (f instanceof Error) throw f;
      return f.commands.run('true');
    }));
    fork8.push(performance.now() - t0);
    for (const f of forks) await f.kill();
  }
  result.fork_8_of_64mib_to_all_answering_ms = p50max(fork8);
  console.log(result.fork_8_of_64mib_to_all_answering_ms);
  await parent.kill();
} finally {
  await server.signal('SIGTERM').catch(() => {});
  await server.restart(false).catch(() => {});
  await server.stop();
}
writeFileSync(out, JSON.stringify(result, null, 2) + '\n');
console.log(JSON.stringify(result, null, 2));
