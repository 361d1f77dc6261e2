// Benchmark: template builds and creates from a built template, through the
// official JS SDK (process backend): a cold and a fully cached build of a
// 4-step template (RUN, COPY, WORKDIR, RUN); create latency (median of 10)
// from base and from the built template; create to the start command's
// server answering (median of 5), which create waits for.
// Usage (scripts/bench.sh): SANDGATE_BIN=... SANDGATE_TESTS_TEMPLATES_DIR=... node templates.bench.mjs OUT.json
import { writeFileSync, mkdtempSync, mkdirSync, rmSync } from 'node:fs';
import { cpus, release, tmpdir } from 'node:os';
import { join } from 'node:path';
import { Template, Sandbox } from 'e2b';
import { startSandgate } from '../server.mjs';

const out = process.argv[2] ?? 'templates.json';
const median = (v) => { const s = [...v].sort((a, b) => a - b); return s[Math.floor(s.length / 2)]; };
const ctx = mkdtempSync(join(tmpdir(), 'sandgate-bench-ctx-'));
mkdirSync(join(ctx, 'app'));
for (let i = 0; i < 20; i++) writeFileSync(join(ctx, 'app', `f${i}.txt`), 'x'.repeat(4096 * (i + 1)));
// No warm pool: each create starts its template's start command (the
// pool's effect is code_interpreter.bench.mjs's).
const server = await startSandgate(['--rate', '0', '--create-rate', '0', '--warm-pool', '0']);
try {
  const opts = server.opts;
  const four = () => Template({ fileContextPath: ctx }).fromTemplate('base')
    .runCmd('mkdir -p /srv/www && seq 1 20000 > /srv/www/numbers.txt', { user: 'root' })
    .copy('app', '/opt/app/')
    .setWorkdir('/opt/app')
    .runCmd('ls > listing.txt');
  let t0 = performance.now();
  await Template.build(four(), 'bench-four', opts);
  const cold = performance.now() - t0;
  t0 = performance.now();
  await Template.build(four(), 'bench-four', opts);
  const cached = performance.now() - t0;

  const createMs = async (name) => {
    const v = [];
    for (let i = 0; i < 10; i++) {
      const s = performance.now();
      const sbx = await Sandbox.create(name, opts);
      v.push(performance.now() - s);
      await sbx.kill();
    }
    return median(v);
  };
  const fromBase = await createMs('base');
  const fromBuilt = await createMs('bench-four');

  await Template.build(Template().fromTemplate('base')
    .setStartCmd('python3 -m http.server 8000 --bind 127.0.0.1 --directory /tmp', 'curl -sf http://127.0.0.1:8000/ >/dev/null'),
  'bench-server', opts);
  const serving = [];
  for (let i = 0; i < 5; i++) {
    const s = performance.now();
    const sbx = await Sandbox.create('bench-server', opts);
    const r = await sbx.commands.run('curl -s -o /dev/null -w %{http_code} http://127.0.0.1:8000/');
    serving.push(performance.now() - s);
    if (r.stdout !== '200') throw new Error('the start command\'s server did not answer: ' + r.stdout);
    await sbx.kill();
  }
  const report = {
    benchmark: 'template builds and creates through the E2B JS SDK 2.51.0, process backend',
    four_step_build_cold_ms: cold,
    four_step_build_cached_ms: cached,
    create_median_ms: { base: fromBase, built_four_layers: fromBuilt },
    create_to_start_cmd_serving_median_ms: serving.length ? median(serving) : null,
    kvm: 'not measured: templates built here (layers over a base) run on the process backend only',
    machine: { cpu: cpus()[0]?.model, cores: cpus().length, kernel: release() },
    date: new Date().toISOString(),
  };
  writeFileSync(out, JSON.stringify(report, null, 2) + '\n');
  console.log(`4-step build: cold ${cold.toFixed(0)} ms, cached ${cached.toFixed(0)} ms; create: base ` +
    `${fromBase.toFixed(1)} ms, built ${fromBuilt.toFixed(1)} ms; create to serving ${median(serving).toFixed(0)} ms`);
} finally {
  await server.stop();
  rmSync(ctx, { recursive: true, force: true });
}
