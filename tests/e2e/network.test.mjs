// Sandboxes' own networks (--network auto, the default: veth pairs on the
// process backend; docs/networking.md) as the unmodified official E2B JS
// SDK uses them. Two
// network namespaces stand in for what lies behind this host: "the
// internet" (198.51.100.2: HTTP, a UDP echo and the DNS server sandgate
// forwards to, which knows web.test and other.test) and a private network
// (192.168.214.2, the same servers). Nothing in a sandbox knows of a proxy:
// programs connect, resolve and send datagrams as on any machine.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { Sandbox, CommandExitError } from 'e2b';
import { startSandgate } from './server.mjs';
import { startNetwork } from './fixtures/netns.mjs';
import { execFileSync } from 'node:child_process';

let server, opts, inet, priv, open;

before(async () => {
  // many.test: 40 addresses, an answer past 512 bytes (truncated over UDP).
  const many = Array.from({ length: 40 }, (_, k) => `198.51.100.${100 + k}`).join(',');
  inet = await startNetwork('198.51.100', { 'web.test': '198.51.100.2', 'other.test': '198.51.100.2', 'many.test': many });
  priv = await startNetwork('192.168.214');
  // No --network: the default is what is tested.
  server = await startSandgate(['--dns-upstream', inet.addr]);
  opts = server.opts;
  open = await Sandbox.create('base', opts);
});

after(async () => {
  if (open) await open.kill().catch(() => {});
  if (server) await server.stop();
  for (const n of [inet, priv]) if (n) await n.stop();
});

// A command's stdout, or its exit code as "exit N" when it fails.
async function run(sbx, cmd, timeoutMs = 20000) {
  try {
    return (await sbx.commands.run(cmd, { timeoutMs })).stdout;
  } catch (e) {
    if (e instanceof CommandExitError) return `exit ${e.exitCode}`;
    throw e;
  }
}
const curl = (sbx, url) => run(sbx, `curl -sS --max-time 5 ${url} 2>/dev/null`);
const udp = (sbx, host) => run(sbx,
  `python3 -c "import socket;s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM);s.settimeout(3);` +
  `s.sendto(b'hi',('${host}',8081));print(s.recv(100).decode())"`);

// An ICMP echo as ping sends it without privileges (an ICMP datagram
// socket): "0 ping" is the echo reply's type and payload.
const icmp = (sbx, host) => run(sbx,
  `python3 -c "import socket;s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM,socket.IPPROTO_ICMP);s.settimeout(3);` +
  `s.sendto(b'\\x08\\x00\\x00\\x00\\x00\\x01\\x00\\x01ping',('${host}',0));r=s.recv(100);print(r[0],r[8:].decode())"`);

test('by default a sandbox is on the internet: names, TCP, UDP, no proxy anywhere', async () => {
  assert.equal(await run(open, 'echo "[$HTTP_PROXY$HTTPS_PROXY$http_proxy]"'), '[]\n');
  assert.match(await run(open, 'cat /etc/resolv.conf'), /^nameserver 10\.\d+\.\d+\.\d+$/m);
  // curl by name, through the sandbox's DNS server (sandgate's forwarder).
  assert.match(await curl(open, 'http://web.test:8080/'), /^hello from 198\.51\.100\.2, you are 198\.51\.100\.1\n$/);
  // Python's own HTTP client, and a program told to ignore any proxy.
  assert.match(await run(open, `python3 -c "import urllib.request;print(urllib.request.urlopen('http://other.test:8080/',timeout=5).read().decode(),end='')"`),
    /^hello from 198\.51\.100\.2/);
  assert.match(await curl(open, '--noproxy "*" http://198.51.100.2:8080/'), /^hello from/);
  assert.equal(await udp(open, 'web.test'), 'echo: hi\n');
  assert.match(await run(open, 'getent hosts missing.test || echo none'), /^none$/m);
  assert.equal(await icmp(open, '198.51.100.2'), '0 ping\n');
  // The path in use and the sandbox's traffic are on /metrics.
  const m = await (await fetch(`${server.url}/metrics`)).text();
  assert.match(m, /^sandgate_network_path\{path="veth"\} 1$/m);
  const inBytes = new RegExp(`^sandgate_sandbox_network_bytes_total\\{sandbox="${open.sandboxId}",direction="in"\\} (\\d+)$`, 'm').exec(m);
  assert.ok(inBytes && Number(inBytes[1]) > 0, m);
  assert.match(m, /^sandgate_dns_queries_total\{outcome="forwarded"\} [1-9]/m);
});

