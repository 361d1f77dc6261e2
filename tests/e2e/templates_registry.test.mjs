// Templates from registry images (issue 19) with the official E2B JS SDK:
// a real registry (Debian's docker-registry, tests/e2e/fixtures/registry.mjs),
// an image the test makes and pushes, Template.build() from it (tag, digest,
// OCI index), Sandbox.create() of the result; Basic authentication with
// fromImage credentials; and the failures: unknown image, refused
// credentials, a size that does not match. Run by CTest
// (`e2e_js_templates_registry`).
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';
import { randomBytes, createHash } from 'node:crypto';
import { Template, Sandbox } from 'e2b';
import { startSandgate } from './server.mjs';
import { startRegistry, tinyImage } from './fixtures/registry.mjs';

let server, opts, open, locked;
const marker = 'escaped-' + randomBytes(6).toString('hex');

before(async () => {
  server = await startSandgate();
  opts = server.opts;
  open = await startRegistry();
  locked = await startRegistry({ user: 'alice', password: 's3cret-pw' });
  const image = tinyImage(marker);
  await open.push('test/tiny', '1', image);
  await locked.push('private/tiny', '1', image);
});

after(async () => {
  if (server) await server.stop();
  if (open) await open.stop();
  if (locked) await locked.stop();
});

test('Template.build from a registry image: layers, whiteouts, the image env; a hostile symlink stays inside', async () => {
  const logs = [];
  await Template.build(Template().fromImage(`${open.host}/test/tiny:1`)
    .runCmd('echo "$IMAGE_VAR" > /tmp/env.txt && id -un > /tmp/who.txt'), 'tpl-registry',
  { ...opts, onBuildLogs: (l) => logs.push(l.message) });
  assert.match(logs.join('\n'), /FROM 127\.0\.0\.1:\d+\/test\/tiny:1 \(sha256:/);
  const sbx = await Sandbox.create('tpl-registry', opts);
  try {
    const run = async (cmd) => (await sbx.commands.run(cmd)).stdout;
    assert.equal(await run('cat /tmp/env.txt /tmp/who.txt'), 'from-image\nuser\n');
    assert.equal(await run('cat /etc/motd; test -e /removed.txt && echo present || echo gone'), 'layer two\ngone\n');
    assert.equal(await run(`cat /tmp/${marker}`), 'inside the image\n');
  } finally {
    await sbx.kill();
  }
  assert.equal(existsSync(`/tmp/${marker}`), false, 'a layer wrote outside the image root');
});

test('an OCI image with a zstd-compressed layer', async () => {
  await Template.build(Template().fromImage(`${open.host}/test/tiny:1-zstd`), 'tpl-zstd', opts);
  const sbx = await Sandbox.create('tpl-zstd', opts);
  try {
    const r = await sbx.commands.run('cat /etc/motd; test -e /removed.txt && echo present || echo gone');
    assert.equal(r.stdout, 'layer two\ngone\n');
  } finally {
    await sbx.kill();
  }
});

test('an OCI index picks linux/amd64; a digest reference is checked', async () => {
  await Template.build(Template().fromImage(`${open.host}/test/tiny:1-index`), 'tpl-index', opts);
  const m = await (await fetch(`http://${open.host}/v2/test/tiny/manifests/1`, {
    headers: { Accept: 'application/vnd.docker.distribution.manifest.v2+json' },
  })).arrayBuffer();
  const digest = 'sha256:' + createHash('sha256').update(Buffer.from(m)).digest('hex');
  await Template.build(Template().fromImage(`${open.host}/test/tiny@${digest}`), 'tpl-digest', opts);
  const sbx = await Sandbox.create('tpl-digest', opts);
  await sbx.kill();
});

test('registry failures are clear build errors', async () => {
  await assert.rejects(Template.build(Template().fromImage(`${open.host}/test/none:1`), 'tpl-none', opts), /not found/);
  await assert.rejects(Template.build(Template().fromImage(`${open.host}/test/tiny:1-lying`), 'tpl-lying', opts),
    /size mismatch/);
  await assert.rejects(Template.build(Template().fromImage(`${locked.host}/private/tiny:1`), 'tpl-noauth', opts),
    /needs credentials/);
  await assert.rejects(Template.build(Template().fromImage(`${locked.host}/private/tiny:1`,
    { username: 'alice', password: 'wrong' }), 'tpl-badauth', opts), /refused the credentials/);
  await Template.build(Template().fromImage(`${locked.host}/private/tiny:1`,
    { username: 'alice', password: 's3cret-pw' }), 'tpl-auth', opts);
});
