// The unmodified official E2B JS SDK against sandgate's KVM runtime: create,
// commands, files, pause (to disk) and resume with Sandbox.connect (a file
// and a running background process survive), kill, list; a template built with
// Template.build() (steps in process sandboxes) booting as a microVM with
// its start command.
//
// Two ways to run it:
// - harness mode (tests/kvm-harness/harness.sh, CTest kvm_harness_e2e): the
//   server runs inside a QEMU TCG guest; SANDGATE_E2E_URL and
//   SANDGATE_E2E_KEY point at its forwarded port;
// - direct mode (CTest e2e_js_kvm_direct): starts sandgate here with
//   --runtime=kvm through server.mjs (SANDGATE_BIN,
//   SANDGATE_TESTS_TEMPLATES_DIR, optional SANDGATE_GUEST_DIR). Where
//   /dev/kvm is unusable or the kvm runtime is not built (no sandgate-vmm
//   beside sandgate, or no --guest-dir in its --help) it skips: exit 77 when
//   run as `node kvm.test.mjs` (CTest's SKIP_RETURN_CODE), a skipped test
//   under `node --test`.
// Timeouts are generous: under TCG everything is ~50x slower than on
// hardware.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { accessSync, constants } from 'node:fs';
import { spawnSync } from 'node:child_process';
import { dirname, join } from 'node:path';
import { counterAdvances, startCounter } from './kvm_common.mjs';
import { Sandbox, SandboxNotFoundError, Template, waitForPort } from 'e2b';
import { startSandgate } from './server.mjs';

const STEP = { timeout: 240_000 };
const remote = process.env.SANDGATE_E2E_URL;

function directSkipReason() {
  try {
    accessSync('/dev/kvm', constants.R_OK | constants.W_OK);
  } catch (e) {
    return `/dev/kvm is not usable here (${e.code}); tests/kvm-harness/harness.sh runs these cases inside a QEMU TCG guest`;
  }
  const bin = process.env.SANDGATE_BIN;
  if (!bin) return null; // startSandgate names what is missing
  // sandgate's own verdict: /dev/kvm may exist and still not run stock
  // guests (PVM, for one).
  const check = spawnSync(bin, ['kvm', 'check'], { encoding: 'utf8' });
  if (check.status === 1) return `${check.stdout.trim()}; tests/kvm-harness/harness.sh runs these cases inside a QEMU TCG guest`;
  const vmm = join(dirname(bin), 'sandgate-vmm');
  try {
    accessSync(vmm, constants.X_OK);
  } catch {
    return `${vmm} is not built: the kvm runtime is not in this build`;
  }
  const help = spawnSync(bin, ['--help'], { encoding: 'utf8' });
  if (!`${help.stdout}${help.stderr}`.includes('--guest-dir'))
    return `${bin} --help lists no --guest-dir: the kvm runtime is not wired into this build`;
  return null;
}

const skip = remote ? null : directSkipReason();
if (skip && !process.env.NODE_TEST_CONTEXT) {
  console.log(`SKIP kvm e2e (direct mode): ${skip}`);
  process.exit(77);
}

let server, opts, sbx, counterPid;