test('a long DNS answer: truncated over UDP, the resolver asks again over TCP', async () => {
  const got = await run(open, 'getent ahostsv4 many.test | cut -d" " -f1 | sort -u | wc -l');
  assert.equal(got.trim(), '40');
});

test('the host\'s networks, its metadata address, the gateway and other sandboxes are closed', async () => {
  assert.equal(await curl(open, 'http://192.168.214.2:8080/'), 'exit 7');
  assert.match(await udp(open, '192.168.214.2'), /^exit /);
  assert.equal(await curl(open, 'http://169.254.169.254/latest/meta-data/'), 'exit 7');
  // The gateway of the sandbox's link is the host: only its DNS answers there.
  const gw = (await run(open, "ip -4 route show default | cut -d' ' -f3")).trim();
  const port = new URL(server.url).port;
  assert.equal(await curl(open, `http://${gw}:${port}/health`), 'exit 7');
  const other = await Sandbox.create('base', opts);
  try {
    await other.commands.run('python3 -m http.server 8000 --bind 0.0.0.0', { background: true });
    const addr = (await run(other, "ip -4 -o addr show eth0 | awk '{print $4}' | cut -d/ -f1")).trim();
    assert.match(addr, /^10\.\d+\.\d+\.\d+$/);
    assert.notEqual(addr, (await run(open, "ip -4 -o addr show eth0 | awk '{print $4}' | cut -d/ -f1")).trim());
    await run(other, 'for i in $(seq 50); do curl -s -o /dev/null http://127.0.0.1:8000/ && break; sleep 0.1; done');
    assert.equal(await curl(open, `http://${addr}:8000/`), 'exit 7');
  } finally {
    await other.kill();
  }
});

test('allowInternetAccess false: nothing gets out, names do not resolve', async () => {
  const sbx = await Sandbox.create('base', { ...opts, allowInternetAccess: false });
  try {
    assert.equal(await curl(sbx, 'http://198.51.100.2:8080/'), 'exit 7');
    assert.match(await udp(sbx, '198.51.100.2'), /^exit /);
    assert.match(await icmp(sbx, '198.51.100.2'), /^exit /);
    assert.equal(await curl(sbx, 'http://web.test:8080/'), 'exit 6');  // could not resolve
  } finally {
    await sbx.kill();
  }
});

test('allowOut by name and by CIDR, denyOut, for TCP and UDP', async () => {
  const named = await Sandbox.create('base', { ...opts, allowInternetAccess: false, network: { allowOut: ['web.test'] } });
  const cidr = await Sandbox.create('base', { ...opts, allowInternetAccess: false, network: { allowOut: ['198.51.100.0/24'] } });
  const denied = await Sandbox.create('base', { ...opts, network: { denyOut: ['198.51.100.0/24'] } });
  try {
    // A name opens the addresses its DNS answer gave, only once resolved.
    assert.equal(await curl(named, 'http://198.51.100.2:8080/'), 'exit 7');
    assert.equal(await curl(named, 'http://other.test:8080/'), 'exit 6');
    assert.match(await curl(named, 'http://web.test:8080/'), /^hello from/);
    assert.equal(await udp(named, 'web.test'), 'echo: hi\n');
    assert.match(await curl(cidr, 'http://198.51.100.2:8080/'), /^hello from/);
    assert.equal(await udp(cidr, '198.51.100.2'), 'echo: hi\n');
    assert.equal(await curl(denied, 'http://web.test:8080/'), 'exit 7');
    assert.match(await udp(denied, 'web.test'), /^exit /);
  } finally {
    for (const s of [named, cidr, denied]) await s.kill();
  }
});

test('updateNetwork applies at once and cuts a running download', { timeout: 60000 }, async () => {
  const sbx = await Sandbox.create('base', opts);
  try {
    const dl = await sbx.commands.run('curl -sS -o /tmp/dl http://198.51.100.2:8080/stream', { background: true, timeoutMs: 0 });
    // The download is under way (bytes arriving) before the update.
    assert.equal(await run(sbx, 'for i in $(seq 100); do [ "$(stat -c %s /tmp/dl 2>/dev/null || echo 0)" -gt 200000 ] && echo going && break; sleep 0.1; done'), 'going\n');
    await sbx.updateNetwork({ allowInternetAccess: false });
    const err = await dl.wait().then(() => null, (e) => e);
    assert.ok(err instanceof CommandExitError, 'the download ended with an error');
    assert.equal(err.exitCode, 56, err.stderr);  // curl: failure receiving data (connection reset)
    assert.equal(await curl(sbx, 'http://198.51.100.2:8080/'), 'exit 7');
    await sbx.updateNetwork({});
    assert.match(await curl(sbx, 'http://198.51.100.2:8080/'), /^hello from/);
  } finally {
    await sbx.kill();
  }
});

