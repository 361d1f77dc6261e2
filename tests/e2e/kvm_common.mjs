// What the kvm e2e files share.
import assert from 'node:assert/strict';

// Reads the background counter (a loop writing /tmp/counter) twice and
// checks it moved: the process runs (is not merely present, e.g. still
// frozen).
export async function counterAdvances(s) {
  const first = Number((await s.files.read('/tmp/counter')).trim());
  const deadline = Date.now() + 60_000;
  for (;;) {
    const now = Number((await s.files.read('/tmp/counter')).trim());
    if (now > first) return;
    if (Date.now() > deadline) assert.fail(`/tmp/counter stuck at ${now} for 60 s`);
    await s.commands.run('sleep 0.2');
  }
}
