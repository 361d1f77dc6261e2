// Custom templates (issue 19) with the unmodified official E2B JS SDK:
// Template.build() of a template from base with ENV, RUN, COPY, WORKDIR,
// USER and a start command with its ready command, then Sandbox.create()
// of it; a second build taken whole from the cache; builds that fail say
// which step and why. Run by CTest (`e2e_js_templates`).
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, mkdirSync, writeFileSync, chmodSync, rmSync, readdirSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Template, Sandbox, BuildError, waitForPort } from 'e2b';
import { startSandgate } from './server.mjs';

let server, opts, ctx;

before(async () => {
  server = await startSandgate();
  opts = server.opts;
  ctx = mkdtempSync(join(tmpdir(), 'sandgate-tpl-ctx-'));
  mkdirSync(join(ctx, 'app', 'sub'), { recursive: true });
  writeFileSync(join(ctx, 'app', 'hello.txt'), 'hello from COPY\n');
  writeFileSync(join(ctx, 'app', 'sub', 'run.sh'), '#!/bin/sh\necho run.sh ran\n');
  chmodSync(join(ctx, 'app', 'sub', 'run.sh'), 0o755);
  writeFileSync(join(ctx, 'single.txt'), 'one file\n');
});

after(async () => {
  if (server) await server.stop();
  if (ctx) rmSync(ctx, { recursive: true, force: true });
});

function template() {
  return Template({ fileContextPath: ctx })
    .fromTemplate('base')
    .setEnvs({ GREETING: 'hi there', APP_HOME: '/opt/app' })
    .runCmd('echo "$GREETING" > /etc/greeting && mkdir -p /srv/www && echo served > /srv/www/index.html',
      { user: 'root' })
    .copy('app', '/opt/app/', { user: 'user' })
    .copy('single.txt', '/opt/single.txt', { mode: 0o600, user: 'root' })
    .setWorkdir('/opt/app')
    .setUser('user')
    .runCmd('whoami > whoami.txt && pwd >> whoami.txt')
    .setStartCmd('python3 -m http.server 8000 --bind 127.0.0.1 --directory /srv/www',
      'curl -sf http://127.0.0.1:8000/ >/dev/null');
}

// Starts a build of `name` whose step sleeps 600 s on server `own`, and
// resolves once the step runs.
async function startSleeper(own, name) {
  const info = await Template.buildInBackground(Template().fromTemplate('base').runCmd('sleep 600'), name, own.opts);
  const statusUrl = `${own.url}/templates/${info.templateId}/builds/${info.buildId}/status`;
  for (let i = 0; ; i++) {
    const st = await (await fetch(statusUrl, { headers: { 'X-API-KEY': own.key } })).json();
    if (st.logEntries.some((e) => e.message.startsWith('RUN sleep'))) return;
    assert.ok(i < 400, 'the step never started: ' + JSON.stringify(st));
    await new Promise((r) => setTimeout(r, 50));
  }
}

test('Template.build builds from base; Sandbox.create runs it with its start command', async () => {
  const logs = [];
  const t0 = Date.now();
  const info = await Template.build(template(), 'tpl-e2e', { ...opts, onBuildLogs: (l) => logs.push(l) });
  const cold = Date.now() - t0;
  assert.equal(info.name, 'tpl-e2e');
  assert.match(info.buildId, /^[0-9a-f-]{36}$/);
  const text = logs.map((l) => l.message).join('\n');
  assert.match(text, /RUN echo "\$GREETING"/);
  assert.match(text, /Ready command succeeded/);
  assert.equal(await Template.exists('tpl-e2e', opts), true);

  const sbx = await Sandbox.create('tpl-e2e', opts);
  try {
    const run = async (cmd, o = {}) => (await sbx.commands.run(cmd, o)).stdout;
    assert.equal(await run('cat /etc/greeting'), 'hi there\n');
    assert.equal(await run('echo "$GREETING:$APP_HOME"'), 'hi there:/opt/app\n');
    assert.equal(await run('cat /opt/app/hello.txt'), 'hello from COPY\n');
    assert.equal(await run('stat -c %U:%a /opt/app/hello.txt /opt/single.txt'), 'user:644\nroot:600\n');
    assert.equal(await run('/opt/app/sub/run.sh'), 'run.sh ran\n');
    assert.equal(await run('cat /opt/app/whoami.txt'), 'user\n/opt/app\n');
    // The start command's server answers at once: create waited for it.
    assert.equal(await run('curl -s http://127.0.0.1:8000/'), 'served\n');
    // Its writable layer has base's size limit, like every sandbox.
    const got = await fetch(`${opts.apiUrl}/sandboxes/${sbx.sandboxId}`, { headers: { 'X-API-Key': opts.apiKey } });
    assert.equal((await got.json()).diskSizeMB, 1024);
    const rootMb = Number((await run('df --output=size -m / | tail -1')).trim());
    assert.ok(rootMb > 0 && rootMb <= 1024, `the writable layer holds ${rootMb} MB`);
  } finally {
    await sbx.kill();
  }

  // The same template again: every step from the cache.
  const again = [];
  const t1 = Date.now();
  await Template.build(template(), 'tpl-e2e', { ...opts, onBuildLogs: (l) => again.push(l) });
  const cached = Date.now() - t1;
  const msgs = again.map((l) => l.message);
  assert.equal(msgs.filter((m) => m.startsWith('CACHED')).length, 5, msgs.join('\n'));  // RUN, COPY, COPY, WORKDIR, RUN
  console.log(`# build: cold ${cold} ms, cached ${cached} ms`);
});

