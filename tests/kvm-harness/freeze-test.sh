#!/usr/bin/env bash
# kvm_harness_freeze: the harness tells a frozen outer guest from a slow or
# failing one. Two boots of the outer guest, each frozen once by stopping
# its vCPUs from QEMU's monitor (SANDGATE_HARNESS_TEST_FREEZE), as QEMU's
# TCG livelock does:
#  - "boot": frozen while it boots (the freeze seen at the static-key pins):
#    the heartbeat stops, the ping goes unanswered, and the harness boots it
#    again and runs the command (exit 0);
#  - "run": frozen once a ten-minute command has started, after the running
#    guest has answered a ping: the harness must exit 75, the status
#    attempts.sh retries, saying why.
# Then two more boots: the outer kernel panics under the command (75), or
# the outer guest powers off under it (a failure, not 75).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=$(mktemp)
trap 'rm -f "$out"' EXIT
fail() {
  echo "freeze-test: FAILED: $*"
  exit 1
}

SANDGATE_HARNESS_TEST_FREEZE=boot "$here/harness.sh" --exec 'echo freeze-test-ran' 2>&1 | tee "$out"
rc=${PIPESTATUS[0]}
grep -q "stopping the booting guest's vCPUs" "$out" || fail "the harness did not stop the booting guest"
grep -q 'the outer guest froze while booting (boot 1 of 5); booting it again' "$out" || fail "the harness did not boot the frozen guest again"
grep -q 'freeze-test-ran' "$out" || fail "the command did not run on the second boot"
[ "$rc" -eq 0 ] || fail "the harness exited $rc after a frozen boot, not 0"

SANDGATE_HARNESS_TEST_FREEZE=run SANDGATE_HARNESS_SILENCE_S=${SANDGATE_HARNESS_SILENCE_S:-15} \
  "$here/harness.sh" --exec 'sleep 600' 2>&1 | tee "$out"
rc=${PIPESTATUS[0]}
grep -q 'the running guest answered a ping; stopping its vCPUs' "$out" || fail "the harness did not ping the running guest and stop it"
grep -q 'no heartbeat from the outer guest for' "$out" || fail "the harness did not see the heartbeat stop"
grep -q 'FROZEN: the outer guest stopped running before the command finished' "$out" || fail "the harness did not report the freeze"
[ "$rc" -eq 75 ] || fail "the harness exited $rc, not 75"
# The outer kernel panicking under the command (as TCG's emulated SVM has
# made it do under KVM_RUN): exit 75, saying so. A guest that powers off
# under the command did not panic: a plain failure, not retried.
"$here/harness.sh" --exec 'echo c >/proc/sysrq-trigger; sleep 600' 2>&1 | tee "$out"
rc=${PIPESTATUS[0]}
grep -q "FROZEN: the outer guest's kernel panicked before the command finished" "$out" || fail "the harness did not report the outer kernel's panic"
[ "$rc" -eq 75 ] || fail "the harness exited $rc after the outer kernel panicked, not 75"
"$here/harness.sh" --exec 'echo o >/proc/sysrq-trigger; sleep 600' 2>&1 | tee "$out"
rc=${PIPESTATUS[0]}
grep -q 'QEMU exited before the command finished inside the guest' "$out" || fail "the harness did not report QEMU's exit"
[ "$rc" -ne 75 ] && [ "$rc" -ne 0 ] || fail "the harness exited $rc after the outer guest powered off, not a failure"
echo "freeze-test: a guest frozen while booting is booted again; one frozen while the command runs, or whose kernel panicked, is reported with exit 75; one that powered off is a failure"
