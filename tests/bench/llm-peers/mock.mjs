// The shared mock upstream for bench.mjs, in a process of its own so that it
// does not share an event loop with the load generator. It hosts the unchanged
// tests/e2e/fixtures/mock_model_server.mjs and lets the parent set the model
// latency per phase over IPC ({ latencyMs } -> { ok: true }): the latency is
// applied as the mock's own `x-mock-latency-ms` knob, filled in on arrival,
// because not every proxy under test forwards a client's custom headers.
// The mock's request log is emptied every second so a long run does not grow it.
import http from 'node:http';

let latencyMs = 0;
const createServer = http.createServer;
http.createServer = (handler) =>
  createServer((req, res) => {
    if (latencyMs > 0 && req.headers['x-mock-latency-ms'] === undefined) {
      req.headers['x-mock-latency-ms'] = String(latencyMs);
    }
    handler(req, res);
  });

const { startMockModelServer } = await import('../../e2e/fixtures/mock_model_server.mjs');
const mock = await startMockModelServer({ apiKey: process.env.MOCK_API_KEY || 'sk-mock' });
setInterval(() => { mock.requests.length = 0; }, 1000).unref();
process.on('message', (msg) => {
  if (typeof msg?.latencyMs === 'number') latencyMs = msg.latencyMs;
  process.send({ ok: true, latencyMs });
});
process.on('disconnect', () => process.exit(0));
process.send({ port: mock.port });
