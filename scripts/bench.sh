#!/usr/bin/env bash
# Builds the release configuration with the benchmarks and runs them.
# Results (committed: the latest numbers): docs/bench/create-latency.json,
# docs/bench/commands.json, docs/bench/llm-proxy.json, docs/bench/memory-codecs.json,
# docs/bench/memory-restore.json, docs/bench/vmm-seccomp.json, docs/bench/templates.json,
# docs/bench/code-interpreter.json, docs/bench/durable.json, docs/bench/cluster.json.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake --preset release -DSANDGATE_TESTS=ON >/dev/null
cmake --build --preset release -j"$(nproc)" --target create_latency_bench llm_proxy_bench memory_codec_bench memory_restore_bench egress_bench vmm_seccomp_bench sandgate sandgate-agent
build/release/bin/sandgate template build --templates-dir build/release/tests-rootfs >/dev/null
build/release/bin/sandgate template build code-interpreter-v1 --templates-dir build/release/tests-rootfs >/dev/null
mkdir -p docs/bench
build/release/bin/create_latency_bench docs/bench/create-latency.json "${1:-50}"
build/release/bin/llm_proxy_bench docs/bench/llm-proxy.json
build/release/bin/egress_bench docs/bench/egress.json
build/release/bin/vmm_seccomp_bench docs/bench/vmm-seccomp.json
build/release/bin/memory_codec_bench docs/bench/memory-codecs.json
build/release/bin/memory_restore_bench docs/bench/memory-restore.json
(cd tests/e2e && npm ci --no-audit --no-fund --loglevel=error)
SANDGATE_BIN="$PWD/build/release/bin/sandgate" SANDGATE_TESTS_TEMPLATES_DIR="$PWD/build/release/tests-rootfs" \
  node tests/e2e/bench/commands.bench.mjs docs/bench/commands.json
SANDGATE_BIN="$PWD/build/release/bin/sandgate" SANDGATE_TESTS_TEMPLATES_DIR="$PWD/build/release/tests-rootfs" \
  node tests/e2e/bench/egress.bench.mjs docs/bench/egress-sandbox.json
SANDGATE_BIN="$PWD/build/release/bin/sandgate" SANDGATE_TESTS_TEMPLATES_DIR="$PWD/build/release/tests-rootfs" \
  node tests/e2e/bench/network.bench.mjs docs/bench/network.json
SANDGATE_BIN="$PWD/build/release/bin/sandgate" SANDGATE_TESTS_TEMPLATES_DIR="$PWD/build/release/tests-rootfs" \
  node tests/e2e/bench/templates.bench.mjs docs/bench/templates.json
SANDGATE_BIN="$PWD/build/release/bin/sandgate" SANDGATE_TESTS_TEMPLATES_DIR="$PWD/build/release/tests-rootfs" \
  node tests/e2e/bench/code_interpreter.bench.mjs docs/bench/code-interpreter.json 50
SANDGATE_BIN="$PWD/build/release/bin/sandgate" SANDGATE_TESTS_TEMPLATES_DIR="$PWD/build/release/tests-rootfs" \
  node tests/e2e/bench/durable.bench.mjs docs/bench/durable.json 50 20
SANDGATE_BIN="$PWD/build/release/bin/sandgate" SANDGATE_TESTS_TEMPLATES_DIR="$PWD/build/release/tests-rootfs" \
  node tests/e2e/bench/cluster.bench.mjs docs/bench/cluster.json 48
node tests/e2e/bench/sdk_floor.bench.mjs | tee docs/bench/sdk-floor.txt
