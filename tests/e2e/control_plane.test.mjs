// The unmodified official E2B JS SDK (npm `e2b`) against the real sandgate
// binary: create, getInfo, list with metadata filters and pagination,
// setTimeout, pause (and pause again), connect (resume), getMetrics, kill.
// Run by CTest (`e2e_js_sdk`), which passes SANDGATE_BIN and
// SANDGATE_TESTS_TEMPLATES_DIR.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { randomBytes } from 'node:crypto';
import { Sandbox, SandboxNotFoundError, AuthenticationError } from 'e2b';

const bin = process.env.SANDGATE_BIN;
const templates = process.env.SANDGATE_TESTS_TEMPLATES_DIR;
let server, dir, opts;

function startServer() {
  return new Promise((resolve, reject) => {
    const p = spawn(bin, ['serve', '--listen', '127.0.0.1:0', '--data-dir', join(dir, 'data'),
      '--templates-dir', templates, '--cgroup-parent', 'sge2e-' + randomBytes(4).toString('hex'),
      '--log-level', 'warn'], { stdio: ['ignore', 'pipe', 'inherit'] });
    let out = '';
    const timer = setTimeout(() => reject(new Error('sandgate did not start: ' + out)), 60000);
    p.on('exit', (code) => reject(new Error(`sandgate exited with ${code}: ${out}`)));
    p.stdout.on('data', (chunk) => {
      out += chunk;
      const url = /listening on (http:\/\/[0-9.:]+)/.exec(out);
      const key = /API key \(tenant "local"\): (e2b_[0-9a-f]{40})\n/.exec(out);
      if (url && key) {
        clearTimeout(timer);
        p.removeAllListeners('exit');
        resolve({ proc: p, url: url[1], key: key[1] });
      }
    });
  });
}

before(async () => {
  assert.ok(bin && templates, 'SANDGATE_BIN and SANDGATE_TESTS_TEMPLATES_DIR must be set (run through ctest)');
  dir = mkdtempSync(join(tmpdir(), 'sandgate-e2e-'));
  const s = await startServer();
  server = s.proc;
  opts = { apiUrl: s.url, sandboxUrl: s.url, apiKey: s.key };
});

after(async () => {
  if (server) {
    const exited = new Promise((r) => server.on('exit', r));
    server.kill('SIGTERM');
    await exited;
  }
  if (dir) rmSync(dir, { recursive: true, force: true });
});

test('lifecycle through the official SDK', async () => {
  const sbx = await Sandbox.create('base', { ...opts, metadata: { suite: 'e2e', 'odd key': 'a&b=c d' } });
  assert.match(sbx.sandboxId, /^[a-z0-9]{20}$/);

  const info = await sbx.getInfo();
  assert.equal(info.sandboxId, sbx.sandboxId);
  assert.equal(info.state, 'running');
  assert.equal(info.metadata['odd key'], 'a&b=c d');
  assert.ok(info.endAt > info.startedAt);

  const other = await Sandbox.create('base', { ...opts, metadata: { suite: 'other' } });

  // Metadata filter (triple encoding) through the SDK's own serializer.
  const filtered = await Sandbox.list({ ...opts, query: { metadata: { 'odd key': 'a&b=c d' } } }).nextItems();
  assert.deepEqual(filtered.map((s) => s.sandboxId), [sbx.sandboxId]);

  // Pagination: one per page.
  const pager = Sandbox.list({ ...opts, limit: 1 });
  const seen = [];
  while (pager.hasNext) seen.push(...(await pager.nextItems()));
  assert.deepEqual(seen.map((s) => s.sandboxId).sort(), [sbx.sandboxId, other.sandboxId].sort());

  await sbx.setTimeout(120_000);
  const after = await sbx.getInfo();
  assert.ok(after.endAt.getTime() - Date.now() > 60_000);

  assert.equal(await sbx.pause(), true);
  assert.equal(await sbx.pause(), false, 'second pause reports already paused (409)');
  assert.equal((await sbx.getInfo()).state, 'paused');
  const paused = await Sandbox.list({ ...opts, query: { state: ['paused'] } }).nextItems();
  assert.deepEqual(paused.map((s) => s.sandboxId), [sbx.sandboxId]);

  const again = await Sandbox.connect(sbx.sandboxId, opts);
  assert.equal(again.sandboxId, sbx.sandboxId);
  assert.equal((await sbx.getInfo()).state, 'running');

  const metrics = await sbx.getMetrics();
  assert.ok(metrics.length >= 1);
  assert.ok(metrics.at(-1).memUsed > 0);
  assert.equal(metrics.at(-1).cpuCount, 2);

  assert.equal(await sbx.kill(), true);
  assert.equal(await Sandbox.kill(sbx.sandboxId, opts), false, 'killing twice returns false (404)');
  await assert.rejects(Sandbox.getInfo(sbx.sandboxId, opts), SandboxNotFoundError);
  await assert.rejects(Sandbox.connect(sbx.sandboxId, opts), SandboxNotFoundError);
  assert.equal(await other.kill(), true);
});

test('a wrong key is an AuthenticationError', async () => {
  await assert.rejects(Sandbox.create('base', { ...opts, apiKey: 'e2b_' + '0'.repeat(40) }), AuthenticationError);
});

test('an unknown template is an error that names it', async () => {
  await assert.rejects(Sandbox.create('no-such-template', opts), /no-such-template/);
});
