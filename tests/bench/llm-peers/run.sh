#!/usr/bin/env bash
# sandgate's model API proxy next to the LiteLLM proxy and Portkey's gateway,
# all in front of the same mock upstream, driven by the same client
# (bench.mjs says what is measured and how). Installs the peers at the pinned
# versions (LiteLLM into build/llm-peers-venv, Portkey into node_modules/
# here; both skipped when already in place), builds sandgate's release
# configuration, runs the benchmark and writes docs/bench/llm-peers.json and
# docs/bench/llm-peers.md. Loopback only; every phase is bounded.
#   tests/bench/llm-peers/run.sh            # full run, a few minutes
#   QUICK=1 tests/bench/llm-peers/run.sh    # a few requests per phase
#   SANDGATE_BIN=... (a prebuilt binary; skips the build) PEERS=sandgate,portkey
# Needs root (sandgate serve makes its cgroup), node 20+, python3 with venv,
# and the registries for the first install.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
cd "$root"

venv="$root/build/llm-peers-venv"
if ! "$venv/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(m.version("litellm") != sys.argv[1])' \
     "$(sed -n 's/^litellm\[proxy\]==//p' "$here/requirements.txt")" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q -r "$here/requirements.txt"
fi
if ! node -e 'process.exit(require(process.argv[1]).version === "1.15.2" ? 0 : 1)' \
     "$here/node_modules/@portkey-ai/gateway/package.json" 2>/dev/null; then
  (cd "$here" && npm ci --no-audit --no-fund --loglevel=error)
fi

if [[ -z "${SANDGATE_BIN:-}" ]]; then
  cmake --preset release >/dev/null
  cmake --build --preset release -j"$(nproc)" --target sandgate sandgate-agent
  SANDGATE_BIN="$root/build/release/bin/sandgate"
  SANDGATE_BUILD_TYPE="$(sed -n 's/^CMAKE_BUILD_TYPE:STRING=//p' build/release/CMakeCache.txt)"
fi
# No sandbox is created; serve only wants a templates directory, so an
# existing test template (the debug build's) is reused before building one.
templates="${SANDGATE_TEMPLATES_DIR:-$(dirname "$(dirname "$SANDGATE_BIN")")/tests-rootfs}"
if [[ -z "${SANDGATE_TEMPLATES_DIR:-}" && ! -d "$templates/base" && -d build/debug/tests-rootfs/base ]]; then
  templates="$root/build/debug/tests-rootfs"
fi
if [[ ! -d "$templates/base" ]]; then
  "$SANDGATE_BIN" template build --templates-dir "$templates" >/dev/null
fi

mkdir -p docs/bench
SANDGATE_BIN="$SANDGATE_BIN" SANDGATE_TEMPLATES_DIR="$templates" SANDGATE_BUILD_TYPE="${SANDGATE_BUILD_TYPE:-}" \
  LITELLM_BIN="$venv/bin/litellm" \
  node "$here/bench.mjs" docs/bench/llm-peers.json docs/bench/llm-peers.md
