// Benchmark: egress from inside a process sandbox, through the agent's
// forwarder, the channel and the gateway's egress proxy, to an HTTP origin
// on this host (127.0.0.2; sandgate runs with --egress
// --egress-allow-private). curl inside the sandbox, timed by curl itself:
// 200 small requests (time to the first byte, p50/p99, plain and through a
// CONNECT tunnel) and one 256 MiB download; the same curl run on the host
// straight to the origin is the baseline.
// Usage (scripts/bench.sh): SANDGATE_BIN=... SANDGATE_TESTS_TEMPLATES_DIR=... node egress.bench.mjs OUT.json
import { writeFileSync } from 'node:fs';
import { execFile } from 'node:child_process';
import { promisify } from 'node:util';
import { cpus, release } from 'node:os';
import http from 'node:http';
import { Sandbox } from 'e2b';
import { startSandgate } from '../server.mjs';

const out = process.argv[2] ?? 'egress.json';
const pct = (v, p) => { const s = [...v].sort((a, b) => a - b); return s[Math.min(s.length - 1, Math.ceil(p / 100 * s.length) - 1)]; };
const big = Buffer.alloc(1 << 20, 120);
const origin = http.createServer((req, res) => {
  if (req.url !== '/big') return res.end('ok');
  res.setHeader('content-length', String(256 << 20));
  let left = 256;
  const more = () => { while (left > 0) { left--; if (!res.write(big)) return res.once('drain', more); } res.end(); };
  more();
});
await new Promise((r) => origin.listen(0, '127.0.0.2', r));
const url = `http://127.0.0.2:${origin.address().port}`;
const server = await startSandgate(['--egress', '--egress-allow-private', '--rate', '0', '--create-rate', '0']);
const fmt = "'%{time_starttransfer} %{speed_download}\\n'";
// Not execFileSync: the origin is served by this process's event loop.
const sh = async (cmd) => (await promisify(execFile)('sh', ['-c', cmd], { maxBuffer: 1 << 20 })).stdout;
const parse = (text) => text.trim().split('\n').map((l) => l.split(' ').map(Number));
try {
  const sbx = await Sandbox.create('base', { ...server.opts, allowInternetAccess: false, network: { allowOut: ['127.0.0.2'] } });
  const loop = (flags) => `for i in $(seq 200); do curl -s -o /dev/null ${flags} -w ${fmt} ${url}/small; done`;
  const inside = async (flags) => parse((await sbx.commands.run(loop(flags), { timeoutMs: 300_000 })).stdout).map((r) => r[0] * 1000);
  const plain = await inside('');
  const tunnel = await inside('--proxytunnel');
  const host = parse(await sh(loop('--noproxy "*"'))).map((r) => r[0] * 1000);
  const dl = parse((await sbx.commands.run(`curl -s -o /dev/null -w ${fmt} ${url}/big`, { timeoutMs: 300_000 })).stdout)[0][1];
  const dlHost = parse(await sh(`curl -s -o /dev/null --noproxy '*' -w ${fmt} ${url}/big`))[0][1];
  await sbx.kill();
  const ms = (v) => ({ p50: pct(v, 50), p99: pct(v, 99) });
  const report = {
    machine: { cpu: cpus()[0].model, cores: cpus().length, kernel: release() },
    first_byte_ms: { host_direct: ms(host), sandbox_plain_http: ms(plain), sandbox_connect_tunnel: ms(tunnel) },
    download_256mib_mib_s: { host_direct: dlHost / (1 << 20), sandbox: dl / (1 << 20) },
  };
  writeFileSync(out, JSON.stringify(report, null, 2) + '\n');
  console.log(JSON.stringify(report, null, 2));
} finally {
  await server.stop();
  origin.close();
}
