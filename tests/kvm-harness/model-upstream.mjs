// The model upstream of tests/kvm-harness/harness.sh: the mock model server
// (tests/e2e/fixtures/mock_model_server.mjs) on the host, for the outer
// guest's sandgate to proxy to. QEMU's user network takes the guest's
// connections to 10.0.2.2 to the host's 127.0.0.1, where the mock listens.
// It runs as the harness's child rather than inside a test file because
// `sandgate serve`'s upstream flags are fixed when the guest boots, before
// any test file starts: the harness needs the port first, and a port this
// process holds from the start cannot be taken by anything else meanwhile.
//
// The provider key comes in SANDGATE_HARNESS_MODEL_KEY (the harness writes
// the same key into the guest's key file). Prints "listening PORT" once it
// accepts connections, then serves until SIGTERM or SIGINT.
import { startMockModelServer } from '../e2e/fixtures/mock_model_server.mjs';

const apiKey = process.env.SANDGATE_HARNESS_MODEL_KEY;
if (!apiKey) {
  console.error('model-upstream: SANDGATE_HARNESS_MODEL_KEY is not set (tests/kvm-harness/harness.sh sets it)');
  process.exit(2);
}
const mock = await startMockModelServer({ apiKey });
const stop = () => mock.close().then(() => process.exit(0));
process.on('SIGTERM', stop);
process.on('SIGINT', stop);
console.log(`listening ${mock.port}`);
