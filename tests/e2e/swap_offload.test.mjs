// Offload to swap for process sandboxes (issue 25): the real sandgate
// binary with --memory-offload always makes a zram device and swaps on it;
// a sandbox waiting on a model (the mock upstream, a slow answer) is
// frozen and its memory goes out to the zram device; the cgroup's
// resident memory drops during the wait, and after it a background
// process's 64 MiB hash the same. Pages read back before a thaw and not
// touched go back out at the next offload. An idle sandbox (no traffic,
// no CPU) goes out too, as it runs. A sandbox killed while
// offloaded leaves nothing in the device. With --memory-offload off no device is made.
// The server runs with --swap-codec-audit: the engine's codecs see the
// same pages the device stores, and both figures are in /metrics.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync, readdirSync, existsSync, mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Sandbox } from 'e2b';
import { startSandgate } from './server.mjs';
import { startMockModelServer } from './fixtures/mock_model_server.mjs';

const KEY = 'sk-upstream-swap-0123456789';
let sg, mock, tmp;

before(async () => {
  tmp = mkdtempSync(join(tmpdir(), 'sg-swap-'));
  mock = await startMockModelServer({ apiKey: KEY });
  const keyFile = join(tmp, 'upstream.key');
  writeFileSync(keyFile, KEY + '\n', { mode: 0o600 });
  sg = await startSandgate([
    '--openai-base-url', mock.url, '--openai-key-file', keyFile,
    '--llm-grace-ms', '20', '--llm-cooldown-ms', '0',
    '--memory-offload', 'always', '--offload-min-wait-ms', '0', '--zram-mb', '1024',
    '--swap-codec-audit',
  ]);
});

after(async () => {
  if (sg) assert.deepEqual(await sg.stop(), { code: 0, signal: null }, 'sandgate stops cleanly');
  if (mock) await mock.close();
});

async function metrics() {
  const r = await fetch(sg.url + '/metrics');
  assert.equal(r.status, 200);
  const out = {};
  for (const line of (await r.text()).split('\n')) {
    const m = line.match(/^([a-z_]+(?:\{[^}]*\})?) ([0-9.e+-]+)$/);
    if (m) out[m[1]] = Number(m[2]);
  }
  return out;
}

// The sandbox's memory cgroup (v1) usage, page cache excluded.
function cgroupRss(id) {
  const dir = `/sys/fs/cgroup/memory/${sg.cgroupParent}/${id}`;
  const stat = readFileSync(join(dir, 'memory.stat'), 'utf8');
  const rss = Number(stat.match(/^total_rss (\d+)$/m)?.[1] ?? stat.match(/^rss (\d+)$/m)[1]);
  return rss;
}

// A process holding 64 MiB (half random, half text) and its hash.
const KEEPER = `
import hashlib, os, sys
blocks = [os.urandom(1 << 20) if i % 2 else (b"the agent keeps its notes here %d " % i) * 30000 for i in range(64)]
data = bytearray(b"".join(b[: 1 << 20].ljust(1 << 20, b"x") for b in blocks))
print(hashlib.sha256(data).hexdigest(), flush=True)
sys.stdin.readline()
print(hashlib.sha256(data).hexdigest(), flush=True)
`;

async function startKeeper(sbx) {
  await sbx.files.write('/home/user/keeper.py', KEEPER);
  let first = '';
  const h = await sbx.commands.run('python3 /home/user/keeper.py', {
    background: true, stdin: true, onStdout: (d) => { first += d; },
  });
  for (let i = 0; i < 600 && !first.includes('\n'); i++) await new Promise((r) => setTimeout(r, 50));
  assert.match(first.trim(), /^[0-9a-f]{64}$/);
  return { h, hash: first.trim() };
}

// A model call inside the sandbox that waits `ms` for its answer.
function slowCall(sbx, ms) {
  return sbx.commands.run(
    `curl -sS -H "Content-Type: application/json" -H "x-mock-latency-ms: ${ms}" ` +
      `--data '{"model":"mock-gpt","messages":[{"role":"user","content":"hi"}]}' "$OPENAI_BASE_URL/chat/completions"`,
    { timeoutMs: 60_000 },
  );
}

