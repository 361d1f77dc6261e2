#!/usr/bin/env bash
# Builds the microVM guest image that sandgate-vmm boots, from Debian packages
# only: DEST/vmlinuz (the Debian 12 cloud kernel), DEST/kernel/ (that
# package unpacked, kept for the host-side KVM and virtio modules the KVM
# test harness loads), DEST/initramfs.cpio (busybox, the guest modules and
# sandbox-runtime/vmm/guest/init) and DEST/kernel-version.
# The agent is not in the archive: the VMM appends a second cpio holding
# /sandgate-agent. See docs/guest-image.md.
#
# Usage: scripts/guest-image.sh DEST
# Cached: the kernel .deb stays in DEST/cache/ and the resolved kernel
# version in DEST/kernel-version; a run whose inputs (this script, the init,
# busybox, the kernel version) match DEST/stamp does nothing. Set
# GUEST_IMAGE_REFRESH=1 to ask apt for the newest cloud kernel again.
set -euo pipefail

if [ $# -ne 1 ] || [ -z "$1" ]; then
  echo "usage: $0 DEST" >&2
  exit 2
fi
DEST=$1
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SELF="$REPO/scripts/guest-image.sh"
INIT_SRC="$REPO/sandbox-runtime/vmm/guest/init"
BUSYBOX=/bin/busybox
KERNEL_META=linux-image-cloud-amd64

# Guest modules, the ones the guest needs itself; their dependencies are
# added in front of them from each module's .modinfo. virtio_pci and its
# helpers cover a VMM that offers virtio over PCI instead of virtio-mmio.
GUEST_MODULES=(virtio_ring virtio virtio_mmio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci
  virtio_blk virtio_console virtio_net overlay)
# What the init relies on being built into the kernel.
BUILTIN_CONFIG=(CONFIG_BLK_DEV_INITRD CONFIG_DEVTMPFS CONFIG_TMPFS CONFIG_EXT4_FS CONFIG_SERIAL_8250
  CONFIG_SERIAL_8250_CONSOLE CONFIG_HVC_DRIVER CONFIG_UNIX98_PTYS CONFIG_PROC_FS CONFIG_SYSFS)

die() {
  echo "guest-image: $*" >&2
  exit 1
}

mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)

# Everything the image is made from, in one line per input.
inputs_key() {
  local kver=$1
  printf 'kernel %s\n' "$kver"
  sha256sum "$SELF" "$INIT_SRC" "$BUSYBOX" | awk '{print $1}'
}

# Fast path: all outputs present and built from the same inputs.
if [ "${GUEST_IMAGE_REFRESH:-0}" != 1 ] && [ -f "$DEST/stamp" ] && [ -f "$DEST/kernel-version" ] &&
  [ -f "$DEST/vmlinuz" ] && [ -f "$DEST/initramfs.cpio" ] && [ -x "$BUSYBOX" ] && [ -f "$INIT_SRC" ]; then
  kver=$(cat "$DEST/kernel-version")
  if [ -d "$DEST/kernel/lib/modules/$kver" ] && [ "$(inputs_key "$kver")" = "$(cat "$DEST/stamp")" ]; then
    exit 0
  fi
fi

[ -f "$INIT_SRC" ] || die "$INIT_SRC not found"

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || die "need root (or sudo) for apt-get"
  SUDO=sudo
fi
export DEBIAN_FRONTEND=noninteractive
apt_updated=0
apt_update_once() {
  if [ "$apt_updated" = 0 ]; then
    apt_updated=1
    # Offline is fine as long as the cache or apt's lists have what we need.
    $SUDO apt-get update -qq >&2 || echo "guest-image: apt-get update failed; carrying on with what apt and $DEST/cache have" >&2
  fi
}

# Tools: busybox-static (the guest's userland), cpio, binutils (objcopy reads
# each module's .modinfo; there is no modules.dep and no modinfo to ask).
missing=()
for p in busybox-static cpio binutils; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "guest-image: installing ${missing[*]}" >&2
  apt_update_once
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi
[ -x "$BUSYBOX" ] || die "$BUSYBOX missing after installing busybox-static"

# --- kernel -----------------------------------------------------------------

mkdir -p "$DEST/cache"

# Prints the versioned kernel package the meta package depends on, e.g.
# linux-image-6.1.0-57-cloud-amd64.
resolve_kernel_pkg() {
  apt-cache depends "$KERNEL_META" 2>/dev/null |
    sed -n 's/^ *Depends: \(linux-image-[0-9][^ ]*-cloud-amd64\)\(-unsigned\)\?$/\1/p' | head -n1 || true
}

kver=""
if [ "${GUEST_IMAGE_REFRESH:-0}" != 1 ] && [ -f "$DEST/kernel-version" ]; then
  kver=$(cat "$DEST/kernel-version")
