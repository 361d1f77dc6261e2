#!/usr/bin/env bash
# Creates the virtual environments the Python SDK e2e suite runs in
# (tests/e2e-python): BUILD_DIR/py-e2b-new from requirements-new.txt (the
# newest e2b on PyPI) and BUILD_DIR/py-e2b-old from requirements-old.txt (an
# older 2.x on the v1 routes). Idempotent: a venv whose installed
# requirements file equals the current one is left alone, so a second run
# is fast and needs no network.
#   usage: scripts/python-venv.sh [BUILD_DIR]   (default build/debug)
set -euo pipefail
cd "$(dirname "$0")/.."

build_dir="${1:-build/debug}"
reqs_dir=tests/e2e-python
python="${PYTHON:-python3}"

mkdir -p "$build_dir"
for flavour in new old; do
  venv="$build_dir/py-e2b-$flavour"
  reqs="$reqs_dir/requirements-$flavour.txt"
  stamp="$venv/.sandgate-requirements"
  if [ -x "$venv/bin/python" ] && cmp -s "$reqs" "$stamp"; then
    continue
  fi
  echo "python-venv: installing $reqs into $venv" >&2
  rm -rf "$venv"
  # python3-venv (scripts/install-deps.sh) provides ensurepip on Debian.
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    --no-input -r "$reqs"
  cp "$reqs" "$stamp"
done
