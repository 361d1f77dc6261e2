#!/usr/bin/env bash
# The README's test command: installs what is missing, builds everything
# (debug, with tests) and runs every test with CTest. The base template the
# integration tests use, and the code interpreter's, are built once into
# the build tree (debootstrap and apt, about two minutes on first run)
# before the tests start, so tests never race to build them.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" -ne 0 ]; then
  echo "the tests need root (namespaces, cgroups, overlay mounts); re-run with sudo" >&2
  exit 1
fi
scripts/install-deps.sh
(cd tests/e2e && npm ci --no-audit --no-fund --loglevel=error)
scripts/python-venv.sh build/debug
cmake --preset debug -DSANDGATE_TESTS=ON >/dev/null
cmake --build --preset debug -j"$(nproc)"
build/debug/bin/sandgate template build --templates-dir build/debug/tests-rootfs
# The code interpreter template (apt over base, about a minute first; then
# cached): built here so that no test server builds it on its own.
build/debug/bin/sandgate template build code-interpreter-v1 --templates-dir build/debug/tests-rootfs
# microVMs boot the template as an ext4 image and the guest image (kernel +
# initramfs, from Debian packages); both are cached.
build/debug/bin/sandgate template image --templates-dir build/debug/tests-rootfs >/dev/null
scripts/guest-image.sh build/debug/guest
export SANDGATE_TEST_ROOTFS="$PWD/build/debug/tests-rootfs/base"
# -j2: the compose engine test beside the others, which still run one at a
# time (tests/CMakeLists.txt, sg_one_at_a_time).
ctest --preset debug -j2 "$@"
