// Benchmark: custom templates on the kvm backend, through the official JS
// SDK: a cold build of a 2-step template with a start command (its steps
// in process sandboxes, then the microVM image and boot snapshot), the same
// build again (steps cached; image and snapshot kept), create latency
// (median of 5) from base and from the built template, whose server (its
// start command) answers at once: it runs in the template's snapshot. Run inside the KVM test harness by
// scripts/bench-kvm.sh (QEMU TCG: emulated timings, for comparing runs and
// parts, not for real KVM speed); prints "BENCH-RESULT {json}".
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { Template, Sandbox, waitForPort } from 'e2b';

const url = process.env.SANDGATE_E2E_URL;
const median = (v) => { const s = [...v].sort((a, b) => a - b); return s[Math.floor(s.length / 2)]; };

test('custom templates on microVMs', { skip: url ? false : 'runs inside the KVM harness (scripts/bench-kvm.sh)', timeout: 1_500_000 }, async () => {
  const opts = { apiUrl: url, sandboxUrl: url, apiKey: process.env.SANDGATE_E2E_KEY, requestTimeoutMs: 120_000 };
  const tpl = () => Template().fromTemplate('base')
    .runCmd('mkdir -p /srv/www && seq 1 20000 > /srv/www/numbers.txt', { user: 'root' })
    .runCmd('python3 -c "print(sum(range(10**6)))" > /srv/www/sum.txt', { user: 'root' })
    .setStartCmd('python3 -m http.server 8000 --bind 127.0.0.1 --directory /srv/www', waitForPort(8000));
  const build = async () => {
    let preparing = 0;
    const t0 = performance.now();
    await Template.build(tpl(), 'bench-kvm-tpl', { ...opts, cpuCount: 2, memoryMB: 512,
      onBuildLogs: (l) => { if (!preparing && String(l.message).includes('Preparing the template')) preparing = performance.now(); } });
    const end = performance.now();
    return { total: end - t0, prepare: preparing ? end - preparing : null };
  };
  const cold = await build();
  const cached = await build();
  const creates = async (name, check) => {
    const v = [];
    for (let i = 0; i < 5; i++) {
      const s = performance.now();
      const sbx = await Sandbox.create(name, { ...opts, timeoutMs: 300_000 });
      v.push(performance.now() - s);
      if (check) await check(sbx);
      await sbx.kill();
    }
    return median(v);
  };
  const fromBase = await creates('base');
  const fromBuilt = await creates('bench-kvm-tpl', async (sbx) => {
    const r = await sbx.commands.run('curl -s http://127.0.0.1:8000/sum.txt', { timeoutMs: 120_000 });
    assert.equal(r.stdout, '499999500000\n');
  });
  const report = {
    benchmark: 'custom templates on the kvm backend through the E2B JS SDK, inside the KVM test harness (QEMU TCG, emulated)',
    build_cold_ms: Math.round(cold.total),
    build_cold_prepare_ms: cold.prepare && Math.round(cold.prepare),
    build_cached_ms: Math.round(cached.total),
    build_cached_prepare_ms: cached.prepare && Math.round(cached.prepare),
    create_base_median_ms: Math.round(fromBase),
    create_built_with_start_command_median_ms: Math.round(fromBuilt),
    date: new Date().toISOString(),
  };
  console.log('BENCH-RESULT ' + JSON.stringify(report));
});
