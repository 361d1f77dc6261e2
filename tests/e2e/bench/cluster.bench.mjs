// Benchmark: cluster mode (docs/cluster.md) against a single node, through
// the official SDK. For each: creates per second (N creates, C at a time,
// through one entry node) and commands.run('true') p50/p99 (sequential
// runs on one sandbox). In the cluster, the runs go through n1 to a
// sandbox on n1 (local) and on n2 (one forwarding hop: the tunnel), and
// the hop's added latency is the difference. Every node and etcd member
// runs on this one machine, so the cluster's creates share its cores.
// Usage (scripts/bench.sh): SANDGATE_BIN=... SANDGATE_TESTS_TEMPLATES_DIR=... node cluster.bench.mjs OUT.json [N]
import { writeFileSync } from 'node:fs';
import { cpus, release } from 'node:os';
import { Sandbox } from 'e2b';
import { startSandgate } from '../server.mjs';
import { startCluster } from '../fixtures/cluster.mjs';

const out = process.argv[2] ?? 'cluster.json';
const N = Number(process.argv[3] ?? 24);
const C = 4;
const RUNS = 300;
const pct = (v, p) => { const s = [...v].sort((a, b) => a - b); return s[Math.min(s.length - 1, Math.ceil(p / 100 * s.length) - 1)]; };
const flags = ['--rate', '0', '--create-rate', '0'];

async function creates(opts) {
  const made = [];
  let next = 0;
  const t0 = performance.now();
  await Promise.all(Array.from({ length: C }, async () => {
    while (next < N) {
      next++;
      made.push(await Sandbox.create('base', opts));
    }
  }));
  const s = (performance.now() - t0) / 1000;
  await Promise.all(made.map((b) => b.kill()));
  return { creates: N, concurrency: C, seconds: s, per_second: N / s };
}

async function runs(sbx) {
  for (let i = 0; i < 20; i++) await sbx.commands.run('true');
  const lat = [];
  for (let i = 0; i < RUNS; i++) {
    const t0 = performance.now();
    await sbx.commands.run('true');
    lat.push(performance.now() - t0);
  }
  return { runs: RUNS, p50_ms: pct(lat, 50), p99_ms: pct(lat, 99) };
}

const report = {
  benchmark: 'cluster mode: 3 nodes + 3 etcd members on one machine, each in a network namespace on one bridge, against one node; E2B JS SDK, process backend',
  machine: { cpu: cpus()[0]?.model, cores: cpus().length, kernel: release() },
  date: new Date().toISOString(),
};

const single = await startSandgate([...flags, '--warm-pool', '0', '--code-interpreter', 'off']);
try {
  const opts = { ...single.opts, timeoutMs: 600_000 };
  report.single = { creates: await creates(opts) };
  const one = await Sandbox.create('base', opts);
  report.single.commands = await runs(one);
  await one.kill();
} finally {
  await single.stop();
}

const cluster = await startCluster({ extra: flags });
try {
  const opts = { ...cluster.nodes.n1.opts, timeoutMs: 600_000 };
  report.cluster = { creates: await creates(opts) };
  // One sandbox on n1 and one on n2 (the others drained for each).
  const on = async (id) => {
    const others = ['n1', 'n2', 'n3'].filter((x) => x !== id);
    for (const x of others) await cluster.drain(x, true);
    for (;;) {
      const s = await Sandbox.create('base', opts);
      if ((await cluster.nodeOf(s.sandboxId)) === id) {
        for (const x of others) await cluster.drain(x, false);
        return s;
      }
      await s.kill();
    }
  };
  const local = await on('n1');
  const remote = await on('n2');
  report.cluster.commands_local = await runs(local);
  report.cluster.commands_forwarded = await runs(remote);
  report.cluster.hop_added_p50_ms = report.cluster.commands_forwarded.p50_ms - report.cluster.commands_local.p50_ms;
  report.cluster.hop_added_p99_ms = report.cluster.commands_forwarded.p99_ms - report.cluster.commands_local.p99_ms;
  await local.kill();
  await remote.kill();
} finally {
  await cluster.stop();
}

writeFileSync(out, JSON.stringify(report, null, 2) + '\n');
const f = (x) => x.toFixed(2);
console.log(`single node: ${f(report.single.creates.per_second)} creates/s, commands.run p50 ${f(report.single.commands.p50_ms)} ms p99 ${f(report.single.commands.p99_ms)} ms`);
console.log(`cluster via n1: ${f(report.cluster.creates.per_second)} creates/s; commands.run local p50 ${f(report.cluster.commands_local.p50_ms)} ms p99 ${f(report.cluster.commands_local.p99_ms)} ms, ` +
  `forwarded p50 ${f(report.cluster.commands_forwarded.p50_ms)} ms p99 ${f(report.cluster.commands_forwarded.p99_ms)} ms; hop +${f(report.cluster.hop_added_p50_ms)} ms p50`);
console.log(`report: ${out}`);
