// Benchmark: the code interpreter on the kvm backend, through the official
// @e2b/code-interpreter SDK: Sandbox.create() to the first runCode('1+1')
// result. Cold: the first create after the server starts, which boots the
// template microVM, starts the interpreter and its Python kernel, snapshots
// it running, then clones it (once). Warm: every later create, a clone of
// that snapshot with the kernel already running (p50 and p99 over N,
// default 50). Run inside the KVM test harness by scripts/bench-kvm.sh
// (SANDGATE_BENCH_ONLY=code-interpreter; QEMU TCG: emulated timings, for
// comparing runs and parts, not for real KVM speed); prints
// "BENCH-RESULT {json}".
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { Sandbox } from '@e2b/code-interpreter';

const url = process.env.SANDGATE_E2E_URL;
const n = Number(process.env.SANDGATE_BENCH_N ?? 50);
const pct = (v, p) => { const s = [...v].sort((a, b) => a - b); return s[Math.min(s.length - 1, Math.floor(s.length * p))]; };

test('the code interpreter on microVMs', { skip: url ? false : 'runs inside the KVM harness (scripts/bench-kvm.sh)', timeout: 3_000_000 }, async () => {
  const opts = { apiUrl: url, sandboxUrl: url, apiKey: process.env.SANDGATE_E2E_KEY, requestTimeoutMs: 900_000,
    timeoutMs: 900_000 };
  const once = async () => {
    const t0 = performance.now();
    const sbx = await Sandbox.create(opts);
    const t1 = performance.now();
    const e = await sbx.runCode('1+1', { timeoutMs: 300_000 });
    const t2 = performance.now();
    assert.equal(e.text, '2', JSON.stringify(e.toJSON()));
    await sbx.kill();
    return { create: t1 - t0, first: t2 - t0 };
  };
  const cold = await once();
  const warm = [];
  for (let i = 0; i < n; i++) warm.push(await once());
  const first = warm.map((w) => w.first), create = warm.map((w) => w.create);
  const report = {
    benchmark: `Sandbox.create() to the first runCode('1+1') result on the kvm backend through @e2b/code-interpreter 2.8.0, inside the KVM test harness (QEMU TCG, emulated), n=${n}`,
    cold_first_create_ms: { create: Math.round(cold.create), to_first_result: Math.round(cold.first) },
    warm_clone_ms: {
      to_first_result: { p50: Math.round(pct(first, 0.5)), p99: Math.round(pct(first, 0.99)) },
      create: { p50: Math.round(pct(create, 0.5)), p99: Math.round(pct(create, 0.99)) },
    },
    date: new Date().toISOString(),
  };
  console.log('BENCH-RESULT ' + JSON.stringify(report));
});
