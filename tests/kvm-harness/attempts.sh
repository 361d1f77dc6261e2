#!/usr/bin/env bash
# attempts.sh N COMMAND [ARGS...]: runs COMMAND up to N times, until it
# exits 0 or 77 (skipped); exits with the last attempt's status.
#
# Why the KVM harness tests are allowed a second boot: the outer guest runs
# under QEMU's TCG, and QEMU 7.2's multi-threaded TCG can livelock the outer
# kernel while it patches its own text (text_poke_bp's int3 on a static-key
# flip; docs/kvm-harness.md). outer-init pins the keys we saw flip, but CI
# still met a frozen outer guest. That is a fault of the emulator, not of
# sandgate. A fault sandgate makes every time fails both attempts; one it
# makes only sometimes can pass on the second boot, so the retry is not
# narrowed to freezes only by trust: every failed attempt's output stays in
# the log, marked, and should be read. (Retrying only when the outer guest
# stops answering its control port would be stricter; not built yet.)
set -uo pipefail
[ $# -ge 2 ] && [[ $1 =~ ^[1-9]$ ]] || { echo "usage: attempts.sh N(1-9) COMMAND [ARGS...]" >&2; exit 2; }
n=$1; shift
rc=1
for ((i = 1; i <= n; i++)); do
  "$@"
  rc=$?
  [ "$rc" -eq 0 ] || [ "$rc" -eq 77 ] && exit "$rc"
  [ "$i" -lt "$n" ] && echo "attempts.sh: attempt $i of $n failed (exit $rc); booting a fresh outer guest for attempt $((i + 1))" >&2
done
echo "attempts.sh: all $n attempts failed; the last exited $rc" >&2
exit "$rc"
