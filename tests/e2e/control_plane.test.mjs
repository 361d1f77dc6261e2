// The unmodified official E2B JS SDK (npm `e2b`) against the real sandgate
// binary: create, getInfo, list with metadata filters and pagination,
// setTimeout, pause (and pause again), connect (resume), getMetrics, kill.
// Run by CTest (`e2e_js_sdk`), which passes SANDGATE_BIN and
// SANDGATE_TESTS_TEMPLATES_DIR.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import * as sdk251 from 'e2b';
import * as sdk250 from 'e2b-250';
import { startSandgate } from './server.mjs';

let server, opts;

before(async () => {
  server = await startSandgate();
  opts = server.opts;
});

after(async () => {
  if (server) await server.stop();
});

// 2.51 uses /v2/sandboxes and /v2/.../connect; 2.50 the v1 routes.
for (const [version, sdk] of [['2.51.0', sdk251], ['2.50.0', sdk250]]) {
const { Sandbox, SandboxNotFoundError, AuthenticationError } = sdk;

test(`lifecycle through SDK ${version}`, async () => {
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

test(`SDK ${version}: a wrong key is an AuthenticationError`, async () => {
  await assert.rejects(Sandbox.create('base', { ...opts, apiKey: 'e2b_' + '0'.repeat(40) }), AuthenticationError);
});

test(`SDK ${version}: an unknown template is an error that names it`, async () => {
  await assert.rejects(Sandbox.create('no-such-template', opts), /no-such-template/);
});

test(`SDK ${version}: two sandboxes are isolated from each other`, async () => {
  const a = await Sandbox.create('base', opts);
  const b = await Sandbox.create('base', opts);
  await a.files.write('/tmp/mine.txt', 'a');
  assert.equal(await b.files.exists('/tmp/mine.txt'), false);
  await b.commands.run('sleep 300', { background: true });
  const inA = await a.commands.run('ps -e -o comm=');
  assert.ok(!inA.stdout.includes('sleep'), 'b\'s processes are invisible in a');
  // a's token does not open b's envd.
  const res = await fetch(server.url + '/process.Process/List', {
    method: 'POST', body: '{}',
    headers: { 'Content-Type': 'application/json', 'E2b-Sandbox-Id': b.sandboxId, 'E2b-Sandbox-Port': '49983',
      'X-Access-Token': a.envdAccessToken ?? 'none' },
  });
  assert.equal(res.status, 401);
  await a.kill();
  await b.kill();
});
}

// Templates (issue 19) through 2.51's Template API, and an honest 501 for
// what this server does not serve.
test('SDK 2.51.0: Template.exists and getTags see base; unserved APIs say so', async () => {
  const { Template, Volume } = sdk251;
  assert.equal(await Template.exists('base', opts), true);
  assert.equal(await Template.exists('no-such-template', opts), false);
  const tags = await Template.getTags('base', opts);
  assert.equal(tags.length, 1);
  assert.equal(tags[0].tag, 'default');
  assert.match(tags[0].buildId, /^[0-9a-f-]{36}$/);
  await assert.rejects(Volume.list(opts), /GET \/volumes is not supported by this server/);
});
