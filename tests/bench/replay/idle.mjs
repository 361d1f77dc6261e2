// Idle offload, measured (docs/replay.md, "Idle sandboxes"): N code
// interpreter sandboxes (a real Jupyter kernel each) load a frame of
// events, then nobody uses them. Run twice, each time with a fresh
// sandgate: with --idle-offload-ms 0 (they stay resident) and with
// --idle-offload-ms 5000. For each: M (sandboxes' memory as sandgate reads
// it, plus the zram device's RAM) once they have been idle 20 s, then the
// first cell in each (a groupby over the frame: it touches every row) and
// the same cell again, timed; the cells' outputs compared across the runs.
//
//   SANDGATE_BIN=build/release/bin/sandgate SANDGATE_TESTS_TEMPLATES_DIR=build/release/tests-rootfs \
//     node tests/bench/replay/idle.mjs [--n 8] [--out docs/bench]
import { writeFileSync, mkdirSync } from 'node:fs';
import { cpus, totalmem, release } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';

const HERE = dirname(fileURLToPath(import.meta.url));
const ROOT = resolve(HERE, '../../..');
const { Sandbox } = await import(pathToFileURL(join(ROOT, 'tests/e2e/node_modules/@e2b/code-interpreter/dist/index.mjs')).href);
const { startSandgate } = await import(pathToFileURL(join(ROOT, 'tests/e2e/server.mjs')).href);

const args = { n: 8, out: null, idleS: 20 };
for (let i = 2; i < process.argv.length; i += 2) {
  const [k, v] = [process.argv[i], process.argv[i + 1]];
  if (k === '--n') args.n = Number(v);
  else if (k === '--out') args.out = v;
  else if (k === '--idle-s') args.idleS = Number(v);
  else throw new Error(`unknown argument ${k} (--n, --out, --idle-s)`);
}
if (!Number.isInteger(args.n) || args.n < 1 || args.n > 64) throw new Error('--n wants 1..64');

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const MiB = (b) => (b / 1048576).toFixed(1);
const pct = (v, p) => {
  const s = [...v].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.max(0, Math.ceil((p / 100) * s.length) - 1))];
};
function metric(text, name) {
  const m = new RegExp(`^${name.replace(/[{}]/g, '\\$&')} (\\S+)$`, 'm').exec(text);
  return m ? Number(m[1]) : null;
}

// A data agent's frame: 1.5 million events as pandas reads them from a CSV
// (ids, users and kinds as strings, values with two decimals).
const LOAD = `
import io, random
import pandas as pd
r = random.Random({seed})
rows = ["%d,u%d,%s,%.2f" % (i, r.randrange(5000), r.choice(["view", "click", "buy", "share"]), r.uniform(0, 100))
        for i in range(1500000)]
df = pd.read_csv(io.StringIO("id,user,kind,value\\n" + "\\n".join(rows)))
del rows
len(df)
`;
const CELL = `df.groupby("kind")["value"].agg(["count", "sum"]).round(2).to_dict()`;

async function run(idleMs) {
  const sg = await startSandgate(['--rate', '0', '--create-rate', '0', '--memory-offload', 'always',
    '--idle-offload-ms', String(idleMs)]);
  const boxes = [];
  const res = { idle_offload_ms: idleMs };
  try {
    const m = async () => await (await fetch(sg.url + '/metrics')).text();
    for (let i = 0; i < args.n; i++) {
      const sbx = await Sandbox.create('code-interpreter-v1', { ...sg.opts, timeoutMs: 3_600_000, requestTimeoutMs: 300_000 });
      boxes.push(sbx);
      const e = await sbx.runCode(LOAD.replace('{seed}', String(i + 1)), { timeoutMs: 300_000 });
      if (e.error) throw new Error(`load: ${e.error.name}: ${e.error.value}`);
    }
    await sleep(args.idleS * 1000);
    const text = await m();
    res.sandboxes_bytes = metric(text, 'sandgate_sandboxes_memory_bytes');
    res.zram_bytes = metric(text, 'sandgate_swap_memory_bytes') ?? 0;
    res.m_bytes = res.sandboxes_bytes + res.zram_bytes;
    res.idle_offloads = metric(text, 'sandgate_swap_idle_offloads_total') ?? 0;
    res.pages_out = metric(text, 'sandgate_swap_out_pages_total') ?? 0;
    res.first_ms = [];
    res.again_ms = [];
    res.outputs = [];
    for (const sbx of boxes) {
      for (const into of [res.first_ms, res.again_ms]) {
        const t0 = performance.now();
        const e = await sbx.runCode(CELL, { timeoutMs: 300_000 });
        into.push(performance.now() - t0);
        if (e.error) throw new Error(`cell: ${e.error.name}: ${e.error.value}`);
        if (into === res.first_ms) res.outputs.push(e.text);
      }
    }
    res.pages_in = metric(await m(), 'sandgate_swap_in_pages_total') ?? 0;
  } finally {
    for (const b of boxes) await b.kill().catch(() => {});
    await sg.stop();
  }
  const s = (v) => ({ p50: Number(pct(v, 50).toFixed(1)), max: Number(Math.max(...v).toFixed(1)) });
  res.first = s(res.first_ms);
  res.again = s(res.again_ms);
  console.log(`idle offload ${idleMs} ms: M ${MiB(res.m_bytes)} MiB after ${args.idleS} s idle (sandboxes ` +
    `${MiB(res.sandboxes_bytes)}, zram ${MiB(res.zram_bytes)}), ${res.idle_offloads} idle offloads; first cell ` +
    `p50 ${res.first.p50} ms max ${res.first.max}, again p50 ${res.again.p50} ms`);
  return res;
}

const off = await run(0);
const on = await run(5000);
const report = {
  benchmark: 'idle offload',
  date: new Date().toISOString(),
  machine: { cpus: cpus().length, cpu_model: cpus()[0]?.model, mem_bytes: totalmem(), kernel: release() },
  config: { n: args.n, idle_s: args.idleS, template: 'code-interpreter-v1' },
  outputs_match: JSON.stringify(off.outputs) === JSON.stringify(on.outputs),
  runs: { off, on },
  m_vs_off: Number((on.m_bytes / off.m_bytes - 1).toFixed(4)),
};
console.log(`M ${MiB(off.m_bytes)} -> ${MiB(on.m_bytes)} MiB (${(report.m_vs_off * 100).toFixed(1)} %); outputs match: ${report.outputs_match}`);
if (args.out) {
  mkdirSync(args.out, { recursive: true });
  writeFileSync(join(args.out, 'idle-offload.json'), JSON.stringify(report, null, 1) + '\n');
}
if (!report.outputs_match || on.idle_offloads < args.n) process.exit(1);
