// The code interpreter (issue 20) with the unmodified official
// @e2b/code-interpreter SDK (2.8.0): Sandbox.create() of its default
// template, code-interpreter-v1, then runCode in Python, JavaScript,
// TypeScript and bash contexts, rich results, errors, timeouts and every
// bad input the server meets. Run by CTest (`e2e_js_code_interpreter`); the
// template is built before the tests (scripts/test.sh).
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { Sandbox, NotFoundError, SandboxError, TimeoutError } from '@e2b/code-interpreter';
import { startSandgate } from './server.mjs';

let server, opts, sbx;

before(async () => {
  server = await startSandgate();
  opts = server.opts;
  sbx = await Sandbox.create({ ...opts, timeoutMs: 600_000 });
});

after(async () => {
  if (sbx) await sbx.kill().catch(() => {});
  if (server) await server.stop();
});

// A raw request to the interpreter's port through the gateway, as the SDK
// sends it.
async function raw(sandbox, method, path, body, headers = {}) {
  const res = await fetch(`${opts.sandboxUrl}${path}`, {
    method,
    headers: {
      'E2b-Sandbox-Id': sandbox.sandboxId, 'E2b-Sandbox-Port': '49999', 'Content-Type': 'application/json',
      ...headers,
    },
    body,
  });
  return { status: res.status, statusText: res.statusText, text: await res.text() };
}

test('Python: state persists between runs, results and logs come back, executions are counted', async () => {
  let e = await sbx.runCode('x = 20\nx + 1');
  assert.equal(e.text, '21');
  assert.equal(e.results[0].isMainResult, true);
  const first = e.executionCount;
  e = await sbx.runCode('print("hello"); import sys; print("to stderr", file=sys.stderr); x * 2');
  assert.equal(e.text, '40');
  assert.deepEqual(e.logs.stdout, ['hello\n']);
  assert.deepEqual(e.logs.stderr, ['to stderr\n']);
  assert.equal(e.executionCount, first + 1);
  assert.equal(e.error, undefined);
});

test('onStdout and onStderr stream while the execution runs', async () => {
  // The cell waits for a file that the test writes only once the first
  // line has arrived: without streaming it would never end.
  const seen = [];
  const e = await sbx.runCode(
    'import os, sys, time\nprint("first", flush=True)\n' +
    'while not os.path.exists("/tmp/go"): time.sleep(0.02)\n' +
    'print("err line", file=sys.stderr, flush=True)\nprint("second")',
    {
      timeoutMs: 60_000,
      onStdout: async (m) => {
        seen.push(m.line);
        if (m.line === 'first\n') await sbx.files.write('/tmp/go', 'go');
      },
      onStderr: (m) => seen.push('E:' + m.line),
    });
  assert.equal(e.error, undefined);
  assert.deepEqual(seen, ['first\n', 'E:err line\n', 'second\n']);
});

