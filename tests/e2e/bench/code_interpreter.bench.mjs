// Benchmark: Sandbox.create() of the code interpreter (@e2b/code-interpreter
// 2.8.0, its default template code-interpreter-v1) to the first
// runCode('1+1') result, p50 and p99 over N (default 50), process backend:
//   cold: --warm-pool 0, each create starts the interpreter server and its
//         Python kernel (create waits for the ready command);
//   warm: the default pool; before each create the bench waits until the
//         pool holds a started sandbox again (what a create finds when
//         creates come slower than the pool refills), then measures.
// Usage (scripts/bench.sh): SANDGATE_BIN=... SANDGATE_TESTS_TEMPLATES_DIR=... node code_interpreter.bench.mjs OUT.json [N]
import { writeFileSync } from 'node:fs';
import { cpus, release } from 'node:os';
import { Sandbox } from '@e2b/code-interpreter';
import { startSandgate } from '../server.mjs';

const out = process.argv[2] ?? 'code-interpreter.json';
const n = Number(process.argv[3] ?? 50);
const pct = (v, p) => { const s = [...v].sort((a, b) => a - b); return s[Math.min(s.length - 1, Math.floor(s.length * p))]; };

async function metric(url, name) {
  const text = await (await fetch(`${url}/metrics`)).text();
  const m = new RegExp(`^${name} (\\d+)`, 'm').exec(text);
  return m ? Number(m[1]) : 0;
}

async function run(extra, waitForPool) {
  const server = await startSandgate(['--rate', '0', '--create-rate', '0', ...extra]);
  try {
    const opts = { ...server.opts, timeoutMs: 120_000 };
    // One create first: it makes the template hot (and warms page caches).
    await (await Sandbox.create(opts)).kill();
    const firstResult = [], createOnly = [];
    for (let i = 0; i < n; i++) {
      if (waitForPool) {
        for (let k = 0; (await metric(server.url, 'sandgate_warm_pool_sandboxes')) < 1; k++) {
          if (k > 3000) throw new Error('the warm pool never refilled');
          await new Promise((r) => setTimeout(r, 20));
        }
      }
      const t0 = performance.now();
      const sbx = await Sandbox.create(opts);
      const t1 = performance.now();
      const e = await sbx.runCode('1+1');
      const t2 = performance.now();
      if (e.text !== '2') throw new Error('runCode: ' + JSON.stringify(e.toJSON()));
      createOnly.push(t1 - t0);
      firstResult.push(t2 - t0);
      await sbx.kill();
    }
    const taken = await metric(server.url, 'sandgate_warm_pool_taken_total');
    return {
      create_to_first_result_ms: { p50: pct(firstResult, 0.5), p99: pct(firstResult, 0.99) },
      create_ms: { p50: pct(createOnly, 0.5), p99: pct(createOnly, 0.99) },
      creates_served_by_the_pool: taken,
    };
  } finally {
    await server.stop();
  }
}

const cold = await run(['--warm-pool', '0'], false);
const warm = await run([], true);
const report = {
  benchmark: `Sandbox.create() to the first runCode('1+1') result, @e2b/code-interpreter 2.8.0, process backend, n=${n}`,
  cold_no_pool: cold,
  warm_pool: warm,
  kvm: 'docs/bench/code-interpreter-kvm-emulated.json (scripts/bench-kvm.sh, inside the KVM harness)',
  machine: { cpu: cpus()[0]?.model, cores: cpus().length, kernel: release() },
  date: new Date().toISOString(),
};
writeFileSync(out, JSON.stringify(report, null, 2) + '\n');
console.log(`create to first result: cold p50 ${cold.create_to_first_result_ms.p50.toFixed(0)} ms, p99 ` +
  `${cold.create_to_first_result_ms.p99.toFixed(0)} ms; warm p50 ${warm.create_to_first_result_ms.p50.toFixed(1)} ms, ` +
  `p99 ${warm.create_to_first_result_ms.p99.toFixed(1)} ms (${warm.creates_served_by_the_pool} of ${n + 1} from the pool)`);
