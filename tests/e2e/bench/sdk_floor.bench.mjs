// The SDK's own floor for commands.run('true'): the same calls against a
// canned in-process server that answers Start instantly, so the difference
// to commands.bench.mjs is what sandgate and the sandbox cost.
import http from 'node:http';
import { Sandbox } from 'e2b';

const env = (flags, obj) => { const p = Buffer.from(JSON.stringify(obj)); const h = Buffer.alloc(5); h[0] = flags; h.writeUInt32BE(p.length, 1); return Buffer.concat([h, p]); };
const canned = Buffer.concat([env(0, { event: { start: { pid: 7 } } }), env(0, { event: { end: { exited: true, status: 'exit status 0' } } }), env(2, {})]);
const srv = http.createServer((req, res) => {
  req.resume();
  req.on('end', () => {
    if (req.url.startsWith('/v2/sandboxes')) {
      res.writeHead(201, { 'content-type': 'application/json' });
      res.end(JSON.stringify({ sandboxID: 'floorfloorfloorfloor', templateID: 't', clientID: 'c', envdVersion: '0.6.13', envdAccessToken: 'x' }));
    } else {
      res.writeHead(200, { 'content-type': 'application/connect+json' });
      res.end(canned);
    }
  });
});
await new Promise((r) => srv.listen(0, '127.0.0.1', r));
const url = `http://127.0.0.1:${srv.address().port}`;
const sbx = await Sandbox.create('base', { apiUrl: url, sandboxUrl: url, apiKey: 'e2b_' + '0'.repeat(40) });
for (let i = 0; i < 20; i++) await sbx.commands.run('true');
const lat = [];
for (let i = 0; i < 300; i++) { const t = performance.now(); await sbx.commands.run('true'); lat.push(performance.now() - t); }
lat.sort((a, b) => a - b);
console.log(`SDK floor for commands.run('true') (canned server): p50 ${lat[150].toFixed(2)} ms, p99 ${lat[296].toFixed(2)} ms`);
srv.close();
