// microVMs' own networks through the official E2B JS SDK, in the KVM harness
// (tests/kvm-harness; CTest kvm_harness_network): sandgate runs in the
// outer guest with --network veth, so each microVM has a virtio-net device
// on a TAP with the veth path's addresses and nftables policy
// (docs/networking.md). This host stands in for the internet: the test's
// own HTTP server and UDP echo, reached from the outer guest as 10.0.2.2
// (QEMU user networking; sandgate runs with --egress-allow-private, as
// that address is a private one). Nothing in a sandbox knows of a proxy.
// Harness mode only: where /dev/kvm works for real, run it with
// SANDGATE_E2E_URL and SANDGATE_E2E_KEY pointing at a kvm sandgate that
// reaches this host as 10.0.2.2 (SANDGATE_E2E_HOST_ADDR overrides).
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import http from 'node:http';
import dgram from 'node:dgram';
import { Sandbox, CommandExitError } from 'e2b';
import { restartSandgate } from './kvm_common.mjs';

const remote = process.env.SANDGATE_E2E_URL;
const ctl = process.env.SANDGATE_HARNESS_CTL;
const hostAddr = process.env.SANDGATE_E2E_HOST_ADDR || '10.0.2.2';
const STEP = { timeout: 300_000 };

if (!remote) {
  test('kvm network (harness mode only)', { skip: 'needs a kvm sandgate: SANDGATE_E2E_URL (tests/kvm-harness/harness.sh)' }, () => {});
} else {
  const opts = { apiUrl: remote, sandboxUrl: remote, apiKey: process.env.SANDGATE_E2E_KEY, requestTimeoutMs: 120_000 };
  let web, echo, webPort, echoPort, sbx;

  before(async () => {
    web = http.createServer((req, res) => {
      if (req.url === '/big') {
        // 32 MiB at about 3 MiB/s: a policy change lands mid-way.
        res.writeHead(200, { 'content-type': 'application/octet-stream' });
        let left = 32 << 20;
        const chunk = Buffer.alloc(64 << 10);
        const more = () => {
          if (left <= 0) return res.end();
          left -= chunk.length;
          res.write(chunk);
          setTimeout(more, 20);
        };
        return more();
      }
      res.end('hello from the host\n');
    });
    await new Promise((r) => web.listen(0, '0.0.0.0', r));
    webPort = web.address().port;
    echo = dgram.createSocket('udp4');
    echo.on('message', (m, from) => echo.send(Buffer.concat([Buffer.from('echo: '), m]), from.port, from.address));
    await new Promise((r) => echo.bind(0, '0.0.0.0', r));
    echoPort = echo.address().port;
    sbx = await Sandbox.create('base', { ...opts, timeoutMs: 900_000 });
  });

  after(async () => {
    if (sbx) await sbx.kill().catch(() => {});
    web?.close();
    echo?.close();
  });

  // A command's stdout, or its exit code as "exit N" when it fails.
  async function run(s, cmd, timeoutMs = 60_000) {
    try {
      return (await s.commands.run(cmd, { timeoutMs })).stdout;
    } catch (e) {
      if (e instanceof CommandExitError) return `exit ${e.exitCode}`;
      throw e;
    }
  }
  const curl = (s, path = '/') => run(s, `curl -sS --max-time 20 http://${hostAddr}:${webPort}${path} 2>/dev/null`);
  const udp = (s) => run(s,
    `python3 -c "import socket;s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM);s.settimeout(10);` +
    `s.sendto(b'hi',('${hostAddr}',${echoPort}));print(s.recv(100).decode())"`);

  test('a microVM is on the network by default: eth0, TCP, UDP, ICMP, Python, no proxy', STEP, async () => {
    assert.equal(await run(sbx, 'echo "[$HTTP_PROXY$HTTPS_PROXY$http_proxy]"'), '[]\n');
    const resolv = await run(sbx, 'cat /etc/resolv.conf');
    const gw = /^nameserver (10\.\d+\.\d+\.\d+)$/m.exec(resolv);
    assert.ok(gw, resolv);
    // eth0's address is the one next to the gateway (a /30: .1 and .2).
    const src = await run(sbx, `python3 -c "import socket;s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM);s.connect(('${hostAddr}',9));print(s.getsockname()[0])"`);
    const g = gw[1].split('.').map(Number);
    assert.equal(src.trim(), `${g[0]}.${g[1]}.${g[2]}.${g[3] + 1}`);
    assert.equal(await curl(sbx), 'hello from the host\n');
    assert.equal(await run(sbx, `python3 -c "import urllib.request;print(urllib.request.urlopen('http://${hostAddr}:${webPort}/',timeout=20).read().decode(),end='')"`),
      'hello from the host\n');
    assert.equal(await udp(sbx), 'echo: hi\n');
    // An ICMP echo as ping sends it without privileges (an ICMP datagram
    // socket), to QEMU's address for this host: "0 ping" is the reply's
    // type and payload.
    assert.equal(await run(sbx,
      `python3 -c "import socket;s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM,socket.IPPROTO_ICMP);s.settimeout(10);` +
      `s.sendto(b'\\x08\\x00\\x00\\x00\\x00\\x01\\x00\\x01ping',('${hostAddr}',0));r=s.recv(100);print(r[0],r[8:].decode())"`), '0 ping\n');
    // The path and the sandbox's traffic on /metrics.
    const m = await (await fetch(`${remote}/metrics`)).text();
    assert.match(m, /^sandgate_network_path\{path="tap"\} 1$/m);
    const inBytes = new RegExp(`^sandgate_sandbox_network_bytes_total\\{sandbox="${sbx.sandboxId}",direction="in"\\} (\\d+)$`, 'm').exec(m);
    assert.ok(inBytes && Number(inBytes[1]) > 0, m.slice(0, 2000));
  });

  test('allowInternetAccess false: nothing gets out; allowOut opens one address; denyOut closes it', STEP, async () => {
    const off = await Sandbox.create('base', { ...opts, timeoutMs: 300_000, allowInternetAccess: false });
    try {
      assert.equal(await curl(off), 'exit 7');
      assert.match(await udp(off), /^exit 1/);
    } finally {
      await off.kill();
    }
    const only = await Sandbox.create('base', { ...opts, timeoutMs: 300_000, allowInternetAccess: false,
      network: { allowOut: [`${hostAddr}/32`] } });
    try {
      assert.equal(await curl(only), 'hello from the host\n');
      assert.equal(await udp(only), 'echo: hi\n');
    } finally {
      await only.kill();
    }
    const deny = await Sandbox.create('base', { ...opts, timeoutMs: 300_000, network: { denyOut: [`${hostAddr}/32`] } });
    try {
      assert.equal(await curl(deny), 'exit 7');
      assert.match(await udp(deny), /^exit 1/);
    } finally {
      await deny.kill();
    }
  });

  test('a live policy update cuts a running download; a fork gets its own address', STEP, async () => {
    const dl = await sbx.commands.run(`curl -sS --max-time 240 -o /tmp/big http://${hostAddr}:${webPort}/big`,
      { background: true, timeoutMs: 0 });
    // The download is under way (bytes arriving) before the update.
    assert.equal(await run(sbx, 'for i in $(seq 600); do [ "$(stat -c %s /tmp/big 2>/dev/null || echo 0)" -gt 1000000 ] && echo going && break; sleep 0.2; done', 180_000),
      'going\n');
    await sbx.updateNetwork({ denyOut: [`${hostAddr}/32`] });
    const err = await dl.wait().then(() => null, (e) => e);
    assert.ok(err instanceof CommandExitError, 'the download ended with an error');
    assert.equal(err.exitCode, 56, err.stderr);  // curl: failure receiving data (connection reset)
    assert.ok(Number((await run(sbx, 'stat -c %s /tmp/big')).trim()) < (32 << 20));
    assert.equal(await curl(sbx), 'exit 7');
    await sbx.updateNetwork({});
    assert.equal(await curl(sbx), 'hello from the host\n');

    // A snapshot's clone resumes with the parent's eth0 and is configured
    // with its own address; both reach the host.
    const snap = await sbx.createSnapshot({ requestTimeoutMs: 600_000 });
    const child = await Sandbox.create(snap.snapshotId, { ...opts, timeoutMs: 300_000 });
    try {
      const mine = await run(sbx, 'cat /etc/resolv.conf');
      const theirs = await run(child, 'cat /etc/resolv.conf');
      assert.notEqual(theirs, mine, 'the clone has a /30 of its own');
      assert.equal(await curl(child), 'hello from the host\n');
      assert.equal(await curl(sbx), 'hello from the host\n');
    } finally {
      await child.kill();
    }
  });

  test('microVMs keep their networks and policies through SIGKILL and SIGTERM of sandgate', { timeout: 900_000, skip: !ctl && 'needs the harness to restart sandgate' }, async () => {
    const deny = await Sandbox.create('base', { ...opts, timeoutMs: 900_000, network: { denyOut: [`${hostAddr}/32`] } });
    try {
      assert.equal(await curl(deny), 'exit 7');
      for (const kind of ['kill', 'term']) {
        await restartSandgate(remote, ctl, kind);
        // Taken back with its TAP, address and policy (from the database).
        const s = await Sandbox.connect(sbx.sandboxId, opts);
        assert.equal(await curl(s), 'hello from the host\n', `after ${kind}`);
        assert.equal(await udp(s), 'echo: hi\n', `after ${kind}`);
        const d = await Sandbox.connect(deny.sandboxId, opts);
        assert.equal(await curl(d), 'exit 7', `after ${kind}: denyOut still holds`);
      }
      // The new server manages the taken-back networks: a live update.
      const d = await Sandbox.connect(deny.sandboxId, opts);
      await d.updateNetwork({});
      assert.equal(await curl(d), 'hello from the host\n');
      const m = await (await fetch(`${remote}/metrics`)).text();
      assert.match(m, new RegExp(`^sandgate_sandbox_network_bytes_total\\{sandbox="${sbx.sandboxId}",direction="in"\\} [1-9]`, 'm'));
    } finally {
      await deny.kill().catch(() => {});
    }
  });
}
