// Benchmark: sandboxes' own networks (--network veth) against the egress
// proxy (--network proxy) and the host itself, to one local server: a Node
// HTTP origin in a network namespace that stands in for the internet
// (198.51.100.2, behind the host like any destination). curl, timed by
// curl itself: 200 small requests (connect and first-byte times, p50/p99)
// and one 256 MiB download, from a veth sandbox, a proxy sandbox and the
// host; then sandbox create latency (30 creates, SDK create to ready) with
// and without a network of its own.
// Usage (scripts/bench.sh): SANDGATE_BIN=... SANDGATE_TESTS_TEMPLATES_DIR=... node network.bench.mjs OUT.json
import { writeFileSync } from 'node:fs';
import { execFile, spawn } from 'node:child_process';
import { promisify } from 'node:util';
import { cpus, release } from 'node:os';
import { Sandbox } from 'e2b';
import { startSandgate } from '../server.mjs';
import { startNetwork } from '../fixtures/netns.mjs';

const out = process.argv[2] ?? 'network.json';
const pct = (v, p) => { const s = [...v].sort((a, b) => a - b); return s[Math.min(s.length - 1, Math.ceil(p / 100 * s.length) - 1)]; };
const ms = (v) => ({ p50: +pct(v, 50).toFixed(3), p99: +pct(v, 99).toFixed(3) });
const sh = async (cmd) => (await promisify(execFile)('sh', ['-c', cmd], { maxBuffer: 1 << 20 })).stdout;

const inet = await startNetwork('198.51.100');
// A fast origin on port 9090 in that namespace (net_servers.py's is for tests).
const originJs = `const h=require('http');const big=Buffer.alloc(1<<20,120);
h.createServer((q,r)=>{if(q.url!=='/big')return r.end('ok');r.setHeader('content-length',String(256<<20));let n=256;
const m=()=>{while(n>0){n--;if(!r.write(big))return r.once('drain',m);}r.end();};m();}).listen(9090,'198.51.100.2',()=>console.log('ready'));`;
const origin = spawn('ip', ['netns', 'exec', inet.ns, process.execPath, '-e', originJs], { stdio: ['ignore', 'pipe', 'inherit'] });
await new Promise((r) => origin.stdout.once('data', r));
const url = 'http://198.51.100.2:9090';
const fmt = "'%{time_connect} %{time_starttransfer} %{speed_download}\\n'";
const parse = (text) => text.trim().split('\n').map((l) => l.split(' ').map(Number));
const loop = (flags) => `for i in $(seq 200); do curl -s -o /dev/null ${flags} -w ${fmt} ${url}/small; done`;

async function measure(sbx, flags) {
  const small = parse((await sbx.commands.run(loop(flags), { timeoutMs: 300_000 })).stdout);
  const big = parse((await sbx.commands.run(`curl -s -o /dev/null ${flags} -w ${fmt} ${url}/big`, { timeoutMs: 300_000 })).stdout)[0];
  return { connect_ms: ms(small.map((r) => r[0] * 1000)), first_byte_ms: ms(small.map((r) => r[1] * 1000)),
    download_256mib_mib_s: +(big[2] / (1 << 20)).toFixed(1) };
}

async function creates(server, n = 30) {
  const t = [];
  for (let i = 0; i < n; i++) {
    const t0 = performance.now();
    const s = await Sandbox.create('base', server.opts);
    t.push(performance.now() - t0);
    await s.kill();
  }
  return ms(t);
}

const report = { machine: { cpu: cpus()[0].model, cores: cpus().length, kernel: release() } };
try {
  const hostSmall = parse(await sh(loop('--noproxy "*"')));
  const hostBig = parse(await sh(`curl -s -o /dev/null --noproxy '*' -w ${fmt} ${url}/big`))[0];
  report.host_direct = { connect_ms: ms(hostSmall.map((r) => r[0] * 1000)), first_byte_ms: ms(hostSmall.map((r) => r[1] * 1000)),
    download_256mib_mib_s: +(hostBig[2] / (1 << 20)).toFixed(1) };
  // The warm pool is off so that every create pays for its network.
  const common = ['--rate', '0', '--create-rate', '0', '--warm-pool', '0'];
  // Unlimited for the path's own throughput; then the default limit
  // (1000 Mbit/s: its first second passes at full speed, then the rate).
  const veth = await startSandgate(['--network', 'veth', '--sandbox-bandwidth-mbit', '0', ...common]);
  try {
    const sbx = await Sandbox.create('base', veth.opts);
    report.sandbox_veth = await measure(sbx, '');
    await sbx.kill();
    report.create_ms_veth = await creates(veth);
  } finally {
    await veth.stop();
  }
  const limited = await startSandgate(['--network', 'veth', ...common]);
  try {
    const sbx = await Sandbox.create('base', limited.opts);
    const big = parse((await sbx.commands.run(`curl -s -o /dev/null -w ${fmt} ${url}/big`, { timeoutMs: 300_000 })).stdout)[0];
    report.sandbox_veth_default_limit_download_256mib_mib_s = +(big[2] / (1 << 20)).toFixed(1);
    await sbx.kill();
  } finally {
    await limited.stop();
  }
  const proxy = await startSandgate(['--network', 'proxy', ...common]);
  try {
    const sbx = await Sandbox.create('base', proxy.opts);
    report.sandbox_egress_proxy = await measure(sbx, '');
    await sbx.kill();
  } finally {
    await proxy.stop();
  }
  const off = await startSandgate(['--network', 'off', ...common]);
  try {
    report.create_ms_no_network = await creates(off);
  } finally {
    await off.stop();
  }
  writeFileSync(out, JSON.stringify(report, null, 2) + '\n');
  console.log(JSON.stringify(report, null, 2));
} finally {
  origin.kill('SIGKILL');
  await inet.stop();
}
