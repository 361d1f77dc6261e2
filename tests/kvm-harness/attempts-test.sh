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
  "$here/attempts.sh" "$n" "$t/fake" "$@" 2>"$t/err.$case_no"
  rc=$?
  calls=$(cat "$CALLS" 2>/dev/null || echo 0)
  # No message wanted: none is written.
  if [ -z "$want_msg" ]; then said_ok=$([ ! -s "$t/err.$case_no" ] && echo 1); else
    said_ok=$(grep -q -- "$want_msg" "$t/err.$case_no" && echo 1); fi
  if [ "$rc" != "$want_rc" ] || [ "$calls" != "$want_calls" ] || [ -z "$said_ok" ]; then
    echo "FAIL: attempts.sh $n with statuses $*: exit $rc after $calls calls (want $want_rc after $want_calls, and '$want_msg'); it said:"
    sed 's/^/  | /' "$t/err.$case_no"
    failures=$((failures + 1))
  fi
}
check 0 1 '' 2 0
check 77 1 '' 2 77
check 1 1 '' 2 1 0                    # a failure in a guest that runs: no retry
check 3 1 '' 2 3 0
check 0 2 'attempt 1 of 2: the outer guest froze' 2 75 0
check 75 2 'froze in all 2 attempts' 2 75 75 0
check 1 2 'attempt 1 of 3' 3 75 1 0   # frozen, then a real failure: that failure
check 75 1 'froze in all 1 attempts' 1 75 0
check 2 0 'usage' 0 0                 # N must be 1 to 9
check 2 0 'usage' x 0
if [ "$failures" -ne 0 ]; then
  echo "attempts-test: $failures of $case_no cases failed"
  exit 1
fi
echo "attempts-test: $case_no cases passed"
