// Starts the real sandgate binary for an e2e test file: port 0, a temp data
// dir, its own cgroup parent; resolves once the banner is printed.
//
// Sandboxes end with the server (--keep-sandboxes off) unless options.keep:
// then they outlive it, and restart() starts a new sandgate on the same data
// directory and cgroup parent, which takes them back (issue 21).
import { spawn } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { randomBytes } from 'node:crypto';

// Runs `sandgate serve` and resolves with its url and key once its banner
// is out; rejects with its output when it exits first.
function launch(bin, args, wrap = []) {
  // wrap: a command the server runs under (nsenter into a network
  // namespace); it execs sandgate, so the pid is sandgate's.
  const proc = wrap.length ? spawn(wrap[0], [...wrap.slice(1), bin, ...args], { stdio: ['ignore', 'pipe', 'pipe'] })
    : spawn(bin, args, { stdio: ['ignore', 'pipe', 'pipe'] });
  let err = '';
  proc.stderr.on('data', (chunk) => {
    err += chunk;
    if (err.length > 65536) err = err.slice(-32768);
    process.stderr.write(chunk);
  });
  const started = new Promise((resolve, reject) => {
    let out = '';
    const timer = setTimeout(() => reject(new Error('sandgate did not start: ' + out + err)), 60000);
    proc.on('exit', (code) => {
      clearTimeout(timer);
      reject(new Error(`sandgate exited with ${code}: ${out}${err}`));
    });
    proc.stdout.on('data', (chunk) => {
      out += chunk;
      const url = /listening on (https?:\/\/[0-9.:]+)/.exec(out);
      const key = /API key \(tenant "local"\): (e2b_[0-9a-f]{40})\n/.exec(out);
      if (url && key) {
        clearTimeout(timer);
        proc.removeAllListeners('exit');
        resolve({ url: url[1], key: key[1] });
      }
    });
  });
  return { proc, started };
}

export async function startSandgate(extraArgs = [], options = {}) {
  const bin = process.env.SANDGATE_BIN;
  const templates = process.env.SANDGATE_TESTS_TEMPLATES_DIR;
  if (!bin || !templates) throw new Error('SANDGATE_BIN and SANDGATE_TESTS_TEMPLATES_DIR must be set (run through ctest)');
  const dir = mkdtempSync(join(tmpdir(), 'sandgate-e2e-'));
  const cgroupParent = 'sge2e-' + randomBytes(4).toString('hex');
  const args = (keep) => ['serve', '--listen', '127.0.0.1:0', '--data-dir', join(dir, 'data'),
    '--templates-dir', templates, '--cgroup-parent', cgroupParent, '--log-level', 'warn',
    '--keep-sandboxes', keep ? 'on' : 'off', ...extraArgs];
  let { proc, started } = launch(bin, args(options.keep), options.wrap);
  const server = {
    dir, cgroupParent, args,
    ...(await started),
    get pid() { return proc.pid; },
    // Resolves to the exit status ({ code, signal }) once the server is
    // stopped by signal (SIGTERM: a clean stop; SIGKILL: a crash).
    async signal(sig) {
      const exited = new Promise((r) => proc.on('exit', (code, signal) => r({ code, signal })));
      proc.kill(sig);
      return exited;
    },
    // A new sandgate on the same data directory and cgroup parent, after
    // this one was stopped (keep: whether its sandboxes outlive it).
    async restart(keep = options.keep) {
      ({ proc, started } = launch(bin, args(keep), options.wrap));
      Object.assign(server, await started);
      server.opts = { apiUrl: server.url, sandboxUrl: server.url, apiKey: server.key };
      return server;
    },
    // A second sandgate on the same data directory while this one runs: its
    // exit status and output.
    async second() {
      const p = spawn(bin, args(options.keep), { stdio: ['ignore', 'pipe', 'pipe'] });
      let out = '';
      p.stdout.on('data', (c) => { out += c; });
      p.stderr.on('data', (c) => { out += c; });
      const code = await new Promise((r) => p.on('exit', (c) => r(c)));
      return { code, out };
    },
    async stop() {
      const status = proc.exitCode === null && proc.signalCode === null ? await server.signal('SIGTERM') : null;
      rmSync(dir, { recursive: true, force: true });
      return status;
    },
  };
  server.opts = { apiUrl: server.url, sandboxUrl: server.url, apiKey: server.key };
  return server;
}