test('a failing step fails the build and names the step and exit status; the template is not changed', async () => {
  const bad = Template().fromTemplate('base').runCmd('echo about to fail; exit 3');
  await assert.rejects(Template.build(bad, 'tpl-fails', opts), (e) => {
    assert.ok(e instanceof BuildError, String(e));
    assert.match(e.message, /exit status 3/);
    return true;
  });
  // A template whose first build failed cannot start sandboxes.
  await assert.rejects(Sandbox.create('tpl-fails', opts), /tpl-fails/);
});

test('an unreachable registry is a clear build error; the default base image is base', async () => {
  await assert.rejects(Template.build(Template().fromImage('127.0.0.1:1/nothing/here:1'), 'tpl-image', opts),
    /GET http:\/\/127\.0\.0\.1:1\/v2\/nothing\/here\/manifests\/1: curl: \(7\)/);
  // E2B's default base image is this server's base template.
  await Template.build(Template().fromBaseImage().runCmd('touch /tmp/x'), 'tpl-default-base', opts);
});

test('tags: name:tag builds, assignTags, getTags, removeTags; Sandbox.create by tag; the logs route', async () => {
  const v = (n) => Template().fromTemplate('base').runCmd(`echo ${n} > /etc/version`, { user: 'root' });
  await Template.build(v(1), 'tpl-tags', opts);
  const b2 = await Template.build(v(2), 'tpl-tags:v2', opts);
  const version = async (ref) => {
    const sbx = await Sandbox.create(ref, opts);
    try {
      return (await sbx.commands.run('cat /etc/version')).stdout.trim();
    } finally {
      await sbx.kill();
    }
  };
  assert.equal(await version('tpl-tags'), '1');
  assert.equal(await version('tpl-tags:v2'), '2');
  await assert.rejects(Sandbox.create('tpl-tags:v3', opts), /no tag 'v3'/);

  const assigned = await Template.assignTags('tpl-tags:v2', ['default', 'prod'], opts);
  assert.deepEqual(assigned.tags, ['default', 'prod']);
  assert.equal(assigned.buildId, b2.buildId);
  assert.equal(await version('tpl-tags'), '2');
  const tags = await Template.getTags('tpl-tags', opts);
  assert.deepEqual(tags.map((t) => t.tag), ['default', 'prod', 'v2']);
  assert.ok(tags.every((t) => t.buildId === b2.buildId && t.createdAt instanceof Date));
  await Template.removeTags('tpl-tags', ['prod', 'v2'], opts);
  assert.deepEqual((await Template.getTags('tpl-tags', opts)).map((t) => t.tag), ['default']);
  await assert.rejects(Template.removeTags('tpl-tags', ['default'], opts), /cannot be removed/);

  // The build logs route (E2B's TemplateBuildLogsResponse), newest first.
  const res = await fetch(`${opts.apiUrl}/templates/${b2.templateId}/builds/${b2.buildId}/logs?direction=backward&limit=3`,
    { headers: { 'X-API-Key': opts.apiKey } });
  assert.equal(res.status, 200);
  const { logs } = await res.json();
  assert.equal(logs.length, 3);
  assert.ok(logs.every((l) => typeof l.message === 'string' && l.level && l.timestamp), JSON.stringify(logs));
  assert.ok(logs[0].timestamp >= logs[2].timestamp);
});