async function until(what, fn, ms = 20_000) {
  const end = Date.now() + ms;
  for (;;) {
    const v = await fn();
    if (v) return v;
    if (Date.now() > end) assert.fail(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

test('a wait-paused sandbox goes out to zram and comes back whole', async () => {
  const m0 = await metrics();
  assert.ok('sandgate_swap_used_bytes' in m0, 'the device is in /metrics');
  const sbx = await Sandbox.create('base', { ...sg.opts, timeoutMs: 300_000 });
  try {
    const keeper = await startKeeper(sbx);
    const before = cgroupRss(sbx.sandboxId);
    assert.ok(before > 64 << 20, `resident before: ${before}`);
    const call = slowCall(sbx, 6000);
    // Offloaded during the wait: pages out, resident memory down.
    const m1 = await until('the offload', async () => {
      const m = await metrics();
      return m.sandgate_swap_offloads_total > (m0.sandgate_swap_offloads_total ?? 0) ? m : null;
    });
    const during = cgroupRss(sbx.sandboxId);
    assert.ok(during < before / 4, `resident during the wait ${during} vs ${before} before`);
    const out = m1[`sandgate_sandbox_swap_out_pages{sandbox="${sbx.sandboxId}"}`];
    assert.ok(out * 4096 > 48 << 20, `pages out: ${out}`);
    assert.ok(m1.sandgate_swap_stored_bytes > 0 && m1.sandgate_swap_stored_bytes < m1.sandgate_swap_used_bytes,
      `stored ${m1.sandgate_swap_stored_bytes} of ${m1.sandgate_swap_used_bytes}`);
    console.log(`resident ${(before / 1048576).toFixed(1)} MiB before, ${(during / 1048576).toFixed(1)} MiB during the wait; ` +
      `${out} pages out, zram stores ${(m1.sandgate_swap_used_bytes / 1048576).toFixed(1)} MiB in ` +
      `${(m1.sandgate_swap_stored_bytes / 1048576).toFixed(1)} MiB`);
    // The audit read every page that went out, and the device's own count
    // of what it took in is the same pages.
    const audit = (codec) => m1[`sandgate_swap_audit_bytes{codec="${codec}"}`];
    assert.equal(m1.sandgate_swap_audit_page_outs_total, 1);
    assert.equal(m1.sandgate_swap_audit_pages_total + m1.sandgate_swap_audit_unread_pages_total, out,
      'the audit counts the pages that went out');
    assert.ok(m1.sandgate_swap_audit_unread_pages_total < out / 100, `unread: ${m1.sandgate_swap_audit_unread_pages_total}`);
    assert.equal(audit('raw'), m1.sandgate_swap_audit_pages_total * 4096);
    assert.ok(Math.abs(audit('device_uncompressed') - audit('raw')) < audit('raw') / 20,
      `device took in ${audit('device_uncompressed')} bytes, the audit read ${audit('raw')}`);
    // Half the keeper's data is random: neither side stores it in much less.
    for (const c of ['device', 'engine_plain', 'engine_cohort'])
      assert.ok(audit(c) > audit('raw') / 4 && audit(c) < audit('raw'), `${c}: ${audit(c)} of ${audit('raw')}`);
    console.log(`audit: ${(audit('raw') / 1048576).toFixed(1)} MiB read; device ${(audit('device') / 1048576).toFixed(1)}, ` +
      `engine plain ${(audit('engine_plain') / 1048576).toFixed(1)}, cohort ${(audit('engine_cohort') / 1048576).toFixed(1)} MiB`);
    const r = await call;
    assert.match(r.stdout, /chat\.completion/);
    // Whole after the wait.
    await sbx.commands.sendStdin(keeper.h.pid, 'go\n');
    const done = await keeper.h.wait();
    assert.equal(done.stdout.trim().split('\n')[1], keeper.hash, 'the 64 MiB hash the same after the wait');
    // The first resume reads nothing back: what was resident at the first
    // page-out is everything the sandbox ever touched, not what it uses.
    const m2 = await metrics();
    assert.equal(m2.sandgate_swap_in_pages_total, m0.sandgate_swap_in_pages_total ?? 0, 'nothing read back after the first wait');
    // Later waits read back what was resident at two page-outs in a row
    // (touched in both run periods: envd's, which ran the keeper to its end
    // and each call; the keeper's own pages went with it). At the second
    // nothing: the first page-out saw everything.
    let prev = m2;
    for (const [i, wantBack] of [[2, false], [3, true]]) {
      await slowCall(sbx, 3000);
      const m = await until(`resume ${i}`, async () => {
        const x = await metrics();
        return x.sandgate_swap_offloads_total > prev.sandgate_swap_offloads_total ? x : null;
      });
      assert.ok(m.sandgate_swap_out_pages_total > prev.sandgate_swap_out_pages_total);
      const back = m.sandgate_swap_in_pages_total - prev.sandgate_swap_in_pages_total;
      console.log(`wait ${i}: ${back} pages read back before the thaw`);
      if (wantBack) assert.ok(back > 0 && back < 4096, `wait ${i}: ${back} pages read back`);
      else assert.equal(back, 0, `wait ${i}: nothing read back`);
      prev = m;
    }
  } finally {
    await sbx.kill();
  }
});

// A process holding 16 MiB that writes every page of it on each "t" line.
const TOUCHER = `
import hashlib, sys
data = bytearray(b"".join(b"notes of the agent %d " % i for i in range(1 << 20))[: 16 << 20])
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() == "t":
        for p in range(0, len(data), 4096):
            data[p] = (data[p] + 1) % 256
        print("touched", flush=True)
    else:
        print(hashlib.sha256(data).hexdigest(), flush=True)
`;

// The sandbox's memory cgroup (v1): usage without page cache, as sandgate
// counts it. Pages in the swap cache are charged here and are not page cache.
function cgroupCharged(id) {
  const dir = `/sys/fs/cgroup/memory/${sg.cgroupParent}/${id}`;
  const usage = Number(readFileSync(join(dir, 'memory.usage_in_bytes'), 'utf8'));
  const cache = Number(readFileSync(join(dir, 'memory.stat'), 'utf8').match(/^total_cache (\d+)$/m)[1]);
  return usage - cache;
}

test('pages read back before a thaw and not touched go back out at the next offload', async () => {
  const sbx = await Sandbox.create('base', { ...sg.opts, timeoutMs: 300_000 });
  try {
    await sbx.files.write('/home/user/toucher.py', TOUCHER);
    let out = '';
    const h = await sbx.commands.run('python3 /home/user/toucher.py', {
      background: true, stdin: true, onStdout: (d) => { out += d; },
    });
    await until('the toucher', () => out.includes('ready\n'));
    const lines = () => out.split('\n').length;
    const ask = async (what) => {
      const n = lines();
      await sbx.commands.sendStdin(h.pid, what + '\n');
      await until(`the answer to ${what}`, () => lines() > n);
      return out.split('\n').at(-2);
    };
    // Waits 1 and 2 with the 16 MiB written before each: after wait 3 they
    // were resident at two page-outs in a row, so they are read back.
    let prev = await metrics();
    const wait = async (i) => {
      await slowCall(sbx, 2500);
      const m = await until(`offload ${i}`, async () => {
        const x = await metrics();
        return x.sandgate_swap_offloads_total > prev.sandgate_swap_offloads_total ? x : null;
      });
      prev = m;
      return m;
    };
    await wait(1);
    assert.equal(await ask('t'), 'touched');
    await wait(2);
    assert.equal(await ask('t'), 'touched');
    const hash = await ask('h');
    const before3 = prev;
    await wait(3);
    // Resumed with the 16 MiB read back (the read-back runs before the thaw,
    // so it is counted once the call has returned).
    const back = (await metrics()).sandgate_swap_in_pages_total - before3.sandgate_swap_in_pages_total;
    assert.ok(back >= 4000, `read back after wait 3: ${back} pages`);
    // Not touched this time: at the next offload they go back out, and the
    // sandbox's charge during that wait holds none of them.
    const before4 = prev;
    const call = slowCall(sbx, 4000);
    const m4 = await until('offload 4', async () => {
      const x = await metrics();
      return x.sandgate_swap_offloads_total > before4.sandgate_swap_offloads_total ? x : null;
    });
    const charged = cgroupCharged(sbx.sandboxId);
    const unused = m4.sandgate_swap_unused_pages_total - before4.sandgate_swap_unused_pages_total;
    console.log(`read back ${back} pages; ${unused} of them unused and put back; charged during wait 4: ` +
      `${(charged / 1048576).toFixed(1)} MiB`);
    assert.ok(unused >= 4000, `put back at offload 4: ${unused} pages`);
    assert.ok(charged < 8 << 20, `charged during wait 4: ${charged} bytes (the 16 MiB read back stayed?)`);
    await call;
    assert.equal(await ask('h'), hash, 'the 16 MiB the same after four waits');
  } finally {
    await sbx.kill();
  }
});

test('a sandbox killed while offloaded leaves nothing in the swap', async () => {
  const m0 = await metrics();
  const sbx = await Sandbox.create('base', { ...sg.opts, timeoutMs: 300_000 });
  const keeper = await startKeeper(sbx);
  const call = slowCall(sbx, 8000).catch(() => null);
  const m1 = await until('the offload', async () => {
    const m = await metrics();
    return m.sandgate_swap_offloads_total > m0.sandgate_swap_offloads_total ? m : null;
  });
  assert.ok(m1.sandgate_swap_used_bytes > 48 << 20, `in swap: ${m1.sandgate_swap_used_bytes}`);
  await sbx.kill();
  await call;
  void keeper;
  // Its swapped pages are freed with its processes.
  await until('the swap to empty', async () => (await metrics()).sandgate_swap_used_bytes < 4 << 20);
});

// A process that appends a line to a file twice a second: next to nothing
// of a CPU, but it runs only if the sandbox does.
const TICKER = `
import time
n = 0
while True:
    n += 1
    with open("/home/user/ticks", "a") as f:
        f.write("%d\\n" % n)
    time.sleep(0.5)
`;

test('an idle sandbox goes out to swap as it runs; its next command finds it whole', async () => {
  // A second server on the first one's device (--process-swap host): two
  // zram devices at one priority would share the pages between them.
  const idle = await startSandgate(['--memory-offload', 'always', '--process-swap', 'host',
    '--idle-offload-ms', '1500', '--tick-ms', '200']);
  try {
    const m = async () => {
      const text = await (await fetch(idle.url + '/metrics')).text();
      const out = {};
      for (const line of text.split('\n')) {
        const x = line.match(/^([a-z_]+(?:\{[^}]*\})?) ([0-9.e+-]+)$/);
        if (x) out[x[1]] = Number(x[2]);
      }
      return out;
    };
    const rss = (id) => {
      const stat = readFileSync(`/sys/fs/cgroup/memory/${idle.cgroupParent}/${id}/memory.stat`, 'utf8');
      return Number(stat.match(/^total_rss (\d+)$/m)[1]);
    };
    // A sandbox with no traffic either but a process using a CPU: it stays in.
    const busy = await Sandbox.create('base', { ...idle.opts, timeoutMs: 300_000 });
    await busy.commands.run('sh -c "while :; do :; done"', { background: true });
    const sbx = await Sandbox.create('base', { ...idle.opts, timeoutMs: 300_000 });
    try {
      assert.equal((await m()).sandgate_swap_idle_offloads_total, 0);
      const keeper = await startKeeper(sbx);
      await sbx.files.write('/home/user/ticker.py', TICKER);
      await sbx.commands.run('python3 /home/user/ticker.py', { background: true });
      const before = rss(sbx.sandboxId);
      assert.ok(before > 64 << 20, `resident before: ${before}`);
      // No traffic now: out after 1.5 s of it, while the ticker ticks on.
      const m1 = await until('the idle offload', async () => {
        const x = await m();
        return x.sandgate_swap_idle_offloads_total >= 1 ? x : null;
      });
      const during = rss(sbx.sandboxId);
      const out = m1[`sandgate_sandbox_swap_out_pages{sandbox="${sbx.sandboxId}"}`];
      console.log(`idle: resident ${(before / 1048576).toFixed(1)} MiB before, ${(during / 1048576).toFixed(1)} MiB ` +
        `after ${out} pages went out`);
      assert.ok(out * 4096 > 48 << 20, `pages out: ${out}`);
      assert.ok(during < before / 4, `resident while idle ${during} vs ${before} before`);
      assert.equal(m1.sandgate_swap_offloads_total, 0, 'no wait offload: nothing waited on a model');
      assert.equal(m1.sandgate_swap_idle_offloads_total, 1, 'the busy sandbox stayed in');
      assert.equal(m1[`sandgate_sandbox_swap_out_pages{sandbox="${busy.sandboxId}"}`] ?? 0, 0);
      // Not paused: the ticker went on writing while the sandbox was out.
      const tick = async () => Number((await sbx.files.read('/home/user/ticks')).trim().split('\n').at(-1));
      const t0 = await tick();
      await until('ticks while out', async () => (await tick()) >= t0 + 3);
      // The keeper's 64 MiB come back whole.
      await sbx.commands.sendStdin(keeper.h.pid, 'go\n');
      const done = await keeper.h.wait();
      assert.equal(done.stdout.trim().split('\n')[1], keeper.hash, 'the 64 MiB hash the same after the idle offload');
      const info = await (await fetch(`${idle.url}/sandboxes/${sbx.sandboxId}`, { headers: { 'X-API-KEY': idle.key } })).json();
      assert.equal(info.state, 'running');
    } finally {
      await sbx.kill();
      await busy.kill();
    }
  } finally {
    assert.deepEqual(await idle.stop(), { code: 0, signal: null });
  }
});

test("with --memory-offload off no swap device is made; the first server's device is in /proc/swaps", async () => {
  const off = await startSandgate(['--memory-offload', 'off']);
  try {
    const r = await fetch(off.url + '/metrics');
    const text = await r.text();
    assert.doesNotMatch(text, /sandgate_swap_/);
    assert.ok(!existsSync(join(off.dir, 'data', 'swap-device')));
  } finally {
    assert.deepEqual(await off.stop(), { code: 0, signal: null });
  }
  // The first server's device is listed in /proc/swaps; it goes at its stop.
  const rec = readFileSync(join(sg.dir, 'data', 'swap-device'), 'utf8').trim();
  assert.match(readFileSync('/proc/swaps', 'utf8'), new RegExp(`zram${rec}\\b`));
  void readdirSync;
});
