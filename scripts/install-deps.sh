#!/usr/bin/env bash
# Installs every build and run dependency of sandgate from Debian's archive.
# Idempotent: packages already present are skipped, so a second run is fast.
#
#   install-deps.sh            everything: build, tests, fuzzers, benchmarks
#   install-deps.sh --build    only what builds the release binaries (the
#                              build stage of compose/Dockerfile)
set -euo pipefail

BUILD_PKGS=(
  build-essential cmake ninja-build pkg-config ca-certificates
  libboost1.81-dev libssl-dev nlohmann-json3-dev libzstd-dev liburing-dev
  libsqlite3-dev zlib1g-dev libnghttp2-dev libnftables-dev
)
case "${1:-}" in
  --build) PKGS=("${BUILD_PKGS[@]}") ;;
  "") PKGS=(
    "${BUILD_PKGS[@]}" ccache git liblz4-dev sqlite3 doctest-dev
    debootstrap iproute2 util-linux curl
    clang libclang-rt-14-dev
    e2fsprogs cpio busybox-static qemu-system-x86
    docker-registry bash-static apache2-utils zstd
    docker-compose python3-venv python3-yaml
    etcd-server etcd-client
    podman podman-compose runc catatonit golang-github-containernetworking-plugin-dnsname
  ) ;;
  *) echo "usage: install-deps.sh [--build]" >&2; exit 2 ;;
esac
# e2fsprogs: template ext4 images for microVMs; cpio + busybox-static: the
# guest initramfs (scripts/guest-image.sh); qemu-system-x86: the KVM test
# harness (tests/kvm-harness), which runs microVMs under QEMU TCG.
# liblz4-dev: the zswap-like LZ4 baseline of tests/bench/memory_codec_bench.
# docker-registry, bash-static, apache2-utils (htpasswd): the registry the
# template tests pull from, the image they push to it, its Basic auth.
# docker-compose: `docker-compose config` validates compose/ in the
# compose_check test (no container engine is needed for that).
# etcd-server, etcd-client: cluster mode's coordination store (3.4, v3
# API over its JSON gateway); the cluster tests start their own members.
# podman, podman-compose, runc: the compose test builds compose/Dockerfile
# and runs compose.yaml on a real engine (tests/compose/podman_test.py;
# runc because crun refuses cgroup v1 hosts; catatonit, the init podman
# runs for compose.yaml's `init: true`, and the CNI dnsname plugin, which
# resolves the services' names on a compose network (sandgate reaches the
# mock model as mock-model), are only recommended by Debian's podman).
# python3-yaml: that test and compose_check read the compose files.

# node and npm run the end-to-end tests with the official E2B JS SDK; the
# image usually has them, Debian's packages are the fallback.
if [ "${1:-}" != --build ] && ! { command -v node && command -v npm; } >/dev/null; then
  PKGS+=(nodejs npm)
fi

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps: need root (or sudo) to install: ${missing[*]}" >&2; exit 1; }
  SUDO=sudo
fi
echo "install-deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