test('sandboxes keep their networks and policies through a crash and a stop of sandgate', { timeout: 120000 }, async () => {
  // A second server beside the first (a range of its own), whose
  // sandboxes outlive it (--keep-sandboxes on).
  const kept = await startSandgate(['--dns-upstream', inet.addr], { keep: true });
  const boxes = [];
  try {
    const on = await Sandbox.create('base', kept.opts);
    const off = await Sandbox.create('base', { ...kept.opts, allowInternetAccess: false });
    boxes.push(on, off);
    const addr = (sbx) => run(sbx, "ip -4 -o addr show eth0 | awk '{print $4}'");
    const onAddr = await addr(on);
    assert.match(onAddr, /^10\.\d+\.\d+\.\d+\/30\n$/);
    assert.notEqual(onAddr, await addr(open), 'two servers, two ranges');
    for (const sig of ['SIGKILL', 'SIGTERM']) {
      await kept.signal(sig);
      await kept.restart();
      const on2 = await Sandbox.connect(on.sandboxId, kept.opts);
      const off2 = await Sandbox.connect(off.sandboxId, kept.opts);
      assert.equal(await addr(on2), onAddr, `after ${sig}: the same address`);
      // Names through the new server's DNS forwarder, the policy as it was.
      assert.match(await curl(on2, 'http://web.test:8080/'), /^hello from 198\.51\.100\.2/, `after ${sig}`);
      assert.equal(await curl(off2, 'http://198.51.100.2:8080/'), 'exit 7', `after ${sig}`);
      assert.equal(await curl(on2, 'http://192.168.214.2:8080/'), 'exit 7', `after ${sig}`);
      // The taken-back sandbox's policy is live again, and counted.
      await on2.updateNetwork({ allowInternetAccess: false });
      assert.equal(await curl(on2, 'http://198.51.100.2:8080/'), 'exit 7', `after ${sig}`);
      await on2.updateNetwork({});
      assert.match(await curl(on2, 'http://198.51.100.2:8080/'), /^hello from/, `after ${sig}`);
      const m = await (await fetch(`${kept.url}/metrics`)).text();
      assert.match(m, new RegExp(`^sandgate_sandbox_network_bytes_total\\{sandbox="${on.sandboxId}",direction="in"\\} [1-9]`, 'm'));
      // A new sandbox beside them gets an address of its own.
      const fresh = await Sandbox.create('base', kept.opts);
      boxes.push(fresh);
      const freshAddr = await addr(fresh);
      assert.notEqual(freshAddr, onAddr);
      assert.match(await curl(fresh, 'http://web.test:8080/'), /^hello from/);
    }
  } finally {
    for (const b of boxes) await Sandbox.kill(b.sandboxId, kept.opts).catch(() => {});
    await kept.stop();
  }
});

test('auto takes the egress proxy where sandboxes cannot have networks of their own', { timeout: 60000 }, async () => {
  // A host whose routes cover all of 10.192.0.0/10 (a VPN, say), so no
  // range is free for sandboxes: sandgate runs in a namespace of its own
  // with such a route, reached from here over a veth.
  const host = await startNetwork('203.0.113');
  let s;
  try {
    execFileSync('ip', ['-n', host.ns, 'route', 'add', 'unreachable', '10.192.0.0/10']);
    s = await startSandgate(['--listen', `${host.addr}:0`], { wrap: ['nsenter', `--net=/run/netns/${host.ns}`] });
    const m = await (await fetch(`${s.url}/metrics`)).text();
    assert.match(m, /^sandgate_network_path\{path="proxy"\} 1$/m);
    const sbx = await Sandbox.create('base', s.opts);
    try {
      assert.match(await run(sbx, 'echo "$HTTP_PROXY"'), /^http:\/\/127\.0\.0\.1:49984\/?\n$/);
      assert.equal(await run(sbx, 'ls /sys/class/net'), 'lo\n');
    } finally {
      await sbx.kill();
    }
  } finally {
    if (s) await s.stop();
    await host.stop();
  }
});
