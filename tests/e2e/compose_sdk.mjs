// The E2B JS SDK against a sandgate running in a container (run by
// tests/compose/podman_test.py; not a test file of its own). Arguments:
// the API URL, the key and, optionally, "disk-limited" (the sandbox's
// writable layer must be its own size-limited disk). Exits non-zero, with the reason, on any failure.
//
// The subset of the e2e cases that shows the container works as a server:
// create with metadata, list, commands (output, exit code, a background
// process), its own network, files both ways, pause and resume (connect),
// kill.
import assert from 'node:assert/strict';
import { Sandbox, SandboxNotFoundError } from 'e2b';

const [url, apiKey, expect] = process.argv.slice(2);
if (!url || !apiKey || (expect && expect !== 'disk-limited')) {
  console.error('usage: compose_sdk.mjs API_URL API_KEY [disk-limited]');
  process.exit(2);
}
const opts = { apiUrl: url, sandboxUrl: url, apiKey, requestTimeoutMs: 60_000 };

const sbx = await Sandbox.create('base', { ...opts, metadata: { suite: 'compose' } });
try {
  const listed = await Sandbox.list({ ...opts, query: { metadata: { suite: 'compose' } } }).nextItems();
  assert.deepEqual(listed.map((s) => s.sandboxId), [sbx.sandboxId]);

  const hi = await sbx.commands.run('echo hi from $(hostname) && id -un');
  assert.equal(hi.exitCode, 0);
  assert.match(hi.stdout, /^hi from .+\nuser\n$/);
  await assert.rejects(sbx.commands.run('exit 3'), (e) => e.exitCode === 3);

  // A network of its own (--network auto in the container): its address
  // and default route (read without iproute2, which the template may
  // lack), no proxy variables; the host (the container) answers it only
  // for DNS, so the API port is closed to it.
  const net = await sbx.commands.run('python3 -c "import socket,struct,os\n' +
    "r=[l.split() for l in open('/proc/net/route')][1:]\n" +
    "g=socket.inet_ntoa(struct.pack('<L',int([x for x in r if x[1]=='00000000'][0][2],16)))\n" +
    's=socket.socket(socket.AF_INET,socket.SOCK_DGRAM);s.connect((g,53))\n' +
    "print(s.getsockname()[0],g,'['+os.environ.get('HTTP_PROXY','')+']')\n" +
    "c=socket.socket();c.settimeout(5)\n" +
    "print(c.connect_ex((g,3000)))\"");
  const [addr, gw, proxy] = net.stdout.split('\n')[0].split(' ');
  assert.match(addr, /^10\.\d+\.\d+\.\d+$/, net.stdout);
  assert.match(gw, /^10\.\d+\.\d+\.\d+$/, net.stdout);
  assert.equal(proxy, '[]', net.stdout);
  assert.equal(net.stdout.split('\n')[1], '111', `the API port from the sandbox: ${net.stdout}`);  // ECONNREFUSED
  const bg = await sbx.commands.run('sleep 300', { background: true });
  assert.ok(bg.pid > 0);

  await sbx.files.write('/home/user/in.txt', 'written through the SDK');
  assert.equal(await sbx.files.read('/home/user/in.txt'), 'written through the SDK');
  await sbx.commands.run('seq 1 1000 > /home/user/out.txt');
  assert.equal((await sbx.files.read('/home/user/out.txt')).split('\n').length, 1001);
  const entries = await sbx.files.list('/home/user');
  const names = entries.map((e) => e.name);
  assert.ok(names.includes('in.txt') && names.includes('out.txt'), names.join(' '));

  if (expect === 'disk-limited') {
    // The writable layer is the sandbox's own ext4 disk (1024 MiB by
    // default), not the volume's file system.
    const df = await sbx.commands.run('df -Pm / | tail -1');
    const mb = Number(df.stdout.trim().split(/\s+/)[1]);
    assert.ok(mb > 500 && mb <= 1024, `the sandbox's disk is ${mb} MiB: ${df.stdout}`);
  }

  assert.equal(await sbx.pause(), true);
  assert.equal((await sbx.getInfo()).state, 'paused');
  const again = await Sandbox.connect(sbx.sandboxId, opts);
  assert.equal((await again.getInfo()).state, 'running');
  assert.equal(await again.files.read('/home/user/in.txt'), 'written through the SDK');
  const ps = await again.commands.run('ps -e -o comm=');
  assert.match(ps.stdout, /^sleep$/m, 'the background process lives on after the pause');
} finally {
  await Sandbox.kill(sbx.sandboxId, opts);
}
await assert.rejects(Sandbox.connect(sbx.sandboxId, opts), SandboxNotFoundError);
console.log(`compose_sdk: ok (${sbx.sandboxId})`);
