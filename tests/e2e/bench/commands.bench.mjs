// Benchmark: commands.run('true') round trip through the official SDK
// (p50, p99 over 300 sequential runs on one sandbox), and sustained
// commands per second with 8 sandboxes driven concurrently for 10 s.
// Usage (scripts/bench.sh): SANDGATE_BIN=... SANDGATE_TESTS_TEMPLATES_DIR=... node commands.bench.mjs OUT.json
import { writeFileSync } from 'node:fs';
import { cpus, release } from 'node:os';
import { Sandbox } from 'e2b';
import { startSandgate } from '../server.mjs';

const out = process.argv[2] ?? 'commands.json';
const pct = (v, p) => { const s = [...v].sort((a, b) => a - b); return s[Math.min(s.length - 1, Math.ceil(p / 100 * s.length) - 1)]; };
const server = await startSandgate(['--rate', '0', '--create-rate', '0']);
try {
  const one = await Sandbox.create('base', server.opts);
  for (let i = 0; i < 20; i++) await one.commands.run('true');  // warm up
  const lat = [];
  for (let i = 0; i < 300; i++) {
    const t0 = performance.now();
    await one.commands.run('true');
    lat.push(performance.now() - t0);
    if (i % 30 === 0) process.stderr.write(`\rsequential ${i}/300`);
  }
  process.stderr.write('\n');
  const boxes = await Promise.all(Array.from({ length: 8 }, () => Sandbox.create('base', server.opts)));
  let done = 0;
  const until = performance.now() + 10000;
  await Promise.all(boxes.map(async (b) => {
    while (performance.now() < until) { await b.commands.run('true'); done++; }
  }));
  const report = {
    benchmark: "commands.run('true') through the E2B JS SDK 2.51.0, process backend, HTTP/1.1 on loopback",
    sequential_runs: lat.length,
    p50_ms: pct(lat, 50), p90_ms: pct(lat, 90), p99_ms: pct(lat, 99),
    concurrent_sandboxes: boxes.length, concurrent_seconds: 10, commands_per_second: done / 10,
    machine: { cpu: cpus()[0]?.model, cores: cpus().length, kernel: release() },
    date: new Date().toISOString(),
  };
  writeFileSync(out, JSON.stringify(report, null, 2) + '\n');
  console.log(`commands.run('true'): p50 ${report.p50_ms.toFixed(2)} ms, p99 ${report.p99_ms.toFixed(2)} ms; ` +
    `${report.commands_per_second.toFixed(0)} commands/s across 8 sandboxes; report: ${out}`);
  await Promise.all([one, ...boxes].map((b) => b.kill()));
} finally {
  await server.stop();
}
