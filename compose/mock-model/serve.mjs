// The mock model upstream of compose/mock-model.yaml: the test fixture
// tests/e2e/fixtures/mock_model_server.mjs (OpenAI and Anthropic shapes,
// streaming, usage; knobs in x-mock-* headers) behind a fixed address.
// The fixture listens only on 127.0.0.1 and an ephemeral port, and stays as
// the tests use it, so this wrapper relays TCP connections from
// MOCK_MODEL_HOST:MOCK_MODEL_PORT (default 0.0.0.0:8080, where other
// containers reach it) to it byte for byte. The mock's own behaviour,
// including a deliberately broken-off response, passes through unchanged.
//
// Environment: MOCK_MODEL_HOST, MOCK_MODEL_PORT (0: any free port; the
// bound one is printed), MOCK_MODEL_KEY_FILE (the provider key the mock
// accepts, the file sandgate's --openai-key-file/--anthropic-key-file read;
// default "sk-mock").
import net from 'node:net';
import { readFileSync } from 'node:fs';
import { startMockModelServer } from '../../tests/e2e/fixtures/mock_model_server.mjs';

const host = process.env.MOCK_MODEL_HOST || '0.0.0.0';
const port = Number(process.env.MOCK_MODEL_PORT ?? 8080);
const keyFile = process.env.MOCK_MODEL_KEY_FILE;
const apiKey = keyFile ? readFileSync(keyFile, 'utf8').trim() : 'sk-mock';
if (!Number.isInteger(port) || port < 0 || port > 65535) {
  console.error(`mock-model: MOCK_MODEL_PORT=${process.env.MOCK_MODEL_PORT} is not a port number`);
  process.exit(2);
}
if (!apiKey) {
  console.error(`mock-model: ${keyFile} is empty: write the provider key into it`);
  process.exit(2);
}

const mock = await startMockModelServer({ apiKey });

// pipe() forwards each side's end to the other, so a response is flushed
// before its connection closes; an error on either side resets both.
const relay = net.createServer({ allowHalfOpen: true }, (client) => {
  const upstream = net.connect({ host: '127.0.0.1', port: mock.port, allowHalfOpen: true });
  const reset = () => {
    client.destroy();
    upstream.destroy();
  };
  client.on('error', reset);
  upstream.on('error', reset);
  client.pipe(upstream);
  upstream.pipe(client);
});
relay.on('error', (err) => {
  console.error(`mock-model: listen on ${host}:${port}: ${err.message}`);
  process.exit(1);
});
relay.listen(port, host, () => {
  const bound = relay.address();
  console.log(
    `mock-model: listening on http://${host}:${bound.port} (OpenAI and Anthropic routes; ` +
      `provider key from ${keyFile ?? 'the default "sk-mock"'}; models mock-gpt, mock-claude)`,
  );
});

// PID 1 in a container gets no default SIGTERM action; nothing here needs
// flushing, so stop at once.
for (const sig of ['SIGTERM', 'SIGINT']) process.on(sig, () => process.exit(0));
