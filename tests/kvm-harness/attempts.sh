#!/usr/bin/env bash
# attempts.sh N COMMAND [ARGS...]: runs COMMAND (the KVM harness) up to N
# times while it exits 75, and exits with the last attempt's status. Any
# other status, a pass (0), a skip (77) or a failure, ends it at once.
#
# Why 75 gets another boot: the harness exits 75 only when the outer
# guest's kernel has stopped running (no heartbeat, no answer to a ping on
# its control port; harness.sh). That is QEMU 7.2's multi-threaded TCG
# livelocking the outer kernel while it patches its own text
# (text_poke_bp's int3 on a static-key flip; docs/kvm-harness.md), a fault
# of the emulator, not of sandgate. It also exits 75 when the outer
# guest answers pings but starts no process (a wedged kernel), and when
# the tests failed only by timeouts and dropped connections while sandgate
# neither exited nor crashed (a stalled vCPU in the outer guest or a
# microVM; harness.sh, stalled_only). A test that gets a wrong answer, or a
# sandgate that exits, is never retried.
#
# Each attempt's output goes to a file (in $SANDGATE_HARNESS_CACHE, else a
# temporary folder) and is printed when the attempts end. After a failure
# or a retry a summary comes first, a few lines an attempt (its status,
# its failed cases and errors, the harness's verdict), then the last
# attempt's whole output, then the earlier ones'. A reader who sees only the head of a long log (CI shows
# the head of a failed test's output) sees why the last attempt failed.
set -uo pipefail
[ $# -ge 2 ] && [[ $1 =~ ^[1-9]$ ]] || { echo "usage: attempts.sh N(1-9) COMMAND [ARGS...]" >&2; exit 2; }
n=$1; shift
logs=$(mktemp -d "${SANDGATE_HARNESS_CACHE:-${TMPDIR:-/tmp}}/attempts.XXXXXX" 2>/dev/null || mktemp -d)
trap 'rm -rf "$logs"' EXIT

# summary I RC: a few lines on attempt I, which exited RC.
summary() {
  local f="$logs/$1.out"
  echo "attempts.sh: attempt $1 exited $2"
  grep -aE '^not ok |^  error:|^# (pass|fail) |kvm-harness \[[0-9.]+ s\]: (FAIL|FROZEN|diagnosis|every failed|a microVM|tests finished|the command exited|the tests ran past)' "$f" |
    cut -c1-400 | head -n 20 | sed 's/^/  | /'
}

finish() {
  local rc=$1 i
  if [ "$last" -gt 1 ] || { [ "$rc" -ne 0 ] && [ "$rc" -ne 77 ]; }; then
    for ((i = 1; i <= last; i++)); do summary "$i" "${rcs[$i]}"; done >&2
    echo "attempts.sh: the output of attempt $last (the last)" >&2
    cat "$logs/$last.out"
    for ((i = 1; i < last; i++)); do
      echo "attempts.sh: the output of attempt $i" >&2
      cat "$logs/$i.out"
    done
  else
    cat "$logs/1.out"
  fi
  exit "$rc"
}

declare -a rcs
last=0
for ((i = 1; ; i++)); do
  "$@" >"$logs/$i.out" 2>&1
  rc=$?
  rcs[$i]=$rc
  last=$i
  [ "$rc" -eq 75 ] || finish "$rc"
  if [ "$i" -ge "$n" ]; then
    echo "attempts.sh: the outer guest froze in all $n attempts" >&2
    finish "$rc"
  fi
  echo "attempts.sh: attempt $i of $n: the outer guest froze (exit 75); booting a fresh one for attempt $((i + 1))" >&2
done
