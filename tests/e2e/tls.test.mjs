// The official E2B JS SDK over HTTPS (NODE_EXTRA_CA_CERTS=tls/ca.pem, set by
// ctest): control plane and envd through the TLS listener.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { fileURLToPath } from 'node:url';
import { Sandbox } from 'e2b';
import { startSandgate } from './server.mjs';

const tls = (f) => fileURLToPath(new URL('./tls/' + f, import.meta.url));
let server;

before(async () => {
  server = await startSandgate(['--tls-cert', tls('server.pem'), '--tls-key', tls('server.key')]);
});

after(async () => {
  if (server) await server.stop();
});

test('create, run a command, read a file and kill over HTTPS', async () => {
  assert.match(server.url, /^https:/);
  const sbx = await Sandbox.create('base', server.opts);
  const r = await sbx.commands.run('echo secure');
  assert.equal(r.stdout, 'secure\n');
  await sbx.files.write('/tmp/t.txt', 'tls');
  assert.equal(await sbx.files.read('/tmp/t.txt'), 'tls');
  assert.equal(await sbx.kill(), true);
});

test('plain HTTP to the TLS port is refused', async () => {
  await assert.rejects(fetch(server.url.replace('https', 'http') + '/health'));
});
