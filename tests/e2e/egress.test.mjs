// Network egress as the unmodified official E2B JS SDK asks for it
// (allowInternetAccess, network.allowOut), on the process backend: the
// gateway's egress proxy is a sandbox's only way out and holds its policy
// on the host. sandgate runs with --egress --egress-allow-private: the
// destinations are HTTP servers on this host's loopback (127.0.0.2 and
// 127.0.0.3; inside a sandbox those addresses are its own loopback, so
// only the proxy reaches the host's).
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import http from 'node:http';
import { Sandbox, SandboxNotFoundError, Template } from 'e2b';
import { startSandgate } from './server.mjs';

let server, opts, allowed, closed, originA, originB, urlA, urlB;
// /hold answers with a first line and then keeps the response open; each
// such request resolves the next waiter in held.
const held = [];

function origin(host) {
  return new Promise((resolve) => {
    const s = http.createServer((req, res) => {
      if (req.url === '/hold') {
        res.writeHead(200);
        res.write('held\n');
        const w = held.shift();
        if (w) w();
        return;
      }
      res.end(`origin ${host} saw ${req.method} ${req.url}`);
    });
    s.listen(0, host, () => resolve(s));
  });
}

before(async () => {
  originA = await origin('127.0.0.2');
  originB = await origin('127.0.0.3');
  urlA = `http://127.0.0.2:${originA.address().port}`;
  urlB = `http://127.0.0.3:${originB.address().port}`;
  server = await startSandgate(['--egress', '--egress-allow-private']);
  opts = server.opts;
  allowed = await Sandbox.create('base', { ...opts, allowInternetAccess: false, network: { allowOut: ['127.0.0.2'] } });
  closed = await Sandbox.create('base', { ...opts, allowInternetAccess: false });
});

after(async () => {
  for (const s of [allowed, closed]) if (s) await s.kill().catch(() => {});
  if (server) await server.stop();
  for (const o of [originA, originB]) if (o) { o.closeAllConnections(); o.close(); }
});

// curl's answer code: of the response, or (-w %{http_connect}) of the
// proxy's answer to CONNECT; curl exits non-zero when a tunnel is refused.
const code = async (sbx, args, what = 'http_code') =>
  (await sbx.commands.run(`curl -s -o /dev/null -w '%{${what}}' ${args} || true`)).stdout;

test('the proxy is in every sandbox\'s environment', async () => {
  const r = await allowed.commands.run('echo $HTTP_PROXY $HTTPS_PROXY $NO_PROXY');
  assert.equal(r.stdout, 'http://127.0.0.1:49984 http://127.0.0.1:49984 localhost,127.0.0.1,::1\n');
});

test('an allowed destination: plain HTTP, a CONNECT tunnel, and python\'s urllib all get through', async () => {
  assert.equal((await allowed.commands.run(`curl -sS ${urlA}/plain`)).stdout, 'origin 127.0.0.2 saw GET /plain');
  assert.equal((await allowed.commands.run(`curl -sS --proxytunnel ${urlA}/tunnel`)).stdout,
    'origin 127.0.0.2 saw GET /tunnel');
  const py = await allowed.commands.run(
    `python3 -c "import urllib.request; print(urllib.request.urlopen('${urlA}/py').read().decode())"`);
  assert.equal(py.stdout, 'origin 127.0.0.2 saw GET /py\n');
});

test('a destination not in allowOut, and any destination without internet access: 403 saying why', async () => {
  assert.equal(await code(allowed, `${urlB}/`), '403');
  assert.equal(await code(allowed, `--proxytunnel ${urlB}/`, 'http_connect'), '403');
  const why = await closed.commands.run(`curl -s ${urlA}/`);
  assert.match(why.stdout, /has no internet access \(allow_internet_access is false\)/);
  assert.equal(await code(closed, `${urlA}/`), '403');
});

test('around the proxy there is no way out', async () => {
  // --noproxy: a direct connection from the sandbox's own network namespace.
  const r = await allowed.commands.run(`curl -s -o /dev/null -w '%{http_code}' --noproxy '*' --max-time 5 ${urlA}/`)
    .catch((e) => e);
  assert.equal(r.stdout, '000');
});

test('updateNetwork replaces the policy: new connections follow it, open tunnels it refuses are closed', { timeout: 60000 }, async () => {
  const sbx = await Sandbox.create('base', { ...opts, allowInternetAccess: false, network: { allowOut: ['127.0.0.3'] } });
  try {
    assert.equal(await code(sbx, `${urlA}/`), '403');
    // A tunnel to B that stays open: the origin holds its response.
    const reached = new Promise((resolve) => held.push(resolve));
    const hold = await sbx.commands.run(`curl -sS -N --proxytunnel ${urlB}/hold`, { background: true });
    await reached;
    await sbx.updateNetwork({ allowInternetAccess: false, allowOut: ['127.0.0.2'] });
    // The held tunnel is cut (curl fails on the closed connection), and
    // from now on A is allowed and B is not.
    await assert.rejects(hold.wait());
    assert.equal(await code(sbx, `${urlA}/`), '200');
    assert.equal(await code(sbx, `--proxytunnel ${urlA}/`), '200');
    assert.equal(await code(sbx, `${urlB}/`), '403');
    const info = await Sandbox.getInfo(sbx.sandboxId, opts);
    assert.equal(info.allowInternetAccess, false);
    // Omitted fields are cleared: internet access is E2B's default (on)
    // again, and with this server's --egress-allow-private that reaches both.
    await sbx.updateNetwork({});
    assert.equal(await code(sbx, `${urlB}/`), '200');
    await assert.rejects(Sandbox.updateNetwork('aaaaaaaaaaaaaaaaaaaa', {}, opts), SandboxNotFoundError);
  } finally {
    await sbx.kill().catch(() => {});
  }
});

test('a template build\'s steps download through the proxy; its sandboxes keep what they fetched', async () => {
  await Template.build(Template().fromTemplate('base').runCmd(`curl -sSf ${urlA}/package -o /opt/package`,
    { user: 'root' }), 'tpl-egress', opts);
  const sbx = await Sandbox.create('tpl-egress', { ...opts, allowInternetAccess: false });
  try {
    assert.equal(await sbx.files.read('/opt/package'), 'origin 127.0.0.2 saw GET /package');
    // The sandbox itself has no way out.
    assert.equal(await code(sbx, `${urlA}/again`), '403');
  } finally {
    await sbx.kill();
  }
});
