#!/usr/bin/env bash
# Checks compose/ (the Dockerfiles and compose files) without a container
# engine: tests/compose/check_compose.py, also run by CTest as
# compose_check; docs/compose.md, "What is verified", says what it covers.
# Defaults fit a tree built by scripts/test.sh; arguments replace them.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -eq 0 ]; then
  set -- --bin-dir build/debug/bin --templates-dir build/debug/tests-rootfs --sample-output /out/guest=build/debug/guest
fi
exec python3 -B tests/compose/check_compose.py "$@"
