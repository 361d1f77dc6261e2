#!/usr/bin/env bash
# The replay benchmark (docs/replay.md): builds the release configuration and
# runs tests/bench/replay/replay.mjs; arguments go to it (later ones win).
# Default: 8 sandboxes per bundled trajectory, policies none, pause,
# offload and audit on the process backend, model and tool times as
# recorded (about 12 minutes); the report and the M(t) plot go to
# docs/bench/replay.json and docs/bench/replay.svg (committed: the latest).
#   scripts/replay.sh --mode group --policies none,offload --name replay-group8
#   scripts/replay.sh --n 16 --policies none,offload --name replay-rollout16
#   scripts/replay.sh --runtime kvm --policies none,pause,offload   # where KVM runs microVMs
#   scripts/replay.sh --trajectories notebook --policies none,offload --name replay-notebook
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake --preset release -DSANDGATE_TESTS=ON >/dev/null
cmake --build --preset release -j"$(nproc)" --target sandgate sandgate-agent sandgate-vmm
build/release/bin/sandgate template build --templates-dir build/release/tests-rootfs >/dev/null
# The notebook trajectory runs in the code interpreter's template (apt over
# base, about a minute the first time).
case " $* " in
  *notebook*) build/release/bin/sandgate template build code-interpreter-v1 --templates-dir build/release/tests-rootfs >/dev/null ;;
esac
(cd tests/e2e && npm ci --no-audit --no-fund --loglevel=error)
SANDGATE_BIN="$PWD/build/release/bin/sandgate" SANDGATE_TESTS_TEMPLATES_DIR="$PWD/build/release/tests-rootfs" \
  node tests/bench/replay/replay.mjs --n 8 --time-scale 1 --policies none,pause,offload,audit --out docs/bench "$@"