test('rich results: a matplotlib figure is a png with its chart data, a DataFrame html and data, display() several', async () => {
  let e = await sbx.runCode(
    'import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [2, 4, 8], label="growth")\n' +
    'plt.title("Growth"); plt.xlabel("day"); plt.ylabel("n")\nplt.show()');
  assert.equal(e.error, undefined);
  const fig = e.results.find((r) => r.png);
  assert.ok(fig, JSON.stringify(e.results.map((r) => r.formats())));
  assert.ok(Buffer.from(fig.png, 'base64').subarray(1, 4).toString() === 'PNG');
  assert.equal(fig.chart.type, 'line');
  assert.equal(fig.chart.title, 'Growth');
  assert.equal(fig.chart.x_label, 'day');
  assert.deepEqual(fig.chart.elements[0].points, [[1, 2], [2, 4], [3, 8]]);
  assert.equal(fig.chart.elements[0].label, 'growth');

  e = await sbx.runCode('fig, ax = plt.subplots()\nax.bar(["a", "b"], [3, 5])\nplt.show()');
  const bars = e.results.find((r) => r.chart);
  assert.equal(bars.chart.type, 'bar');
  assert.deepEqual(bars.chart.elements.map((b) => [b.label, b.value]), [['a', 3], ['b', 5]]);

  e = await sbx.runCode('import pandas as pd\ndf = pd.DataFrame({"a": [1, 2], "b": ["x", "y"]})\ndf');
  const frame = e.results[0];
  assert.equal(frame.isMainResult, true);
  assert.match(frame.html, /<table/);
  assert.match(frame.text, /a\s+b/);
  assert.deepEqual(frame.data, { columns: ['a', 'b'], data: { a: [1, 2], b: ['x', 'y'] } });

  e = await sbx.runCode('from IPython.display import display, HTML, Markdown\n' +
    'display(HTML("<b>one</b>"))\ndisplay(Markdown("*two*"))\n"three"');
  assert.equal(e.results.length, 3);
  assert.equal(e.results[0].html, '<b>one</b>');
  assert.equal(e.results[1].markdown, '*two*');
  assert.deepEqual(e.results.map((r) => r.isMainResult), [false, false, true]);
  assert.equal(e.text, "'three'");
});

