#!/usr/bin/env bash
# The replay benchmark (docs/replay.md) on microVMs where this host cannot
# run them natively: once per policy, the KVM test harness (QEMU TCG, an
# outer guest with a working /dev/kvm) boots `sandgate serve --runtime kvm`
# with that policy's flags, and tests/bench/replay/replay.mjs --external
# drives it from this host; then the one-policy reports are merged into
# docs/bench/replay-kvm-emulated.json and .svg. The memory figures hold (the
# VMMs' RSS and the engine's pool, read by sandgate inside); the times are
# emulated and say nothing about real KVM speed.
#
# usage: scripts/replay-kvm.sh [N] [TIME_SCALE] [POLICIES] [TRAJECTORIES]
#   defaults: 1 sandbox per trajectory, times at 100 %, none,pause,offload,
#   coding,data
# The merged report takes every policy already run at this N, scale and
# trajectories
# (build/PRESET/replay-kvm/nN-sSCALE-TRAJECTORIES/), so `... 1 4 offload` then
# `... 1 4 none,pause` gives one report of the three.
# SANDGATE_BENCH_PRESET=debug uses the debug build tree.
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-1}
scale=${2:-1}
policies=${3:-none,pause,offload}
trajectories=${4:-coding,data}
preset=${SANDGATE_BENCH_PRESET:-release}
b=build/$preset
scripts/install-deps.sh
(cd tests/e2e && npm ci --no-audit --no-fund --loglevel=error)
cmake --preset "$preset" -DSANDGATE_TESTS=ON >/dev/null
cmake --build --preset "$preset" -j"$(nproc)" --target sandgate sandgate-agent sandgate-vmm
$b/bin/sandgate template build --templates-dir $b/tests-rootfs >/dev/null
$b/bin/sandgate template image --templates-dir $b/tests-rootfs >/dev/null
scripts/guest-image.sh $b/guest

# One-policy reports stay in a folder per (N, scale, trajectories), so the policies can
# be run one at a time (each is tens of minutes) and merged at the end:
# the merge takes every policy report in it.
out=$b/replay-kvm/n$n-s$scale-${trajectories//,/-}
mkdir -p "$out"
# replay.mjs's POLICIES, as `sandgate serve` flags (no commas: the harness
# splits SANDGATE_HARNESS_ARGS on them), after the limits it lifts.
common="--rate 0 --create-rate 0 --llm-rate 0 --llm-tokens-per-min 0"
reports=()
for p in ${policies//,/ }; do
  case $p in
    none) flags="--no-llm-pause" ;;
    pause) flags="--memory-offload off" ;;
    offload) flags="--memory-offload always --offload-min-wait-ms 0" ;;
    *) echo "replay-kvm: unknown policy $p (none, pause, offload)" >&2; exit 2 ;;
  esac
  echo "replay-kvm: policy $p in the KVM harness" >&2
  SANDGATE_BIN_DIR=$b/bin SANDGATE_GUEST_DIR=$b/guest SANDGATE_TESTS_TEMPLATES_DIR=$b/tests-rootfs \
    SANDGATE_HARNESS_CACHE=$b/kvm-harness SANDGATE_HARNESS_TEST_TIMEOUT=${SANDGATE_HARNESS_TEST_TIMEOUT:-3000} \
    SANDGATE_HARNESS_ARGS="$common $flags" \
    SANDGATE_REPLAY_ARGS="--external --runtime kvm --policies $p --n $n --time-scale $scale --trajectories $trajectories --out $out --name $p" \
    tests/kvm-harness/harness.sh tests/bench/replay/replay.mjs
done
for p in none pause offload; do if [ -f "$out/$p.json" ]; then reports+=("$out/$p.json"); fi; done
combined=$(IFS=,; echo "${reports[*]}")
node tests/bench/replay/replay.mjs --combine "$combined" --out docs/bench --name replay-kvm-emulated
