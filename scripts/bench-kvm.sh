#!/usr/bin/env bash
# microVM benchmark (tests/bench/microvm_bench.cpp): boot to agent-ready,
# clone-from-snapshot create latency (p50/p99 over 50 creates), host memory
# per idle microVM. Where this host's KVM can run microVMs it runs directly
# and writes docs/bench/microvm.json; otherwise it runs inside the KVM test
# harness (QEMU TCG) and writes docs/bench/microvm-emulated.json: those
# timings are emulated and say nothing about real KVM speed.
# Then custom templates on the kvm backend (tests/e2e/bench/
# kvm_templates.bench.mjs, the JS SDK against sandgate in the harness):
# docs/bench/templates-kvm-emulated.json; and the code interpreter
# (kvm_code_interpreter.bench.mjs): docs/bench/code-interpreter-kvm-emulated.json.
# Then pauses to disk, resumes and a fork of 8 of microVMs
# (kvm_durable.bench.mjs): docs/bench/durable-kvm-emulated.json.
# Then microVM networking (virtio-net on a TAP: creates with and without,
# connects and a download from the guest), in the harness on its own:
# docs/bench/network-kvm-emulated.json.
# SANDGATE_BENCH_ONLY=templates|code-interpreter|durable|network runs only that one.
# SANDGATE_BENCH_PRESET=debug uses the debug build tree (the result says which).
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${SANDGATE_BENCH_PRESET:-release}
b=build/$preset
scripts/install-deps.sh
(cd tests/e2e && npm ci --no-audit --no-fund --loglevel=error)
cmake --preset "$preset" -DSANDGATE_TESTS=ON >/dev/null
cmake --build --preset "$preset" -j"$(nproc)" --target microvm_bench sandgate sandgate-agent sandgate-vmm
$b/bin/sandgate template build --templates-dir $b/tests-rootfs >/dev/null
$b/bin/sandgate template image --templates-dir $b/tests-rootfs >/dev/null
scripts/guest-image.sh $b/guest
mkdir -p docs/bench
if [ -n "${SANDGATE_BENCH_ONLY:-}" ]; then
  :
elif $b/bin/sandgate kvm check; then
  state=$(mktemp -d)
  trap 'rm -rf "$state"' EXIT
  SANDGATE_KVM_BIN_DIR=$b/bin SANDGATE_GUEST_DIR=$b/guest \
    SANDGATE_TEST_ROOTFS=$b/tests-rootfs/base SANDGATE_KVM_STATE="$state" \
    $b/bin/microvm_bench docs/bench/microvm.json "${1:-50}" 10
else
  log=$(mktemp)
  SANDGATE_BIN_DIR=$b/bin SANDGATE_GUEST_DIR=$b/guest \
    SANDGATE_TESTS_TEMPLATES_DIR=$b/tests-rootfs SANDGATE_HARNESS_TEST_TIMEOUT=1800 \
    tests/kvm-harness/harness.sh --with $b/bin/microvm_bench \
    --exec "SANDGATE_BENCH_EMULATED=1 microvm_bench - ${1:-50} 10" 2>&1 | tee "$log"
  grep -a -o 'BENCH-RESULT .*' "$log" | sed 's/^BENCH-RESULT //' | tr -d '\r' >docs/bench/microvm-emulated.json
  rm -f "$log"
fi
# microVM networking (virtio-net on a TAP) in the harness, on its own
# (SANDGATE_BENCH_NETWORK_ONLY); the outer guest loads tun for it. (The
# harness prints the command's output on stderr.)
if [ -z "${SANDGATE_BENCH_ONLY:-}" ] || [ "${SANDGATE_BENCH_ONLY:-}" = network ]; then
  log=$(mktemp)
  SANDGATE_BIN_DIR=$b/bin SANDGATE_GUEST_DIR=$b/guest SANDGATE_HARNESS_MODULES=tun \
    SANDGATE_TESTS_TEMPLATES_DIR=$b/tests-rootfs SANDGATE_HARNESS_TEST_TIMEOUT=1800 \
    tests/kvm-harness/harness.sh --with $b/bin/microvm_bench \
    --exec "SANDGATE_BENCH_EMULATED=1 SANDGATE_BENCH_NETWORK_ONLY=1 microvm_bench - 20" 2>&1 | tee "$log"
  grep -a -o 'BENCH-RESULT .*' "$log" | sed 's/^BENCH-RESULT //' | tr -d '\r' |
    sed "s/}\$/,\"build\":\"$preset\"}/" >docs/bench/network-kvm-emulated.json
  rm -f "$log"
fi
[ "${SANDGATE_BENCH_ONLY:-}" = network ] && exit 0

# The code interpreter in the harness (its assets disk then carries the
# code interpreter template): docs/bench/code-interpreter-kvm-emulated.json.
if [ "${SANDGATE_BENCH_ONLY:-}" = code-interpreter ] || [ -z "${SANDGATE_BENCH_ONLY:-}" ]; then
  log=$(mktemp)
  SANDGATE_BIN_DIR=$b/bin SANDGATE_GUEST_DIR=$b/guest SANDGATE_TESTS_TEMPLATES_DIR=$b/tests-rootfs \
    SANDGATE_HARNESS_CACHE=$b/kvm-harness SANDGATE_HARNESS_TEST_TIMEOUT=3000 SANDGATE_HARNESS_CODE_INTERPRETER=1 \
    SANDGATE_HARNESS_ARGS="--template-ready-timeout 900" \
    tests/kvm-harness/harness.sh tests/e2e/bench/kvm_code_interpreter.bench.mjs | tee "$log"
  grep -a -o 'BENCH-RESULT .*' "$log" | sed 's/^BENCH-RESULT //' | tr -d '\r' | head -n 1 |
    sed "s/}\$/,\"build\":\"$preset\"}/" >docs/bench/code-interpreter-kvm-emulated.json
  rm -f "$log"
fi
[ "${SANDGATE_BENCH_ONLY:-}" = code-interpreter ] && exit 0

# Custom templates and durable microVMs, always in the harness (its serve
# mode runs the bench from this host against sandgate inside).
harness_bench() {  # FILE OUT.json
  local log
  log=$(mktemp)
  SANDGATE_BIN_DIR=$b/bin SANDGATE_GUEST_DIR=$b/guest SANDGATE_TESTS_TEMPLATES_DIR=$b/tests-rootfs \
    SANDGATE_HARNESS_CACHE=$b/kvm-harness SANDGATE_HARNESS_TEST_TIMEOUT=3000 \
    tests/kvm-harness/harness.sh "$1" | tee "$log"
  grep -a -o 'BENCH-RESULT .*' "$log" | sed 's/^BENCH-RESULT //' | tr -d '\r' | head -n 1 |
    sed "s/}\$/,\"build\":\"$preset\"}/" >"$2"
  rm -f "$log"
}
if [ -z "${SANDGATE_BENCH_ONLY:-}" ] || [ "${SANDGATE_BENCH_ONLY:-}" = templates ]; then
  harness_bench tests/e2e/bench/kvm_templates.bench.mjs docs/bench/templates-kvm-emulated.json
fi
# Pause to disk (packed memory), resume and fork of 8 (issue 21).
if [ -z "${SANDGATE_BENCH_ONLY:-}" ] || [ "${SANDGATE_BENCH_ONLY:-}" = durable ]; then
  harness_bench tests/e2e/bench/kvm_durable.bench.mjs docs/bench/durable-kvm-emulated.json
fi
