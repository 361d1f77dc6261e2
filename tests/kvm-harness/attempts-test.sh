#!/usr/bin/env bash
# kvm_harness_attempts: attempts.sh gives another attempt for exit 75 (the
# harness's frozen outer guest) and for nothing else, stops at N, and exits
# with the last attempt's status. The command is a stand-in that exits with
# the statuses it is given, one per call, and counts its calls.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
t=$(mktemp -d)
trap 'rm -rf "$t"' EXIT
cat >"$t/fake" <<'FAKE'
#!/usr/bin/env bash
n=$(($(cat "$CALLS" 2>/dev/null || echo 0) + 1))
echo "$n" >"$CALLS"
echo "not ok $n - call $n"
shift $((n - 1))
exit "${1:-0}"
FAKE
chmod +x "$t/fake"
failures=0
case_no=0
# check WANT_RC WANT_CALLS WANT_MESSAGE N STATUS...
check() {
  local want_rc=$1 want_calls=$2 want_msg=$3 n=$4 rc calls said_ok
  shift 4
  case_no=$((case_no + 1))
  export CALLS="$t/calls.$case_no"
  "$here/attempts.sh" "$n" "$t/fake" "$@" >"$t/out.$case_no" 2>"$t/err.$case_no"
  rc=$?
  calls=$(cat "$CALLS" 2>/dev/null || echo 0)
  # No message wanted: none is written.
  if [ -z "$want_msg" ]; then said_ok=$([ ! -s "$t/err.$case_no" ] && echo 1); else
    said_ok=$(grep -q -- "$want_msg" "$t/err.$case_no" && echo 1); fi
  # The last attempt's output is printed, whatever the status.
  [ "$calls" -eq 0 ] || grep -q "^not ok $calls - call $calls\$" "$t/out.$case_no" || said_ok=''
  if [ "$rc" != "$want_rc" ] || [ "$calls" != "$want_calls" ] || [ -z "$said_ok" ]; then
    echo "FAIL: attempts.sh $n with statuses $*: exit $rc after $calls calls (want $want_rc after $want_calls, and '$want_msg'); it said:"
    sed 's/^/  | /' "$t/err.$case_no"
    failures=$((failures + 1))
  fi
}
check 0 1 '' 2 0
check 77 1 '' 2 77
check 1 1 'attempt 1 exited 1' 2 1 0                    # a failure in a guest that runs: no retry
check 3 1 'attempt 1 exited 3' 2 3 0
check 0 2 'attempt 1 of 2: the outer guest froze' 2 75 0
check 75 2 'froze in all 2 attempts' 2 75 75 0
check 1 2 'attempt 1 of 3' 3 75 1 0   # frozen, then a real failure: that failure
check 75 1 'froze in all 1 attempts' 1 75 0
check 2 0 'usage' 0 0                 # N must be 1 to 9
check 2 0 'usage' x 0
# The output: the summary of each attempt (its status and failed cases)
# comes first, then the last attempt's output, then the earlier ones'.
case_no=$((case_no + 1))
export CALLS="$t/calls.$case_no"
"$here/attempts.sh" 3 "$t/fake" 75 1 >"$t/out" 2>&1
got=$(grep -v '^attempts.sh: attempt 1 of 3' "$t/out" | tr '\n' '~')
want='attempts.sh: attempt 1 exited 75~  | not ok 1 - call 1~attempts.sh: attempt 2 exited 1~  | not ok 2 - call 2~'
want+='attempts.sh: the output of attempt 2 (the last)~not ok 2 - call 2~attempts.sh: the output of attempt 1~not ok 1 - call 1~'
if [ "$got" != "$want" ]; then
  echo "FAIL: attempts.sh's output after a frozen attempt and a failed one:"
  sed 's/^/  | /' "$t/out"
  failures=$((failures + 1))
fi
if [ "$failures" -ne 0 ]; then
  echo "attempts-test: $failures of $case_no cases failed"
  exit 1
fi
echo "attempts-test: $case_no cases passed"