test('base is like E2B\'s: node and npm, pip and venv, passwordless sudo, ss for waitForPort', async () => {
  const sbx = await Sandbox.create('base', opts);
  try {
    const run = async (cmd) => {
      const r = await sbx.commands.run(cmd);
      return r.stdout.trim();
    };
    assert.match(await run('node -e "console.log(process.version)"'), /^v1[89]\.|^v2\d\./);
    assert.match(await run('npm --version'), /^\d+\.\d+\.\d+$/);
    assert.match(await run('python3 -m pip --version'), /^pip \d+/);
    assert.equal(await run('python3 -m venv /tmp/v && /tmp/v/bin/python -c "import sys; print(sys.prefix)"'), '/tmp/v');
    assert.equal(await run('whoami && pwd'), 'user\n/home/user');
    assert.equal(await run('sudo -n whoami'), 'root');
    // pip installs as E2B's image does (Debian's externally-managed marker is gone).
    const wheel = await run('mkdir -p /tmp/p/pkgsg && echo "X = 1" > /tmp/p/pkgsg/__init__.py && ' +
      'printf "[project]\\nname = \\"pkgsg\\"\\nversion = \\"1\\"\\n" > /tmp/p/pyproject.toml && ' +
      'python3 -m pip install --no-build-isolation --no-index -q /tmp/p 2>&1; python3 -c "import pkgsg; print(pkgsg.X)"');
    assert.match(wheel, /1$/);
  } finally {
    await sbx.kill();
  }
  // waitForPort is `ss` in the ready command.
  await Template.build(Template().fromTemplate('base')
    .setStartCmd('python3 -m http.server 8001 --bind 127.0.0.1', waitForPort(8001)), 'tpl-port', opts);
  const s2 = await Sandbox.create('tpl-port', opts);
  try {
    assert.equal((await s2.commands.run('curl -s -o /dev/null -w "%{http_code}" http://127.0.0.1:8001/')).stdout, '200');
  } finally {
    await s2.kill();
  }
});

test('a template name taken by another template of the server is a conflict', async () => {
  await assert.rejects(Template.build(Template().fromTemplate('base'), 'base', opts), /taken/);
});

