// Starts the real sandgate binary for an e2e test file: port 0, a temp data
// dir, its own cgroup parent; resolves once the banner is printed.
import { spawn } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { randomBytes } from 'node:crypto';

export async function startSandgate(extraArgs = []) {
  const bin = process.env.SANDGATE_BIN;
  const templates = process.env.SANDGATE_TESTS_TEMPLATES_DIR;
  if (!bin || !templates) throw new Error('SANDGATE_BIN and SANDGATE_TESTS_TEMPLATES_DIR must be set (run through ctest)');
  const dir = mkdtempSync(join(tmpdir(), 'sandgate-e2e-'));
  const proc = spawn(bin, ['serve', '--listen', '127.0.0.1:0', '--data-dir', join(dir, 'data'),
    '--templates-dir', templates, '--cgroup-parent', 'sge2e-' + randomBytes(4).toString('hex'),
    '--log-level', 'warn', ...extraArgs], { stdio: ['ignore', 'pipe', 'inherit'] });
  const { url, key } = await new Promise((resolve, reject) => {
    let out = '';
    const timer = setTimeout(() => reject(new Error('sandgate did not start: ' + out)), 60000);
    proc.on('exit', (code) => reject(new Error(`sandgate exited with ${code}: ${out}`)));
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
  return {
    url, key, dir, pid: proc.pid,
    opts: { apiUrl: url, sandboxUrl: url, apiKey: key },
    // Resolves to the exit status ({ code, signal }) of a SIGTERM stop.
    async stop() {
      const exited = new Promise((r) => proc.on('exit', (code, signal) => r({ code, signal })));
      proc.kill('SIGTERM');
      const status = await exited;
      rmSync(dir, { recursive: true, force: true });
      return status;
    },
  };
}
