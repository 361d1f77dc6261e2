#!/usr/bin/env bash
# Creates the virtual environments the Python SDK e2e suite runs in
# (tests/e2e-python): BUILD_DIR/py-e2b-new from requirements-new.txt (the
# newest e2b on PyPI) and BUILD_DIR/py-e2b-old from requirements-old.txt (an
# older 2.x on the v1 routes), and the OpenAPI fuzzer's (tests/openapi,
# CTest openapi_fuzz): BUILD_DIR/py-schemathesis from
# tests/openapi/requirements.txt. Idempotent: a venv whose installed
# requirements file equals the current one is left alone, so a second run
# is fast and needs no network.
#   usage: scripts/python-venv.sh [BUILD_DIR]   (default build/debug)
set -euo pipefail
cd "$(dirname "$0")/.."

build_dir="${1:-build/debug}"
reqs_dir=tests/e2e-python
python="${PYTHON:-python3}"

mkdir -p "$build_dir"

# make_venv VENV REQUIREMENTS
make_venv() {
  local venv="$1" reqs="$2"
  local stamp="$venv/.sandgate-requirements"
  if [ -x "$venv/bin/python" ] && cmp -s "$reqs" "$stamp"; then
    return 0
  fi
  echo "python-venv: installing $reqs into $venv" >&2
  rm -rf "$venv"
  # python3-venv (scripts/install-deps.sh) provides ensurepip on Debian.
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    --no-input -r "$reqs"
  cp "$reqs" "$stamp"
}

for flavour in new old; do
  make_venv "$build_dir/py-e2b-$flavour" "$reqs_dir/requirements-$flavour.txt"
done
make_venv "$build_dir/py-schemathesis" tests/openapi/requirements.txt