test('an exception is an ExecutionError with its traceback; the context goes on', async () => {
  const errors = [];
  const e = await sbx.runCode('def f():\n    return 1 / 0\nf()', { onError: (err) => errors.push(err) });
  assert.equal(e.error.name, 'ZeroDivisionError');
  assert.equal(e.error.value, 'division by zero');
  // Jupyter's traceback, colours (ANSI) included, as E2B's.
  const plain = e.error.traceback.replace(/\x1b\[[0-9;]*m/g, '');
  assert.match(plain, /ZeroDivisionError/);
  assert.match(plain, /return 1 \/ 0/);
  assert.equal(errors.length, 1);
  assert.equal((await sbx.runCode('x')).text, '20');
});

test('contexts are isolated, listed, restarted (state cleared) and removed', async () => {
  const a = await sbx.createCodeContext();
  const b = await sbx.createCodeContext({ cwd: '/tmp' });
  assert.equal(a.language, 'python');
  assert.equal(b.cwd, '/tmp');
  await sbx.runCode('secret = "a"', { context: a });
  const inB = await sbx.runCode('secret', { context: b });
  assert.equal(inB.error.name, 'NameError');
  assert.equal((await sbx.runCode('import os; os.getcwd()', { context: b })).text, "'/tmp'");
  const ids = (await sbx.listCodeContexts()).map((c) => c.id);
  assert.ok(ids.includes(a.id) && ids.includes(b.id));
  await sbx.restartCodeContext(a);
  assert.equal((await sbx.runCode('secret', { context: a })).error.name, 'NameError');
  await sbx.removeCodeContext(b);
  assert.ok(!(await sbx.listCodeContexts()).some((c) => c.id === b.id));
  await assert.rejects(sbx.runCode('1', { context: b }), NotFoundError);
  await assert.rejects(sbx.restartCodeContext(b.id), NotFoundError);
});

test('timeoutMs interrupts code that never ends; the next run in that context works', async () => {
  const ctx = await sbx.createCodeContext();
  await sbx.runCode('kept = 7', { context: ctx });
  await assert.rejects(sbx.runCode('while True:\n    pass', { context: ctx, timeoutMs: 1500 }), TimeoutError);
  // The kernel was interrupted (KeyboardInterrupt), not restarted.
  const e = await sbx.runCode('kept + 1', { context: ctx, timeoutMs: 30_000 });
  assert.equal(e.error, undefined);
  assert.equal(e.text, '8');
  // Also while output keeps flowing (the check does not wait for quiet);
  // about 1 MB/s, well under the output limit that would end it first.
  await assert.rejects(sbx.runCode('import time\nwhile True:\n    print("x" * 1000)\n    time.sleep(0.001)',
    { context: ctx, timeoutMs: 2000 }), TimeoutError);
  assert.equal((await sbx.runCode('kept + 2', { context: ctx, timeoutMs: 30_000 })).text, '9');
  // JavaScript: SIGINT breaks the script; its state stays.
  const js = await sbx.createCodeContext({ language: 'javascript' });
  await sbx.runCode('var jsKept = 5', { context: js });
  await assert.rejects(sbx.runCode('while (true) {}', { context: js, timeoutMs: 1500 }), TimeoutError);
  assert.equal((await sbx.runCode('jsKept * 2', { context: js, timeoutMs: 30_000 })).text, '10');
  // bash cannot break a loop of builtins: its context starts anew, saying so.
  const sh = await sbx.createCodeContext({ language: 'bash' });
  await assert.rejects(sbx.runCode('while :; do echo y; done', { context: sh, timeoutMs: 1500 }), TimeoutError);
  const after = await sbx.runCode('echo fresh', { context: sh, timeoutMs: 30_000 });
  assert.equal(after.logs.stdout.join(''), 'fresh\n');
  assert.match(after.logs.stderr.join(''), /started a new one \(its state is lost\)/);
});

test('a cell that prints nothing is still answered at once: timeoutMs ends it, not the request timeout', async () => {
  // The gateway forwards the response head before the first body bytes; if
  // it held it back, the SDK would wait for its request timeout instead.
  const ctx = await sbx.createCodeContext();
  await assert.rejects(sbx.runCode('import time\ntime.sleep(30)', { context: ctx, timeoutMs: 1500, requestTimeoutMs: 20_000 }),
    (e) => {
      assert.ok(e instanceof TimeoutError, String(e));
      assert.match(e.message, /Execution timed out/);
      return true;
    });
});

test('env_vars hold for one execution only', async () => {
  const e = await sbx.runCode('import os; os.environ.get("ONLY_NOW")', { envs: { ONLY_NOW: 'yes' } });
  assert.equal(e.text, "'yes'");
  assert.equal((await sbx.runCode('import os; repr(os.environ.get("ONLY_NOW"))')).text, "'None'");
  const js = await sbx.runCode('process.env.ONLY_NOW', { language: 'javascript', envs: { ONLY_NOW: 'js' } });
  assert.equal(js.text, "'js'");
  assert.equal((await sbx.runCode('process.env.ONLY_NOW', { language: 'javascript' })).text, undefined);
  const sh = await sbx.runCode('echo "[$ONLY_NOW]"', { language: 'bash', envs: { ONLY_NOW: "it's" } });
  assert.equal(sh.logs.stdout.join(''), "[it's]\n");
  assert.equal((await sbx.runCode('echo "[$ONLY_NOW]"', { language: 'bash' })).logs.stdout.join(''), '[]\n');
});

test('JavaScript, TypeScript and bash contexts run and keep their state', async () => {
  const js = await sbx.createCodeContext({ language: 'js' });
  assert.equal(js.language, 'javascript');
  let e = await sbx.runCode('const base = 40; console.log("from js"); base + 2', { context: js });
  assert.equal(e.text, '42');
  assert.equal(e.logs.stdout.join(''), 'from js\n');
  assert.equal((await sbx.runCode('base * 2', { context: js })).text, '80');
  e = await sbx.runCode('await new Promise((r) => setTimeout(r, 10)); return "awaited"', { context: js });
  assert.equal(e.text, "'awaited'");
  e = await sbx.runCode('null.x', { context: js });
  assert.equal(e.error.name, 'TypeError');

  const ts = await sbx.createCodeContext({ language: 'typescript' });
  e = await sbx.runCode('interface P { n: number }\nconst p: P = { n: 3 };\np.n * 2', { context: ts });
  assert.equal(e.error, undefined);
  assert.equal(e.text, '6');
  assert.equal((await sbx.runCode('p.n + 1', { context: ts })).text, '4');

  const sh = await sbx.createCodeContext({ language: 'bash' });
  e = await sbx.runCode('cd /tmp && COUNT=3\nf() { echo "f says $1"; }', { context: sh });
  assert.equal(e.error, undefined);
  e = await sbx.runCode('pwd; f $COUNT', { context: sh });
  assert.equal(e.logs.stdout.join(''), '/tmp\nf says 3\n');
  e = await sbx.runCode('echo to-err >&2; false', { context: sh });
  assert.equal(e.logs.stderr.join(''), 'to-err\n');
  assert.equal(e.error.value, 'exit status 1');
  // A syntax error fails its cell only.
  e = await sbx.runCode('if then fi', { context: sh });
  assert.ok(e.error);
  assert.equal((await sbx.runCode('echo $COUNT', { context: sh })).logs.stdout.join(''), '3\n');
  // The language alone picks the default context of it.
  assert.equal((await sbx.runCode('echo default', { language: 'bash' })).logs.stdout.join(''), 'default\n');
});

test('R and Java: a clear error naming the language', async () => {
  await assert.rejects(sbx.createCodeContext({ language: 'java' }), /java.*not supported/);
  const e = await sbx.runCode('1', { language: 'java' });
  assert.equal(e.error.name, 'UnsupportedLanguage');
  assert.match(e.error.value, /java/);
  const r = await sbx.runCode('1', { language: 'cobol' });
  assert.match(r.error.value, /unknown language 'cobol'/);
});

test('bad input: malformed JSON, a missing code field, bad env_vars, an unknown route; the server goes on', async () => {
  let r = await raw(sbx, 'POST', '/execute', '{"code": ');
  assert.equal(r.status, 400);
  assert.match(r.text, /malformed JSON/);
  r = await raw(sbx, 'POST', '/execute', '[1]');
  assert.equal(r.status, 400);
  r = await raw(sbx, 'POST', '/execute', JSON.stringify({ code: 5 }));
  assert.equal(r.status, 400);
  assert.match(r.text, /'code'/);
  r = await raw(sbx, 'POST', '/execute', JSON.stringify({ code: '1', env_vars: { 'A B': 'x' } }));
  assert.equal(r.status, 400);
  r = await raw(sbx, 'POST', '/contexts', JSON.stringify({ cwd: '/nope' }));
  assert.equal(r.status, 400);
  assert.match(r.text, /not a directory/);
  r = await raw(sbx, 'GET', '/nothing?source=ci');
  assert.equal(r.status, 404);
  r = await raw(sbx, 'GET', '/contexts?source=ci');
  assert.equal(r.status, 200);
  assert.equal((await sbx.runCode('1 + 1')).text, '2');
});

test('an output flood is cut with a marker; the context stays usable', async () => {
  const e = await sbx.runCode('import sys\nfor i in range(200):\n    sys.stdout.write("y" * 100000 + "\\n")\n"done"',
    { timeoutMs: 120_000 });
  const printed = e.logs.stdout.join('').length;
  assert.ok(printed <= 8 << 20, `${printed} bytes came through`);
  assert.ok(printed > 1 << 20, `only ${printed} bytes came through`);
  assert.match(e.logs.stderr.join(''), /\[sandgate: output truncated/);
  assert.equal(e.text, "'done'");
  assert.equal((await sbx.runCode('2 * 3')).text, '6');
  // A print loop that never ends is interrupted once it has printed 4 times
  // the limit past it, saying so; the context goes on.
  const loop = await sbx.runCode('while True:\n    try:\n        print("z" * 10000)\n    except Exception:\n        pass',
    { timeoutMs: 120_000 });
  assert.equal(loop.error.name, 'OutputLimitExceeded');
  assert.match(loop.logs.stderr.join(''), /\[sandgate: output truncated/);
  assert.equal((await sbx.runCode('3 * 3')).text, '9');
});

test('a kernel that dies is an error naming it; the context restarts', async () => {
  const ctx = await sbx.createCodeContext();
  let e = await sbx.runCode('import os; os._exit(3)', { context: ctx });
  assert.equal(e.error.name, 'KernelDied');
  assert.match(e.error.value, /python kernel died/);
  await sbx.restartCodeContext(ctx);
  e = await sbx.runCode('40 + 2', { context: ctx });
  assert.equal(e.text, '42');
  // Code that forks away from the kernel: the child leaves, the kernel stays.
  e = await sbx.runCode('import os, time\nif os.fork() == 0:\n    time.sleep(0.5)\n    os._exit(0)\n"parent"',
    { context: ctx });
  assert.equal(e.text, "'parent'");
  assert.equal((await sbx.runCode('1 + 1', { context: ctx })).text, '2');
});

test('8 sandboxes run code in parallel', async () => {
  const boxes = await Promise.all(Array.from({ length: 8 }, () => Sandbox.create({ ...opts, timeoutMs: 300_000 })));
  try {
    const outs = await Promise.all(boxes.map((b, i) => b.runCode(`import os\nn = ${i}\nn * n`)));
    assert.deepEqual(outs.map((e) => e.text), Array.from({ length: 8 }, (_, i) => String(i * i)));
    const again = await Promise.all(boxes.map((b) => b.runCode('n')));
    assert.deepEqual(again.map((e) => e.text), Array.from({ length: 8 }, (_, i) => String(i)));
  } finally {
    await Promise.all(boxes.map((b) => b.kill().catch(() => {})));
  }
});

test('on base (no interpreter) runCode fails at once saying where the interpreter is, not with a timeout', async () => {
  const plain = await Sandbox.create('base', opts);
  try {
    await assert.rejects(plain.runCode('1', { requestTimeoutMs: 20_000 }), (e) => {
      assert.ok(e instanceof NotFoundError, `${e.constructor.name}: ${e.message}`);
      assert.match(e.message, /no answer from port 49999 .*code-interpreter-v1/);
      return true;
    });
  } finally {
    await plain.kill();
  }
});

// The warm pool (sandbox-runtime/lifecycle/warm_pool.h): once a tenant
// has created a sandbox of a template with a start command, sandboxes of it
// are started ahead; the next create takes one and gives it its own id,
// token and envVars.
test('the warm pool serves the next create with a started interpreter, with the creator\'s envs and token', async () => {
  const metric = async (name) => {
    const text = await (await fetch(`${opts.apiUrl}/metrics`)).text();
    const m = new RegExp(`^${name} (\\d+)`, 'm').exec(text);
    assert.ok(m, `${name} not in /metrics`);
    return Number(m[1]);
  };
  // The suite's first create made the template hot: wait for the pool.
  for (let i = 0; (await metric('sandgate_warm_pool_sandboxes')) < 1; i++) {
    assert.ok(i < 600, 'the warm pool never filled');
    await new Promise((r) => setTimeout(r, 100));
  }
  const taken = await metric('sandgate_warm_pool_taken_total');
  const pooled = await Sandbox.create({ ...opts, envs: { WHO: 'creator' }, secure: true });
  try {
    assert.equal(await metric('sandgate_warm_pool_taken_total'), taken + 1);
    assert.equal((await pooled.commands.run('echo $WHO')).stdout, 'creator\n');
    assert.equal((await pooled.runCode('6 * 7')).text, '42');
    // envd answers the creator's token only.
    const bad = await fetch(`${opts.sandboxUrl}/envs`, {
      headers: { 'E2b-Sandbox-Id': pooled.sandboxId, 'E2b-Sandbox-Port': '49983', 'X-Access-Token': 'wrong' },
    });
    assert.equal(bad.status, 401);
    const info = await Sandbox.getInfo(pooled.sandboxId, opts);
    assert.equal(info.templateId.length > 0, true);
  } finally {
    await pooled.kill();
  }
});