if (skip) {
  test('kvm e2e (direct mode)', { skip }, () => {});
} else {
  before(async () => {
    if (remote) {
      opts = { apiUrl: remote, sandboxUrl: remote, apiKey: process.env.SANDGATE_E2E_KEY };
    } else {
      const guest = process.env.SANDGATE_GUEST_DIR;
      server = await startSandgate(['--runtime=kvm', ...(guest ? ['--guest-dir', guest] : [])]);
      opts = server.opts;
    }
    opts = { ...opts, requestTimeoutMs: 120_000 };
  });

  after(async () => {
    if (sbx) await sbx.kill().catch(() => {});
    if (server) await server.stop();
  });

  test('create a sandbox and run a command', STEP, async () => {
    sbx = await Sandbox.create('base', { ...opts, timeoutMs: 900_000 });
    assert.match(sbx.sandboxId, /^[a-z0-9]{20}$/);
    assert.equal((await sbx.getInfo()).state, 'running');
    const r = await sbx.commands.run('echo hi', { timeoutMs: 120_000 });
    assert.equal(r.stdout, 'hi\n');
    assert.equal(r.exitCode, 0);
  });

  test('write a file and read it back', STEP, async () => {
    const body = 'kvm harness\n' + 'x'.repeat(64 * 1024) + '\n';
    await sbx.files.write('/home/user/state.txt', body);
    assert.equal(await sbx.files.read('/home/user/state.txt'), body);
    const r = await sbx.commands.run('wc -c < /home/user/state.txt');
    assert.equal(r.stdout.trim(), String(Buffer.byteLength(body)));
  });

  test('a background process runs', STEP, async () => {
    counterPid = await startCounter(sbx);
    assert.ok(counterPid > 0);
    await counterAdvances(sbx);
  });

  test('pause, then resume with Sandbox.connect: state survives', STEP, async () => {
    assert.equal(await sbx.pause(), true);
    assert.equal((await sbx.getInfo()).state, 'paused');
    const paused = await Sandbox.list({ ...opts, query: { state: ['paused'] } }).nextItems();
    assert.ok(paused.some((s) => s.sandboxId === sbx.sandboxId), 'list shows it paused');

    const again = await Sandbox.connect(sbx.sandboxId, opts);
    assert.equal(again.sandboxId, sbx.sandboxId);
    assert.equal((await again.getInfo()).state, 'running');
    assert.equal(await again.files.read('/home/user/state.txt').then((t) => t.slice(0, 12)), 'kvm harness\n');
    const procs = await again.commands.list();
    assert.ok(procs.some((p) => p.pid === counterPid), `pid ${counterPid} is still listed after resume`);
    await counterAdvances(again);
    assert.equal((await again.commands.run('echo after resume')).stdout, 'after resume\n');
    sbx = again;
  });

  test('kill, and list shows it gone', STEP, async () => {
    const id = sbx.sandboxId;
    assert.equal(await sbx.kill(), true);
    sbx = null;
    const left = await Sandbox.list(opts).nextItems();
    assert.ok(!left.some((s) => s.sandboxId === id), 'killed sandbox not listed');
    await assert.rejects(Sandbox.getInfo(id, opts), SandboxNotFoundError);
  });

  // The build's steps run in process sandboxes; before the build is ready
  // the kvm backend merges its layers into an ext4 image, boots it, runs the
  // start command until the ready command passes, and snapshots it so:
  // every sandbox of the template is a clone with the server already up.
  test('a template built here boots as a microVM with its files and its start command already running', { timeout: 420_000 }, async () => {
    const logs = [];
    const tpl = Template().fromTemplate('base')
      .runCmd('echo made by a step > /etc/sg-built && mkdir -p /srv/www && echo served > /srv/www/index.html',
        { user: 'root' })
      .setStartCmd('cat /proc/sys/kernel/random/uuid > /tmp/started-once; ' +
        'exec python3 -m http.server 8000 --bind 127.0.0.1 --directory /srv/www', waitForPort(8000));
    await Template.build(tpl, 'kvm-built', { ...opts, cpuCount: 2, memoryMB: 512,
      onBuildLogs: (l) => logs.push(String(l.message ?? l)) });
    assert.ok(logs.some((l) => l.includes('Preparing the template for microVMs')), logs.join('\n'));
    const started = [];
    for (const env of [{ WHO: 'first' }, { WHO: 'second' }]) {
      const s = await Sandbox.create('kvm-built', { ...opts, timeoutMs: 300_000, envs: env });
      try {
        assert.equal(await s.files.read('/etc/sg-built'), 'made by a step\n');
        // The server answers: it came up in the template, before the snapshot.
        const r = await s.commands.run('curl -s http://127.0.0.1:8000/index.html', { timeoutMs: 120_000 });
        assert.equal(r.stdout, 'served\n');
        // Each clone has its own token (the SDK's) and environment.
        assert.equal((await s.commands.run('echo $WHO', { timeoutMs: 120_000 })).stdout, env.WHO + '\n');
        // A microVM: the guest image's kernel command line, not the host's.
        const cmdline = await s.commands.run('cat /proc/cmdline', { timeoutMs: 120_000 });
        assert.match(cmdline.stdout, /sandgate\.hostname=sandbox/);
        started.push(await s.files.read('/tmp/started-once'));
      } finally {
        await s.kill().catch(() => {});
      }
    }
    // The start command ran once, in the template, not at each create.
    assert.match(started[0], /^[0-9a-f-]{36}\n$/);
    assert.equal(started[1], started[0]);
  });
}
