#!/usr/bin/env bash
# microVM benchmark (tests/bench/microvm_bench.cpp): boot to agent-ready,
# clone-from-snapshot create latency (p50/p99 over 50 creates), host memory
# per idle microVM. Where this host's KVM can run microVMs it runs directly
# and writes docs/bench/microvm.json; otherwise it runs inside the KVM test
# harness (QEMU TCG) and writes docs/bench/microvm-emulated.json: those
# timings are emulated and say nothing about real KVM speed.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake --preset release -DSANDGATE_TESTS=ON >/dev/null
cmake --build --preset release -j"$(nproc)" --target microvm_bench sandgate sandgate-agent sandgate-vmm
build/release/bin/sandgate template build --templates-dir build/release/tests-rootfs >/dev/null
build/release/bin/sandgate template image --templates-dir build/release/tests-rootfs >/dev/null
scripts/guest-image.sh build/release/guest
mkdir -p docs/bench
if build/release/bin/sandgate kvm check; then
  state=$(mktemp -d)
  trap 'rm -rf "$state"' EXIT
  SANDGATE_KVM_BIN_DIR=build/release/bin SANDGATE_GUEST_DIR=build/release/guest \
    SANDGATE_TEST_ROOTFS=build/release/tests-rootfs/base SANDGATE_KVM_STATE="$state" \
    build/release/bin/microvm_bench docs/bench/microvm.json "${1:-50}" 10
else
  log=$(mktemp)
  SANDGATE_BIN_DIR=build/release/bin SANDGATE_GUEST_DIR=build/release/guest \
    SANDGATE_TESTS_TEMPLATES_DIR=build/release/tests-rootfs SANDGATE_HARNESS_TEST_TIMEOUT=1800 \
    tests/kvm-harness/harness.sh --with build/release/bin/microvm_bench \
    --exec "SANDGATE_BENCH_EMULATED=1 microvm_bench - ${1:-50} 10" | tee "$log"
  grep -a -o 'BENCH-RESULT .*' "$log" | sed 's/^BENCH-RESULT //' | tr -d '\r' >docs/bench/microvm-emulated.json
  rm -f "$log"
fi
