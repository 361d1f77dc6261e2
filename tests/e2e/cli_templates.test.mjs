// The official E2B CLI (npm @e2b/cli, its own pinned e2b SDK inside) against
// sandgate: `template create` from an e2b.Dockerfile (FROM E2B's base image,
// RUN, COPY, ENV, WORKDIR), `template list -f json`, `template delete -y`;
// a sandbox of the created template sees what the Dockerfile made. Run by
// CTest (`e2e_js_cli_templates`).
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { mkdtempSync, writeFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, dirname } from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { Sandbox } from 'e2b';
import { startSandgate } from './server.mjs';

const run = promisify(execFile);
const cli = join(dirname(fileURLToPath(import.meta.url)), 'node_modules', '@e2b', 'cli', 'dist', 'index.js');
let server, opts, home, project;

before(async () => {
  server = await startSandgate();
  opts = server.opts;
  home = mkdtempSync(join(tmpdir(), 'sandgate-cli-home-'));
  project = mkdtempSync(join(tmpdir(), 'sandgate-cli-project-'));
  writeFileSync(join(project, 'e2b.Dockerfile'),
    'FROM e2bdev/base\nENV FROM_CLI=yes\nRUN echo made-by-cli > /tmp/cli.txt\nCOPY hello.txt /home/user/hello.txt\nWORKDIR /home/user\n');
  writeFileSync(join(project, 'hello.txt'), 'hello from the CLI\n');
});

after(async () => {
  if (server) await server.stop();
  for (const d of [home, project]) if (d) rmSync(d, { recursive: true, force: true });
});

// The CLI with only sandgate's URL and key (a fresh HOME: no saved login).
function e2b(...args) {
  return run(process.execPath, [cli, ...args], {
    cwd: project, timeout: 120000,
    env: { ...process.env, HOME: home, E2B_API_URL: opts.apiUrl, E2B_API_KEY: opts.apiKey, CI: '1', NO_UPDATE_NOTIFIER: '1' },
  });
}

test('e2b template create, list and delete', async () => {
  const created = await e2b('template', 'create', 'cli-tpl', '-p', project);
  assert.match(created.stdout + created.stderr, /cli-tpl/);
  const sbx = await Sandbox.create('cli-tpl', opts);
  try {
    assert.equal((await sbx.commands.run('cat /tmp/cli.txt /home/user/hello.txt; echo $FROM_CLI')).stdout,
      'made-by-cli\nhello from the CLI\nyes\n');
  } finally {
    await sbx.kill();
  }
  const listed = JSON.parse((await e2b('template', 'list', '-f', 'json')).stdout);
  const names = listed.flatMap((t) => t.names ?? t.aliases ?? []);
  assert.ok(names.includes('cli-tpl') && names.includes('base'), JSON.stringify(names));
  await e2b('template', 'delete', 'cli-tpl', '-y');
  const after = JSON.parse((await e2b('template', 'list', '-f', 'json')).stdout);
  assert.ok(!after.flatMap((t) => t.names ?? t.aliases ?? []).includes('cli-tpl'));
  await assert.rejects(e2b('template', 'delete', 'cli-tpl', '-y'), /not found/);
});
