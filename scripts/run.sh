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
cmake --build --preset release -j"$(nproc)" --target sandgate sandgate-agent sandgate-vmm
# Where KVM can run microVMs, the kvm backend needs the guest image (Debian
# cloud kernel + initramfs, fetched and built once, cached in the data dir).
data_dir=${SANDGATE_DATA_DIR:-${XDG_DATA_HOME:-$HOME/.local/share}/sandgate}
for ((i = 1; i <= $#; i++)); do
  case "${!i}" in
  --data-dir) j=$((i + 1)); data_dir=${!j} ;;
  --data-dir=*) data_dir=${!i#--data-dir=} ;;
  esac
done
if build/release/bin/sandgate kvm check >/dev/null; then
  scripts/guest-image.sh "$data_dir/guest"
fi
exec build/release/bin/sandgate serve "$@"
