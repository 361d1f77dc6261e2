// The official E2B JS SDK over HTTPS (NODE_EXTRA_CA_CERTS=tls/ca.pem, set by
// ctest): control plane and envd through the TLS listener.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { fileURLToPath } from 'node:url';
import https from 'node:https';
import { Sandbox } from 'e2b';
import { startSandgate } from './server.mjs';

const tls = (f) => fileURLToPath(new URL('./tls/' + f, import.meta.url));
let server;

before(async () => {
  server = await startSandgate(['--tls-cert', tls('server.pem'), '--tls-key', tls('server.key'),
    '--domain', 'sg.test']);
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

// Host-based routing: PORT-ID.sg.test (the certificate covers *.sg.test;
// the name resolves nowhere, so the request goes to 127.0.0.1 with SNI and
// Host set by hand).
function getVia(host, path) {
  const port = new URL(server.url).port;
  return new Promise((resolve, reject) => {
    const req = https.request({ host: '127.0.0.1', port, path, servername: host, headers: { host } }, (res) => {
      let body = '';
      res.on('data', (d) => { body += d; });
      res.on('end', () => resolve({ status: res.statusCode, body }));
    });
    req.on('error', reject);
    req.end();
  });
}

test('host-based routing over TLS: PORT-ID.domain', async () => {
  const sbx = await Sandbox.create('base', server.opts);
  // create hands the SDK --domain, so getHost() names the gateway's route.
  assert.equal(sbx.getHost(8080), `8080-${sbx.sandboxId}.sg.test`);
  const connected = await Sandbox.connect(sbx.sandboxId, server.opts);
  assert.equal(connected.getHost(8080), `8080-${sbx.sandboxId}.sg.test`);
  await sbx.commands.run('mkdir -p /tmp/www && echo byhost > /tmp/www/x.txt');
  await sbx.commands.run('cd /tmp/www && python3 -m http.server 8080 --bind 127.0.0.1 >/dev/null 2>&1', { background: true });
  await sbx.commands.run('for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/8080) 2>/dev/null && exit 0; sleep 0.05; done; exit 1');
  const health = await getVia(`49983-${sbx.sandboxId}.sg.test`, '/health');
  assert.equal(health.status, 204);
  const file = await getVia(`8080-${sbx.sandboxId}.sg.test`, '/x.txt');
  assert.equal(file.status, 200);
  assert.equal(file.body, 'byhost\n');
  const unknown = await getVia('49983-aaaaaaaaaaaaaaaaaaaa.sg.test', '/health');
  assert.equal(unknown.status, 502);
  // The API host itself is the control plane.
  const api = await getVia('api.sg.test', '/health');
  assert.equal(api.status, 200);
  assert.equal(await sbx.kill(), true);
});

test('plain HTTP to the TLS port is refused', async () => {
  await assert.rejects(fetch(server.url.replace('https', 'http') + '/health'));
});