// The build API's bad inputs, through raw HTTP as a hostile client sends them.
test('bad uploads and bad steps are refused with clear errors; nothing escapes the build sandbox', async () => {
  const api = async (method, path, body) => {
    const r = await fetch(opts.apiUrl + path, {
      method, headers: { 'X-API-KEY': opts.apiKey, 'Content-Type': 'application/json' },
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    const text = await r.text();
    return { status: r.status, body: text ? JSON.parse(text) : null };
  };
  const req = await api('POST', '/v3/templates', { name: 'tpl-raw' });
  assert.equal(req.status, 202);
  const { templateID, buildID } = req.body;
  const hash = 'ab'.repeat(32);
  const link = await api('GET', `/templates/${templateID}/files/${hash}`);
  assert.equal(link.status, 201);
  assert.equal(link.body.present, false);
  // A forged or altered link is refused.
  const forged = link.body.url.replace(/signature=[0-9a-f]+/, 'signature=' + '0'.repeat(64));
  assert.equal((await fetch(forged, { method: 'PUT', body: 'x' })).status, 401);
  const otherHash = link.body.url.replace(hash, 'cd'.repeat(32));
  assert.equal((await fetch(otherHash, { method: 'PUT', body: 'x' })).status, 401);
  // A tar whose member climbs out of the target.
  const { execFileSync } = await import('node:child_process');
  const evil = execFileSync('python3', ['-c', `
import io, sys, tarfile
b = io.BytesIO()
with tarfile.open(fileobj=b, mode='w') as t:
    data = b'owned\\n'
    i = tarfile.TarInfo('../../../../etc/evil'); i.size = len(data); t.addfile(i, io.BytesIO(data))
sys.stdout.buffer.write(b.getvalue())`]);
  assert.equal((await fetch(link.body.url, { method: 'PUT', body: evil })).status, 200);
  // An upload past the API's 1 MiB body limit (uploads may be 256 MiB).
  const big = await api('GET', `/templates/${templateID}/files/${'cd'.repeat(32)}`);
  assert.equal((await fetch(big.body.url, { method: 'PUT', body: Buffer.alloc(3 << 20, 7) })).status, 200);
  assert.equal((await api('GET', `/templates/${templateID}/files/${'cd'.repeat(32)}`)).body.present, true);
  assert.equal((await api('GET', `/templates/${templateID}/files/${hash}`)).body.present, true);
  // An unknown step type, a COPY without a hash: 400 at start, nothing queued.
  const bad1 = await api('POST', `/v2/templates/${templateID}/builds/${buildID}`,
    { fromTemplate: 'base', steps: [{ type: 'ADD', args: ['x', 'y'] }] });
  assert.equal(bad1.status, 400);
  assert.match(bad1.body.message, /unknown step type/);
  const bad2 = await api('POST', `/v2/templates/${templateID}/builds/${buildID}`,
    { fromTemplate: 'base', steps: [{ type: 'COPY', args: ['a', '/b'] }] });
  assert.equal(bad2.status, 400);
  assert.match(bad2.body.message, /filesHash/);
  // More RUN and COPY steps than a template's 64 layers.
  const bad3 = await api('POST', `/v2/templates/${templateID}/builds/${buildID}`,
    { fromTemplate: 'base', steps: Array.from({ length: 65 }, (_, i) => ({ type: 'RUN', args: [`echo ${i}`] })) });
  assert.equal(bad3.status, 400);
  assert.match(bad3.body.message, /the steps would make 65 layers .*a template holds at most 64: join RUN steps with &&/);
  // The climbing tar: tar refuses the member, the step fails with its log.
  const start = await fetch(opts.apiUrl + `/v2/templates/${templateID}/builds/${buildID}`, {
    method: 'POST', headers: { 'X-API-KEY': opts.apiKey, 'Content-Type': 'application/json' },
    body: JSON.stringify({ fromTemplate: 'base', steps: [{ type: 'COPY', args: ['.', '/opt/x/'], filesHash: hash }] }),
  });
  assert.equal(start.status, 202);
  assert.equal(start.headers.get('content-length'), '0');
  let st;
  for (let i = 0; i < 200; i++) {
    st = await api('GET', `/templates/${templateID}/builds/${buildID}/status?logsOffset=0`);
    if (st.body.status === 'error' || st.body.status === 'ready') break;
    await new Promise((r) => setTimeout(r, 50));
  }
  assert.equal(st.body.status, 'error');
  assert.equal(st.body.reason.step, '1');
  assert.match(st.body.reason.message, /exit status/);
  assert.match(JSON.stringify(st.body.logEntries), /\.\./);
  // Starting the same build again: it has run.
  assert.equal((await api('POST', `/v2/templates/${templateID}/builds/${buildID}`, { fromTemplate: 'base' })).status, 409);
  // Another tenant's view: none (the local tenant is the only one here),
  // so an unknown template id is 404.
  assert.equal((await api('GET', `/templates/nope/builds/${buildID}/status`)).status, 404);
});

test('stopping the server ends a running build at once and exits cleanly', async () => {
  const own = await startSandgate();
  try {
    await startSleeper(own, 'tpl-long');
  } finally {
    const t0 = Date.now();
    const exit = await own.stop();
    assert.deepEqual(exit, { code: 0, signal: null });
    assert.ok(Date.now() - t0 < 20000, `the stop took ${Date.now() - t0} ms`);
  }
});

test('quotas: a tenant past its storage or build limit is refused; a deleted template\'s layers are collected', async () => {
  const own = await startSandgate(['--template-builds', '1', '--template-storage-mb', '3']);
  const layers = join(own.dir, 'data', 'layers');
  const count = () => { try { return readdirSync(layers).length; } catch { return 0; } };
  try {
    // A step that writes more than the tenant may keep fails the build; its
    // layer is not kept.
    const big = Template().fromTemplate('base').runCmd('head -c 4000000 /dev/urandom > /home/user/big');
    await assert.rejects(Template.build(big, 'tpl-big', own.opts), (e) => {
      assert.ok(e instanceof BuildError, String(e));
      assert.match(e.message, /quota exceeded: this step's 3 MiB would take this team's templates to 3 MiB, the limit is 3 MiB/);
      return true;
    });
    assert.equal(count(), 0);

    // Deleting a template frees its layers (collected between builds).
    await Template.build(Template().fromTemplate('base').runCmd('echo one > /tmp/one'), 'tpl-gc', own.opts);
    assert.equal(count(), 1);
    const del = await fetch(`${own.url}/templates/tpl-gc`, { method: 'DELETE', headers: { 'X-API-KEY': own.key } });
    assert.equal(del.status, 204);
    for (let i = 0; count() > 0; i++) {
      assert.ok(i < 400, 'the deleted template\'s layer was never collected');
      await new Promise((r) => setTimeout(r, 25));
    }

    // One build at a time for this tenant: a second is 429 while one runs.
    await startSleeper(own, 'tpl-slow');
    await assert.rejects(Template.build(Template().fromTemplate('base').runCmd('true'), 'tpl-second', own.opts),
      /builds queued or running, the limit is 1/);
  } finally {
    await own.stop();
  }
});

test('a build past its time limit fails with a clear error', async () => {
  const own = await startSandgate(['--template-build-timeout', '2']);
  try {
    const t0 = Date.now();
    await assert.rejects(Template.build(Template().fromTemplate('base').runCmd('sleep 60'), 'tpl-slow', own.opts), (e) => {
      assert.ok(e instanceof BuildError, String(e));
      assert.match(e.message, /the build ran past its time limit of 2 s/);
      return true;
    });
    assert.ok(Date.now() - t0 < 30000, `the limit took ${Date.now() - t0} ms to act`);
  } finally {
    await own.stop();
  }
});

test('a build step has the sandboxes\' disk limit: one that fills it fails with ENOSPC, one within it is kept', async (t) => {
  const own = await startSandgate(['--sandbox-disk-mb', '32']);
  try {
    // No disk limits here at all (no loop devices): / is the host's filesystem.
    const probe = await Sandbox.create('base', own.opts);
    const kib = Number((await probe.commands.run("df -Pk / | awk 'NR==2 {print $2}'")).stdout.trim());
    await probe.kill();
    if (kib > 4 * 1024 * 1024) {
      t.skip(`no disk limit on this host (/ is ${kib} KiB; loop devices missing?)`);
      return;
    }
    const fill = Template().fromTemplate('base').runCmd('dd if=/dev/zero of=/home/user/fill bs=1M count=64');
    const logs = [];
    await assert.rejects(Template.build(fill, 'tpl-fill', { ...own.opts, onBuildLogs: (l) => logs.push(l.message) }),
      (e) => {
        assert.ok(e instanceof BuildError, String(e));
        assert.match(e.message, /exit status 1/);
        return true;
      });
    const text = logs.join('\n');
    assert.match(text, /RUN dd if=\/dev\/zero/);
    assert.match(text, /No space left on device/);
    await Template.build(Template().fromTemplate('base').runCmd('dd if=/dev/zero of=/home/user/kept bs=1M count=8'),
      'tpl-within', own.opts);
    const sbx = await Sandbox.create('tpl-within', own.opts);
    try {
      assert.equal((await sbx.commands.run('stat -c %s /home/user/kept')).stdout.trim(), String(8 << 20));
    } finally {
      await sbx.kill();
    }
  } finally {
    await own.stop();
  }
});

test('a ready command that never succeeds fails the build, or the create, after --template-ready-timeout; nothing is left', async () => {
  const own = await startSandgate(['--template-ready-timeout', '2']);
  try {
    await assert.rejects(Template.build(Template().fromTemplate('base').setStartCmd('sleep infinity', 'false'),
      'tpl-never-ready', own.opts), (e) => {
      assert.ok(e instanceof BuildError, String(e));
      assert.match(e.message, /the ready command 'false' did not succeed within 2 s of the start command/);
      return true;
    });
    // Ready at build, not at a create whose environment says otherwise.
    await Template.build(Template().fromTemplate('base').setStartCmd('sleep infinity', 'test -z "$NOT_READY"'),
      'tpl-ready-env', own.opts);
    await assert.rejects(Sandbox.create('tpl-ready-env', { ...own.opts, envs: { NOT_READY: '1' } }),
      /template 'tpl-ready-env': its ready command did not succeed within 2 s of the start command/);
    assert.deepEqual(await Sandbox.list(own.opts).nextItems(), []);
    const sbx = await Sandbox.create('tpl-ready-env', own.opts);
    try {
      assert.equal((await sbx.commands.run('pgrep -x sleep >/dev/null && echo running')).stdout, 'running\n');
    } finally {
      await sbx.kill();
    }
  } finally {
    await own.stop();
  }
});
