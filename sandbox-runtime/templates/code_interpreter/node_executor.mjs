// sandgate's JavaScript and TypeScript executor for the code interpreter
// (server.py's NodeContext): one process per context, one cell at a time.
// A request is a JSON line {code, env} on the request pipe; the answer a
// JSON line on the answer pipe (their descriptors are the last two
// arguments): {result?: {text/plain: ...}, error?: {name, value, traceback}},
// written after everything the cell printed (writes to pipes are
// synchronous in Node on Linux, so the server reads them first).
//
// Cells run as scripts in this process's global scope (vm.runInThisContext),
// so top-level declarations persist between cells as in a REPL, and the
// value of the last expression is the result. A cell that uses top-level
// await runs inside an async function instead: its value is what it
// returns, its declarations stay in the cell. TypeScript is transpiled by
// Debian's typescript module (types are erased, not checked). SIGINT breaks
// a running cell (breakOnSigint) and leaves the context usable.
import fs from 'node:fs';
import vm from 'node:vm';
import util from 'node:util';
import readline from 'node:readline';
import { createRequire } from 'node:module';

const language = process.argv[2] || 'javascript';
const requestFd = Number(process.argv[3]);
const answerFd = Number(process.argv[4]);
const require = createRequire(process.cwd() + '/');
globalThis.require = require;
let ts = null;
if (language === 'typescript') ts = require('typescript');

// Until a cell runs, SIGINT must not end the process; what a cell leaves
// running and fails later is reported, not fatal.
process.on('SIGINT', () => {});
process.on('uncaughtException', (e) => process.stderr.write(`Uncaught ${e && e.stack ? e.stack : e}\n`));
process.on('unhandledRejection', (e) => process.stderr.write(`Unhandled rejection: ${e && e.stack ? e.stack : e}\n`));

function answer(obj) {
  fs.writeSync(answerFd, JSON.stringify(obj) + '\n');
}

function describeError(e) {
  if (e instanceof Error) return { name: e.name, value: e.message, traceback: e.stack || String(e) };
  return { name: 'Error', value: util.inspect(e), traceback: util.inspect(e) };
}

function transpile(code) {
  if (!ts) return code;
  const out = ts.transpileModule(code, {
    compilerOptions: { target: ts.ScriptTarget.ES2022, module: ts.ModuleKind.CommonJS, esModuleInterop: true },
    reportDiagnostics: false,
  });
  // A cell without imports or exports is a script: drop the module marker.
  return out.outputText.replace(/^"use strict";\n/, '').replace(/\nexports\.__esModule = true;\n|Object\.defineProperty\(exports, "__esModule", \{ value: true \}\);\n/g, '\n');
}

async function run(code) {
  const js = transpile(code);
  let value;
  try {
    const script = new vm.Script(js, { filename: `cell.${language === 'typescript' ? 'ts' : 'js'}` });
    value = script.runInThisContext({ breakOnSigint: true, displayErrors: false });
  } catch (e) {
    if (!(e instanceof SyntaxError) || !/await/.test(e.message)) throw e;
    const wrapped = new vm.Script(`(async () => {\n${js}\n})()`, { filename: 'cell.js' });
    value = wrapped.runInThisContext({ breakOnSigint: true, displayErrors: false });
  }
  if (value && typeof value.then === 'function') value = await value;
  return value;
}

globalThis.exports = globalThis.exports || {};
globalThis.module = globalThis.module || { exports: globalThis.exports };

const rl = readline.createInterface({ input: fs.createReadStream(null, { fd: requestFd }) });
let chain = Promise.resolve();
rl.on('line', (line) => {
  chain = chain.then(async () => {
    let req;
    try {
      req = JSON.parse(line);
    } catch (e) {
      answer({ error: describeError(e) });
      return;
    }
    const saved = {};
    for (const [k, v] of Object.entries(req.env || {})) {
      saved[k] = process.env[k];
      process.env[k] = v;
    }
    try {
      const value = await run(req.code);
      if (value === undefined) answer({});
      else answer({ result: { 'text/plain': util.inspect(value, { depth: 4, maxArrayLength: 200, breakLength: 100 }) } });
    } catch (e) {
      answer({ error: describeError(e) });
    } finally {
      for (const [k, v] of Object.entries(saved)) {
        if (v === undefined) delete process.env[k];
        else process.env[k] = v;
      }
    }
  });
});
rl.on('close', () => process.exit(0));