fi
if [ -z "$kver" ]; then
  pkg=$(resolve_kernel_pkg)
  if [ -z "$pkg" ]; then
    apt_update_once
    pkg=$(resolve_kernel_pkg)
  fi
  if [ -n "$pkg" ]; then
    kver=${pkg#linux-image-}
  else
    # Offline with a cached package from an earlier run: use it.
    cached=$(find "$DEST/cache" -maxdepth 1 -name 'linux-image-*-cloud-amd64*_amd64.deb' | sort -V | tail -n1)
    [ -n "$cached" ] || die "apt-cache knows no $KERNEL_META and $DEST/cache holds no kernel package"
    kver=$(dpkg-deb -f "$cached" Package)
    kver=${kver#linux-image-}
    kver=${kver%-unsigned}
  fi
fi

# The .deb for $kver in the cache, signed or unsigned, downloading it if
# need be.
kernel_deb() {
  local f
  for f in "$DEST/cache/linux-image-${kver}_"*_amd64.deb "$DEST/cache/linux-image-${kver}-unsigned_"*_amd64.deb; do
    [ -f "$f" ] && { echo "$f"; return 0; }
  done
  local p
  for p in "linux-image-$kver" "linux-image-$kver-unsigned"; do
    # APT::Sandbox::User=root: _apt may not be able to write into DEST.
    if (cd "$DEST/cache" && apt-get download -qq -o APT::Sandbox::User=root "$p" >&2); then
      for f in "$DEST/cache/${p}_"*_amd64.deb; do
        [ -f "$f" ] && { echo "$f"; return 0; }
      done
    fi
  done
  return 1
}

if [ ! -f "$DEST/kernel/boot/vmlinuz-$kver" ] || [ ! -d "$DEST/kernel/lib/modules/$kver" ]; then
  deb=$(kernel_deb) || {
    apt_update_once
    deb=$(kernel_deb) || die "cannot download linux-image-$kver (nor -unsigned) with apt-get download"
  }
  echo "guest-image: unpacking $(basename "$deb")" >&2
  rm -rf "$DEST/kernel.tmp"
  dpkg-deb -x "$deb" "$DEST/kernel.tmp"
  [ -f "$DEST/kernel.tmp/boot/vmlinuz-$kver" ] || die "$(basename "$deb") holds no boot/vmlinuz-$kver"
  rm -rf "$DEST/kernel"
  mv "$DEST/kernel.tmp" "$DEST/kernel"
fi

KDIR="$DEST/kernel/lib/modules/$kver"
CONFIG="$DEST/kernel/boot/config-$kver"
[ -f "$CONFIG" ] || die "$CONFIG missing"
for c in "${BUILTIN_CONFIG[@]}"; do
  grep -qx "$c=y" "$CONFIG" || die "$c is not built into $kver; the guest init needs it"
done

# --- modules ----------------------------------------------------------------

# Module name (dashes as underscores, as in .modinfo depends) -> path.
declare -A MOD_PATH=()
while IFS= read -r -d '' ko; do
  n=$(basename "$ko" .ko)
  MOD_PATH[${n//-/_}]=$ko
done < <(find "$KDIR/kernel" -name '*.ko' -print0)

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

mod_depends() {
  objcopy -O binary -j .modinfo "$1" "$TMP/modinfo"
  tr '\0' '\n' <"$TMP/modinfo" | sed -n 's/^depends=//p' | tr ',' ' '
}

declare -A VISITED=()
ORDER=()
visit() {
  local m=${1//-/_} d
  [ -z "${VISITED[$m]:-}" ] || return 0
  VISITED[$m]=1
  if [ -z "${MOD_PATH[$m]:-}" ]; then
    grep -q "/${m}.ko\$\|/${m//_/-}.ko\$" "$KDIR/modules.builtin" ||
      die "module $m is neither in $KDIR/kernel nor built in"
    return 0
  fi
  for d in $(mod_depends "${MOD_PATH[$m]}"); do
    visit "$d"
  done
  ORDER+=("$m")
}
for m in "${GUEST_MODULES[@]}"; do
  visit "$m"
done

# --- initramfs --------------------------------------------------------------

ROOT="$TMP/root"
mkdir -p "$ROOT"/{bin,sbin,usr/bin,usr/sbin,dev,proc,sys,mnt/lower,mnt/rw,mnt/root,lib/modules}
cp "$BUSYBOX" "$ROOT/bin/busybox"
while IFS= read -r applet; do
  case "$applet" in
    */*) [ -e "$ROOT/$applet" ] || ln -s /bin/busybox "$ROOT/$applet" ;;
  esac
done < <("$BUSYBOX" --list-full)
install -m 0755 "$INIT_SRC" "$ROOT/init"
: >"$ROOT/lib/modules/load-order"
for m in "${ORDER[@]}"; do
  ko=$(basename "${MOD_PATH[$m]}")
  cp "${MOD_PATH[$m]}" "$ROOT/lib/modules/$ko"
  echo "$ko" >>"$ROOT/lib/modules/load-order"
done

# Fixed timestamps and inode numbers, owner root: the same inputs give the
# same bytes.
find "$ROOT" -exec touch -h -d @0 {} +
(cd "$ROOT" && find . -mindepth 1 -print0 | LC_ALL=C sort -z |
  cpio -o -0 -H newc -R 0:0 --reproducible --quiet) >"$DEST/initramfs.cpio.tmp"
mv "$DEST/initramfs.cpio.tmp" "$DEST/initramfs.cpio"

cp "$DEST/kernel/boot/vmlinuz-$kver" "$DEST/vmlinuz.tmp"
mv "$DEST/vmlinuz.tmp" "$DEST/vmlinuz"
echo "$kver" >"$DEST/kernel-version"
inputs_key "$kver" >"$DEST/stamp"
echo "guest-image: $DEST: kernel $kver, modules: ${ORDER[*]}" >&2
