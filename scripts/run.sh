#!/usr/bin/env bash
# The README's run command: installs what is missing, builds sandgate
# (release) and starts it on localhost with embedded SQLite and the best
# backend available. Extra arguments go to `sandgate serve`.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" -ne 0 ]; then
  echo "sandgate needs root for the process backend (namespaces, cgroups, overlay mounts); re-run with sudo" >&2
  exit 1
fi
scripts/install-deps.sh
cmake --preset release -DSANDGATE_TESTS=OFF >/dev/null
cmake --build --preset release -j"$(nproc)" --target sandgate sandgate-agent
exec build/release/bin/sandgate serve "$@"
