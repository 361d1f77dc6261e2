#!/usr/bin/env bash
# kvm_harness_freeze: the harness tells a frozen outer guest from a slow or
# failing one. It boots the outer guest with a command that would run for
# ten minutes; once the command starts, the harness pings the running guest
# (it must answer), then stops its vCPUs from QEMU's monitor
# (SANDGATE_HARNESS_TEST_FREEZE), as QEMU's TCG livelock does. The heartbeat
# stops, the ping goes unanswered, and the harness must exit 75, the status
# attempts.sh retries, saying why.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=$(mktemp)
trap 'rm -f "$out"' EXIT
SANDGATE_HARNESS_TEST_FREEZE=1 SANDGATE_HARNESS_SILENCE_S=${SANDGATE_HARNESS_SILENCE_S:-15} \
  "$here/harness.sh" --exec 'sleep 600' 2>&1 | tee "$out"
rc=${PIPESTATUS[0]}
fail() {
  echo "freeze-test: FAILED: $*"
  exit 1
}
grep -q 'the running guest answered a ping; stopping its vCPUs' "$out" || fail "the harness did not ping the running guest and stop it"
grep -q 'no heartbeat from the outer guest for' "$out" || fail "the harness did not see the heartbeat stop"
grep -q 'FROZEN: the outer guest stopped running before the command finished' "$out" || fail "the harness did not report the freeze"
[ "$rc" -eq 75 ] || fail "the harness exited $rc, not 75"
echo "freeze-test: a frozen outer guest is reported with exit 75"
