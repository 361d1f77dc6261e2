#!/usr/bin/env bash
# KVM test harness for machines without /dev/kvm: boots an outer Linux guest
# under QEMU TCG (-cpu max emulates AMD SVM, so kvm_amd loads inside and
# /dev/kvm works there), runs `sandgate serve` inside it, forwards its port to
# 127.0.0.1 on the host with QEMU user networking, and runs E2B SDK e2e test
# files from the host against it (SANDGATE_E2E_URL / SANDGATE_E2E_KEY).
# sandgate's model API proxy goes to a mock model server the harness runs on
# the host (model-upstream.mjs), reached from the guest as 10.0.2.2
# (SANDGATE_E2E_MODEL_URL / SANDGATE_E2E_MODEL_KEY for the tests).
# Exits with the tests' status (or non-zero if the guest never got that far,
# or sandgate did not stop cleanly after passing tests); 75 when the outer
# guest's kernel stopped running (no heartbeat, no answer on its control
# port: QEMU's TCG froze it, docs/kvm-harness.md), which attempts.sh takes
# as the one failure worth a fresh boot.
# See docs/kvm-harness.md; the recipe is in shared/notes/kvm-in-tcg.md.
#
# usage: tests/kvm-harness/harness.sh [TEST_FILE...]
#          (default tests/e2e/kvm.test.mjs and tests/e2e/kvm_llm.test.mjs)
#        tests/kvm-harness/harness.sh [--with FILE]... --exec 'SHELL COMMAND'
# The second form runs the command inside the outer guest instead of sandgate
# (after the same set-up; FILEs, e.g. a doctest binary, are copied with their
# libraries to /opt/sandgate/extra, which is on PATH) and exits with its
# status; its output is on the serial console, which is printed.
#
# Environment (CTest sets the first three and the cache):
#   SANDGATE_BIN_DIR              sandgate, sandgate-agent, sandgate-vmm (default build/dev/bin)
#   SANDGATE_GUEST_DIR            scripts/guest-image.sh's DEST: vmlinuz, initramfs.cpio,
#                                 kernel/ (the unpacked kernel .deb; its modules boot the
#                                 outer guest too). The harness runs guest-image.sh on it first.
#   SANDGATE_TESTS_TEMPLATES_DIR  templates dir holding base/ (and base.ext4 for kvm)
#   SANDGATE_HARNESS_RUNTIME      kvm|process|auto (default: kvm if sandgate-vmm is in
#                                 SANDGATE_BIN_DIR and `sandgate --help` lists
#                                 --guest-dir, else process)
#   SANDGATE_HARNESS_CACHE        cache of initramfs and assets disk (default BIN_DIR/../kvm-harness)
#   SANDGATE_HARNESS_LOG          the serial log is copied here (default CACHE/console.log)
#   SANDGATE_HARNESS_MEM_MB, SANDGATE_HARNESS_CPUS   outer guest size (4096, 2)
#   SANDGATE_HARNESS_BOOT_TIMEOUT, SANDGATE_HARNESS_TEST_TIMEOUT   seconds (240, 480)
#   SANDGATE_HARNESS_MODULES      extra kernel modules to load (names, e.g. "tun vhost_vsock")
#   SANDGATE_HARNESS_CODE_INTERPRETER=1  the assets disk carries the code interpreter
#                                 template too (its layers and, for kvm, its merged
#                                 image, made here: `sandgate template build|image
#                                 code-interpreter-v1`); otherwise sandgate runs with
#                                 --code-interpreter off
#   SANDGATE_HARNESS_ARGS         extra `sandgate serve` arguments (no commas); they come
#                                 after the harness's own, so e.g. --openai-base-url
#                                 there replaces the mock upstream
#   SANDGATE_HARNESS_LOG_LEVEL    sandgate --log-level inside (default info)
#   SANDGATE_HARNESS_KEEP=1       keep the run's temp dir (scratch disk, serial log)
#   SANDGATE_HARNESS_SILENCE_S    seconds without the outer guest's heartbeat before it is
#                                 asked whether it still runs (default 90; 20 while it boots)
#   SANDGATE_HARNESS_TEST_FREEZE  for the harness's own test (kvm_harness_freeze): "run":
#                                 once the --exec command starts, stop the outer guest's
#                                 vCPUs from QEMU's monitor, as the TCG freeze does; "boot":
#                                 the same on the first boot, before the command starts
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
t_start=$(date +%s.%N)
elapsed() { awk -v a="$t_start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
log() { echo "kvm-harness [$(elapsed) s]: $*" >&2; }
fail() {
  log "FAILED: $*"
  exit 1
}
frozen() {
  log "FROZEN: $*"
  exit 75
}

bin_dir=$(cd "${SANDGATE_BIN_DIR:-$root/build/dev/bin}" && pwd)
guest_dir=${SANDGATE_GUEST_DIR:-$bin_dir/../guest}
templates_dir=${SANDGATE_TESTS_TEMPLATES_DIR:-$bin_dir/../tests-rootfs}
cache=${SANDGATE_HARNESS_CACHE:-$bin_dir/../kvm-harness}
mem_mb=${SANDGATE_HARNESS_MEM_MB:-4096}
cpus=${SANDGATE_HARNESS_CPUS:-2}
boot_timeout=${SANDGATE_HARNESS_BOOT_TIMEOUT:-240}
test_timeout=${SANDGATE_HARNESS_TEST_TIMEOUT:-480}
log_level=${SANDGATE_HARNESS_LOG_LEVEL:-info}
silence_s=${SANDGATE_HARNESS_SILENCE_S:-90}
boot_silence_s=20
max_boots=5
[[ $silence_s =~ ^[1-9][0-9]*$ ]] || fail "SANDGATE_HARNESS_SILENCE_S must be a positive number of seconds, not '$silence_s'"
exec_cmd=''
extras=()
tests=()
while [ $# -gt 0 ]; do
  case "$1" in
    --exec) exec_cmd=${2:?--exec needs a command}; shift 2 ;;
    --with) extras+=("$(realpath "${2:?--with needs a file}")"); shift 2 ;;
    *) tests+=("$1"); shift ;;
  esac
done
[ ${#tests[@]} -gt 0 ] || tests=("$root/tests/e2e/kvm.test.mjs" "$root/tests/e2e/kvm_llm.test.mjs")

for tool in qemu-system-x86_64 busybox cpio mkfs.ext4 node strip ldd flock; do
  command -v "$tool" >/dev/null || fail "$tool not found: scripts/install-deps.sh installs qemu-system-x86, busybox-static, cpio, e2fsprogs, binutils and node"
done
if [ ! -x "$bin_dir/sandgate" ] || [ ! -x "$bin_dir/sandgate-agent" ]; then
  fail "no sandgate/sandgate-agent in $bin_dir: build first or set SANDGATE_BIN_DIR"
fi
[ -f "$templates_dir/base/.sandgate-template" ] ||
  fail "no base template in $templates_dir: run '$bin_dir/sandgate template build --templates-dir $templates_dir' (or set SANDGATE_TESTS_TEMPLATES_DIR)"
# guest-image.sh returns at once when its DEST is up to date.
if [ -x "$root/scripts/guest-image.sh" ]; then
  "$root/scripts/guest-image.sh" "$guest_dir" >&2 || fail "scripts/guest-image.sh $guest_dir failed"
fi
[ -f "$guest_dir/vmlinuz" ] || fail "no $guest_dir/vmlinuz (scripts/guest-image.sh DEST builds it)"
guest_dir=$(cd "$guest_dir" && pwd)
if [ -f "$guest_dir/kernel-version" ]; then
  moddir=$guest_dir/kernel/lib/modules/$(cat "$guest_dir/kernel-version")
else
  moddir=$(find "$guest_dir/kernel/lib/modules" -mindepth 1 -maxdepth 1 -type d 2>/dev/null | head -n 1)
fi
[ -d "$moddir/kernel" ] || fail "no $moddir/kernel: the outer guest boots the guest image's kernel and loads its modules"

runtime=${SANDGATE_HARNESS_RUNTIME:-}
if [ -z "$runtime" ]; then
  # The kvm runtime is in this build when sandgate-vmm is built and
  # sandgate knows --guest-dir.
  if [ ! -x "$bin_dir/sandgate-vmm" ]; then
    runtime=process why="no sandgate-vmm in $bin_dir"
  # (The help is read whole first: `--help | grep -q` under pipefail fails
  # whenever grep exits before sandgate has written its last line.)
  elif help=$("$bin_dir/sandgate" --help 2>&1 || true) && [[ $help != *--guest-dir* ]]; then
    runtime=process why="sandgate --help lists no --guest-dir"
  else
    runtime=kvm why="sandgate-vmm is built and sandgate takes --guest-dir"
  fi
  log "runtime $runtime ($why; SANDGATE_HARNESS_RUNTIME=kvm|process overrides)"
fi
case "$runtime" in kvm | process | auto) ;; *) fail "SANDGATE_HARNESS_RUNTIME must be kvm, process or auto, not '$runtime'" ;; esac

mkdir -p "$cache"
cache=$(cd "$cache" && pwd)
console_copy=${SANDGATE_HARNESS_LOG:-$cache/console.log}
work=$(mktemp -d "${TMPDIR:-/tmp}/sg-kvm-harness.XXXXXX")
qemu_pid=
model_pid=
tests_pid=
# QEMU killed (at exit, and after a frozen boot, before the next).
kill_qemu() {
  kill -KILL "$qemu_pid" 2>/dev/null || true
  wait "$qemu_pid" 2>/dev/null || true
  qemu_pid=
}
# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() {
  if [ -n "$tests_pid" ] && kill -0 "$tests_pid" 2>/dev/null; then
    kill -TERM "$tests_pid" 2>/dev/null || true
    wait "$tests_pid" 2>/dev/null || true
  fi
  if [ -n "$qemu_pid" ] && kill -0 "$qemu_pid" 2>/dev/null; then kill_qemu; fi
  if [ -n "$model_pid" ] && kill -0 "$model_pid" 2>/dev/null; then
    kill -TERM "$model_pid" 2>/dev/null || true
    wait "$model_pid" 2>/dev/null || true
  fi
  if [ -f "$work/console.log" ]; then cp "$work/console.log" "$console_copy" 2>/dev/null || true; fi
  if [ -n "${SANDGATE_HARNESS_KEEP:-}" ]; then
    log "kept $work (scratch.ext4: sandgate's data dir; loop-mount it to look inside)"
  else
    rm -rf "$work"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# A cached artefact is rebuilt when the fingerprint of its inputs (names,
# sizes, mtimes, plus the build recipe: this script and outer-init) changes.
fingerprint() {
  { stat -L -c '%n %s %Y' "$here/harness.sh" "$here/outer-init" "$@"; echo "runtime=$runtime modules=${SANDGATE_HARNESS_MODULES:-}"; } | sha256sum | cut -c1-16
}

# Two runs at once build the cache one after the other (a run's QEMU keeps
# its own open copies: rebuilt artefacts are new files, not rewrites).
exec 9>"$cache/lock"
flock -w 900 9 || fail "$cache is locked by another harness run for 900 s"

# --- kernel modules: the wanted ones plus their dependencies, in load order.
declare -A mod_path=() mod_seen=()
while IFS= read -r f; do
  n=${f##*/}
  n=${n%.ko}
  mod_path[${n//-/_}]=$f
done < <(find "$moddir/kernel" -name '*.ko')
mod_order=()
add_module() {
  local n=${1//-/_} d deps
  [ -n "${mod_seen[$n]:-}" ] && return
  mod_seen[$n]=1
  [ -n "${mod_path[$n]:-}" ] || fail "kernel module $n not found under $moddir"
  deps=$(tr '\0' '\n' <"${mod_path[$n]}" | sed -n 's/^depends=//p' | head -n 1)
  for d in ${deps//,/ }; do add_module "$d"; done
  mod_order+=("${mod_path[$n]}")
}
# shellcheck disable=SC2086 # a word list
for m in kvm_amd virtio_pci virtio_net virtio_blk overlay ${SANDGATE_HARNESS_MODULES:-}; do add_module "$m"; done

# --- the outer initramfs: busybox, /init, modules, the binaries with their
# shared libraries (stripped: 15x smaller, faster to boot) and, for the kvm
# runtime, the nested guest's kernel and initramfs.
vmm=()
[ -x "$bin_dir/sandgate-vmm" ] && vmm=("$bin_dir/sandgate-vmm")
# kvm-pin (kvm-pin.c: why the outer guest holds one VM open from boot).
pin=$cache/kvm-pin
if [ "$(cat "$pin.key" 2>/dev/null)" != "$(fingerprint "$here/kvm-pin.c")" ]; then
  ${CC:-cc} -O2 -Wall -o "$pin" "$here/kvm-pin.c" || fail "could not compile $here/kvm-pin.c"
  fingerprint "$here/kvm-pin.c" >"$pin.key"
fi
vmm+=("$pin")
guest_files=()
if [ "$runtime" != process ]; then
  for f in vmlinuz initramfs.cpio; do
    [ -f "$guest_dir/$f" ] || fail "no $guest_dir/$f: the kvm runtime boots it (scripts/guest-image.sh builds it)"
    guest_files+=("$guest_dir/$f")
  done
fi
initrd=$cache/initramfs-$runtime${extras:+-with}.cpio
# mkfs.ext4: the kvm runtime makes a built template's image with it.
mkfs_bin=$(readlink -f "$(command -v mkfs.ext4)")
initrd_key=$(fingerprint "$(command -v busybox)" "$mkfs_bin" "$bin_dir/sandgate" "$bin_dir/sandgate-agent" "${vmm[@]}" "${guest_files[@]}" "${mod_order[@]}" "${extras[@]}")
if [ "$(cat "$initrd.key" 2>/dev/null)" != "$initrd_key" ]; then
  log "building the outer initramfs"
  st=$work/initramfs
  mkdir -p "$st"/{bin,sbin,usr/bin,usr/sbin,etc/sg-harness,proc,sys,dev,opt/sandgate/bin,opt/sandgate/guest,opt/sandgate/extra,lib64}
  cp "$(command -v busybox)" "$st/bin/busybox"
  for a in $("$st/bin/busybox" --list-full); do [ -e "$st/$a" ] || ln -s /bin/busybox "$st/$a"; done
  install -m 0755 "$here/outer-init" "$st/init"
  : >"$st/etc/sg-harness/modules"
  for f in "${mod_order[@]}"; do
    rel=lib/modules/${moddir##*/}/${f#"$moddir"/}
    mkdir -p "$st/${rel%/*}"
    cp "$f" "$st/$rel"
    echo "/$rel" >>"$st/etc/sg-harness/modules"
  done
  for b in "$bin_dir/sandgate" "$bin_dir/sandgate-agent" "${vmm[@]}" "${extras[@]}"; do
    dir=bin
    [ "${b%/*}" = "$bin_dir" ] || [ "$b" = "$pin" ] || dir=extra
    strip -o "$st/opt/sandgate/$dir/${b##*/}" "$b" 2>/dev/null || cp "$b" "$st/opt/sandgate/$dir/"
    # Shared libraries at the paths ldd resolved them to, plus the loader.
    { ldd "$b" 2>/dev/null || true; } | { grep -o -E '/[^ ]+' || true; } | while read -r lib; do
      mkdir -p "$st/$(dirname "$lib")"
      [ -e "$st/$lib" ] || cp -L "$lib" "$st/$lib"
    done
  done
  rm -f "$st/sbin/mkfs.ext4"  # never through a busybox link
  cp "$mkfs_bin" "$st/sbin/mkfs.ext4"
  [ -f /etc/mke2fs.conf ] && cp /etc/mke2fs.conf "$st/etc/"
  { ldd "$mkfs_bin" 2>/dev/null || true; } | { grep -o -E '/[^ ]+' || true; } | while read -r lib; do
    mkdir -p "$st/$(dirname "$lib")"
    [ -e "$st/$lib" ] || cp -L "$lib" "$st/$lib"
  done
  for f in "${guest_files[@]}"; do cp "$f" "$st/opt/sandgate/guest/"; done
  printf 'root:x:0:0:root:/root:/bin/sh\n' >"$st/etc/passwd"
  printf 'root:x:0:\n' >"$st/etc/group"
  printf '127.0.0.1 localhost\n::1 localhost\n127.0.1.1 sg-outer\n' >"$st/etc/hosts"
  (cd "$st" && find . -print0 | cpio --null -o -H newc --quiet) >"$initrd.tmp"
  mv "$initrd.tmp" "$initrd"
  echo "$initrd_key" >"$initrd.key"
  rm -rf "$st"
fi

# --- the assets disk (read-only in the guest): templates/base, the process
# runtime's overlay lower layer (and template builds' base), and
# templates/base.ext4 for the kvm runtime. `sandgate template image` returns
# at once when base.ext4 is newer than the template's marker, and rebuilds
# it when the template was rebuilt since (a newer template format).
if [ "$runtime" != process ]; then
  "$bin_dir/sandgate" template image --templates-dir "$templates_dir" >/dev/null ||
    fail "sandgate template image --templates-dir $templates_dir failed"
fi
base_img=$templates_dir/base.ext4
assets=$cache/assets-$runtime.ext4
ext4_in=()
[ "$runtime" != process ] && ext4_in=("$base_img")
ci_dir=''
ci_img=''
if [ "${SANDGATE_HARNESS_CODE_INTERPRETER:-}" = 1 ]; then
  "$bin_dir/sandgate" template build code-interpreter-v1 --templates-dir "$templates_dir" >/dev/null ||
    fail "sandgate template build code-interpreter-v1 --templates-dir $templates_dir failed"
  ci_dir=$templates_dir/code-interpreter-v1
  if [ "$runtime" != process ]; then
    ci_img=$("$bin_dir/sandgate" template image code-interpreter-v1 --templates-dir "$templates_dir") ||
      fail "sandgate template image code-interpreter-v1 --templates-dir $templates_dir failed"
  fi
  assets=$cache/assets-$runtime-ci.ext4
fi
assets_key=$(fingerprint "$templates_dir/base" "$templates_dir/base/.sandgate-template" "${ext4_in[@]}" ${ci_dir:+"$ci_dir/packages.json"} ${ci_img:+"$ci_img"})
if [ "$(cat "$assets.key" 2>/dev/null)" != "$assets_key" ]; then
  log "building the assets disk"
  st=$cache/assets.staging
  rm -rf "$st" "$assets"
  mkdir -p "$st/templates"
  # Hard links where the cache and the templates share a file system.
  # The kvm runtime boots base.ext4, but template builds run their steps
  # in process sandboxes over the base directory on either runtime.
  cp -al "$templates_dir/base" "$st/templates/base" 2>/dev/null || cp -a "$templates_dir/base" "$st/templates/base"
  [ ${#ext4_in[@]} -eq 0 ] || cp -l "${ext4_in[0]}" "$st/templates/base.ext4" 2>/dev/null || cp --sparse=always "${ext4_in[0]}" "$st/templates/base.ext4"
  if [ -n "$ci_dir" ]; then
    # Only the server layer this sandgate embeds (and its image).
    mkdir -p "$st/templates/code-interpreter-v1"
    cp -al "$ci_dir/packages" "$st/templates/code-interpreter-v1/" 2>/dev/null || cp -a "$ci_dir/packages" "$st/templates/code-interpreter-v1/"
    cp -a "$ci_dir/packages.json" "$st/templates/code-interpreter-v1/"
    server_layer=$("$bin_dir/sandgate" template build code-interpreter-v1 --templates-dir "$templates_dir")
    cp -a "$server_layer" "$st/templates/code-interpreter-v1/"
    [ -z "$ci_img" ] || cp -l "$ci_img" "$st/templates/code-interpreter-v1/" 2>/dev/null || cp --sparse=always "$ci_img" "$st/templates/code-interpreter-v1/"
  fi
  mb=$(du -sm "$st" | cut -f1)
  truncate -s "$((mb * 13 / 10 + 128))M" "$assets"
  mkfs.ext4 -q -F -L sg-assets -d "$st" "$assets"
  rm -rf "$st"
  echo "$assets_key" >"$assets.key"
fi

flock -u 9

pdeathsig=
setpriv --pdeathsig KILL true 2>/dev/null && pdeathsig="setpriv --pdeathsig KILL"

# --- the model upstream (serve mode): the mock model server on the host's
# 127.0.0.1, which the guest reaches as 10.0.2.2 (QEMU user networking). It
# holds its port from before the boot, since the serve arguments are fixed
# then. Its provider key, fresh each run, goes into the guest on the scratch
# disk (/srv/scratch/harness/upstream.key): the cached initramfs stays as is.
mkdir -p "$work/seed"
model_args=''
model_url=''
model_key=''
if [ -z "$exec_cmd" ]; then
  model_key=sk-harness-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
  mkdir -p "$work/seed/harness"
  (umask 077 && printf '%s\n' "$model_key" >"$work/seed/harness/upstream.key")
  # The file exists before the job starts: the job's own redirection may
  # come after the first read below (a fresh-clone run here failed so, the
  # read fatal under set -e, on 2026-12-06).
  : >"$work/model-upstream.out"
  SANDGATE_HARNESS_MODEL_KEY=$model_key $pdeathsig node "$here/model-upstream.mjs" >>"$work/model-upstream.out" 2>&1 &
  model_pid=$!
  deadline=$(($(date +%s) + 30))
  model_port=
  while [ -z "$model_port" ]; do
    model_port=$(sed -n 's/^listening \([0-9]*\)$/\1/p' "$work/model-upstream.out")
    [ -n "$model_port" ] && break
    if ! kill -0 "$model_pid" 2>/dev/null || [ "$(date +%s)" -ge "$deadline" ]; then
      sed 's/^/  | /' "$work/model-upstream.out" >&2
      fail "the mock model upstream ($here/model-upstream.mjs) did not start"
    fi
    sleep 0.1
  done
  model_url=http://127.0.0.1:$model_port
  kf=/srv/scratch/harness/upstream.key
  model_args="--openai-base-url http://10.0.2.2:$model_port --openai-key-file $kf"
  model_args+=" --anthropic-base-url http://10.0.2.2:$model_port --anthropic-key-file $kf"
  log "mock model upstream on $model_url (10.0.2.2:$model_port from the guest)"
fi

# --- the scratch disk: sandgate's data dir, fresh each run (sparse), seeded
# with the harness's files.
truncate -s 16G "$work/scratch.ext4"
mkfs.ext4 -q -F -L sg-scratch -d "$work/seed" "$work/scratch.ext4"
mkfifo "$work/ctl.in" "$work/ctl.out"
log "artefacts ready; booting the outer guest (TCG, ${mem_mb} MiB, $cpus vCPUs, runtime $runtime)"

# --- boot. The forwarded port is picked by binding port 0; if another
# process takes it before QEMU binds it, QEMU fails at once and we retry.
args="$model_args${SANDGATE_HARNESS_ARGS:+ $SANDGATE_HARNESS_ARGS}"
[ -n "$ci_dir" ] || args="$args --code-interpreter off"
args=${args# }
cmdline="console=ttyS0 quiet panic=-1 nokaslr sandgate.runtime=$runtime sandgate.loglevel=$log_level${args:+ sandgate.args=${args// /,}}"
[ -z "$exec_cmd" ] || cmdline+=" sandgate.exec=$(printf %s "$exec_cmd" | base64 -w0)"
free_port() { node -e 'const s=require("net").createServer().listen(0,"127.0.0.1",()=>{console.log(s.address().port);s.close()})'; }
start_qemu() {
  port=$(free_port)
  : >"$work/console.log"
  : >"$work/heartbeat.log"
  alive_at=$(date +%s)
  # QEMU dies with this script, even if it is SIGKILLed (a CTest timeout).
  $pdeathsig qemu-system-x86_64 -accel tcg -cpu max -m "$mem_mb" -smp "$cpus" \
    -nodefaults -display none -vga none -no-reboot \
    -kernel "$guest_dir/vmlinuz" -initrd "$initrd" -append "$cmdline" \
    -serial "file:$work/console.log" -serial "pipe:$work/ctl" -serial "file:$work/heartbeat.log" -monitor "unix:$work/monitor.sock,server=on,wait=off" \
    -nic "user,model=virtio-net-pci,hostfwd=tcp:127.0.0.1:$port-:8080" \
    -drive "file=$assets,if=none,id=assets,format=raw,readonly=on" -device virtio-blk-pci,drive=assets,serial=sg-assets \
    -drive "file=$work/scratch.ext4,if=none,id=scratch,format=raw,cache=unsafe" -device virtio-blk-pci,drive=scratch,serial=sg-scratch \
    >"$work/qemu.out" 2>&1 &
  qemu_pid=$!
}

show_console() {
  log "serial console (last ${1:-60} lines; whole log in $console_copy):"
  tail -n "${1:-60}" "$work/console.log" | sed 's/^/  | /' >&2
  [ -s "$work/qemu.out" ] && { log "qemu said:"; sed 's/^/  | /' "$work/qemu.out" >&2; }
  return 0
}

# One command on QEMU's monitor; its answer, without terminal escapes, on
# stdout.
monitor() {
  node -e '
    const c = require("net").connect(process.argv[1]);
    let out = "";
    c.on("data", (d) => { out += d; });
    c.on("connect", () => { c.write(process.argv[2] + "\n"); setTimeout(() => c.end(), 2000); });
    c.on("error", (e) => { out += "monitor: " + e.message + "\n"; });
    c.on("close", () => process.stdout.write(out.replace(/\x1b\[[0-9;]*[A-Za-z]/g, "").replace(/\r/g, "")));
  ' "$work/monitor.sock" "$1" || true
}

# Whether the outer guest's kernel still runs: outer-init writes a
# heartbeat to its third serial port (heartbeat.log) every 5 s, and answers
# "ping N" on its control port with "pong N". After silence_s without a
# heartbeat, or when the tests have failed, it is pinged; no answer in 40 s
# means its kernel is not running (QEMU's TCG livelock, docs/kvm-harness.md).
# silent [SECONDS]: no heartbeat for that long (default silence_s).
silent() {
  local last
  last=$(stat -c %Y "$work/heartbeat.log" 2>/dev/null || echo 0)
  [ "$last" -ge "$alive_at" ] || last=$alive_at
  [ $(($(date +%s) - last)) -ge "${1:-$silence_s}" ]
}
pings=0
# guest_answers [WAIT]: a ping answered within WAIT seconds (default 40).
guest_answers() {
  local wait=${1:-40}
  pings=$((pings + 1))
  timeout 10 sh -c 'echo "ping $2" >"$1"' sh "$work/ctl.in" "$pings" || log "could not write to the guest's control port"
  local end=$(($(date +%s) + wait))
  while [ "$(date +%s)" -lt "$end" ]; do
    if tr -d '\r' <"$work/console.log" | grep -q "^SG-HARNESS: pong $pings\$"; then
      alive_at=$(date +%s)
      return 0
    fi
    sleep 0.5
  done
  log "the outer guest did not answer a ping in $wait s: its kernel is not running"
  log "QEMU's vCPUs:"
  monitor $'info cpus\ninfo registers -a' | grep -E 'CPU|RIP|RSP|RFL|CR0|HLT|halted' | sed 's/^/  | /' >&2 || true
  return 1
}
# check_heartbeat [SILENCE WAIT]: after SILENCE seconds without a
# heartbeat, a ping; returns 1 when the guest is frozen (and 0, with the
# clock reset, when it only was slow). While it boots (before sandgate or
# the command starts) the guest is given 20 s and 15 s: a boot takes about
# 8 s, and a freeze there (seen at the static-key pins) is cheap to retry.
# A guest that answers pings (shell builtins) but writes no heartbeat (a
# fork and exec every 5 s) through two silences in a row is wedged: part of
# its kernel stopped (seen under QEMU's TCG with a nested KVM guest), so it
# can no longer start a process. The first such answer asks it for the
# kernel's backtraces (sysrq), the second counts as frozen.
slow_since=''
# An outer kernel that reports a soft lockup (a CPU held in the kernel for
# 20 s and more, its line on the outer console, not a microVM's, which
# sandgate's log lines carry after a timestamp) counts as frozen at once:
# CI's run of 2026-12-06 showed both vCPUs of the outer guest stuck in
# kvm_amd under sandgate-vmm, each vCPU's RIP at the same address, from
# 68 s on; the ping found it 105 s later. Waiting for the silence and the
# ping costs a minute and more per such attempt and changes nothing.
outer_soft_lockup() {
  tr -d '\r' <"$work/console.log" | grep -qaE '^\[ *[0-9]+\.[0-9]+\] watchdog: BUG: soft lockup - CPU#[0-9]+ stuck for'
}
check_heartbeat() {
  local hb
  if outer_soft_lockup; then
    log "the outer guest's kernel reports a soft lockup: taken as frozen"
    log "QEMU's vCPUs:"
    monitor $'info cpus\ninfo registers -a' | grep -E 'CPU|RIP|RSP|RFL|CR0|HLT|halted' | sed 's/^/  | /' >&2 || true
    tr -d '\r' <"$work/console.log" | grep -aE 'soft lockup' | tail -n 4 | sed 's/^/  ! /' >&2
    return 1
  fi
  hb=$(stat -c %Y "$work/heartbeat.log" 2>/dev/null || echo 0)
  [ -z "$slow_since" ] || [ "$hb" -le "$slow_since" ] || slow_since=''  # the heartbeat came back
  silent "${1:-$silence_s}" || return 0
  log "no heartbeat from the outer guest for ${1:-$silence_s} s; pinging it"
  guest_answers "${2:-40}" || return 1
  if [ -z "$slow_since" ]; then
    slow_since=$(date +%s)
    log "it answered: slow, not frozen; asking for its kernel's backtraces (sysrq l, w) on the console"
    timeout 10 sh -c 'echo sysrq >"$1"' sh "$work/ctl.in" || log "could not write to the guest's control port"
    return 0
  fi
  log "it answered again but has written no heartbeat for $(($(date +%s) - hb)) s: its kernel is wedged (it cannot start a process)"
  show_console 120
  return 1
}

# The lowest MemAvailable the heartbeat reported (the outer guest has no
# swap: near zero, its OOM killer picks a VMM or sandgate itself).
report_memory() {
  local low
  low=$(tr -d '\r' <"$work/heartbeat.log" | awk 'NF >= 2 && $2 ~ /^[0-9]+$/ { if (min == "" || $2 < min) min = $2 } END { print min }')
  [ -n "$low" ] && log "outer guest memory: lowest MemAvailable $((low / 1024)) MiB of ${mem_mb} MiB"
  return 0
}

# After failed tests, first (before the long console dump, so a log cut
# short still shows it): how sandgate and the outer guest's kernel fared.
diagnose() {
  local lines
  lines=$(tr -d '\r' <"$work/console.log" |
    grep -aE 'SG-HARNESS: sandgate exited|Out of memory|oom-kill|Killed process|segfault|general protection|traps:|Kernel panic|BUG:|Call Trace|sandgate.*(error|fatal|abort)' |
    tail -n 30 || true)
  if [ -n "$lines" ]; then
    log "diagnosis (console lines about sandgate's exit, OOM kills and crashes):"
    printf '%s\n' "$lines" | sed 's/^/  ! /' >&2
  else
    log "diagnosis: no exit, OOM kill or crash of sandgate on the console"
  fi
}

# Whether the failed tests failed only the way a stalled guest fails them:
# every failed case's error is a timeout or a dropped connection (nothing
# came back wrong), and sandgate neither exited nor crashed. Under QEMU's
# TCG a vCPU of the outer guest or of a microVM can stop taking timer
# interrupts (docs/kvm-harness.md): requests to it time out while the rest
# runs. attempts.sh then boots a fresh guest (exit 75). A sandgate hang
# looks the same, so it is retried too, but one that repeats fails every
# attempt, and each attempt's output stays in the log.
stalled_only() {
  local tap="$work/tests.tap" fails errs
  [ -s "$tap" ] || return 1
  fails=$(grep -c '^not ok ' "$tap" || true)
  [ "$fails" -gt 0 ] || return 1
  errs=$(awk '/^not ok /{f = 1; next} f && /^  error:/{print; f = 0}' "$tap")
  [ "$(printf '%s\n' "$errs" | grep -c .)" -eq "$fails" ] || return 1
  ! printf '%s\n' "$errs" |
    grep -qvE 'deadline_exceeded|timed out|aborted due to timeout|fetch failed|terminated|ECONNRESET|socket hang up|other side closed' || return 1
  ! tr -d '\r' <"$work/console.log" | grep -qaE 'SG-HARNESS: sandgate exited|segfault|general protection|traps:'
}

# The same for a doctest suite run with --exec (tests/kvm): it failed, and
# every failed check is one marked "[sg-harness: unanswered]" (a microVM
# that did not answer a ping: CHECK_ANSWERS), with no crash.
doctest_stalled_only() {
  local out errs marks
  out=$(tr -d '\r' <"$work/console.log" | sed -n '/^SG-HARNESS: exec: /,$p')
  errs=$(printf '%s\n' "$out" | grep -c ' ERROR: ' || true)
  marks=$(printf '%s\n' "$out" | grep -c '\[sg-harness: unanswered\]' || true)
  [ "$errs" -gt 0 ] && [ "$errs" -eq "$marks" ] || return 1
  ! printf '%s\n' "$out" | grep -qE 'FATAL ERROR|SIGSEGV|SIGABRT|segfault|general protection|Kernel panic'
}

# Whether a microVM's guest died by a triple fault (its sandgate-vmm logs
# "guest shut down (triple fault)") while sandgate neither exited nor
# crashed. Under nested TCG the microVMs' guests have crashed so in runs
# whose rerun passed (docs/kvm-harness.md); it is retried like a stall.
# A VMM bug that corrupts guest memory could look the same: one that
# repeats fails every attempt, and each attempt's console stays in the log.
#
# It is asked after the harness has dumped the sandboxes' logs and
# stopped sandgate: a test can fail on a dead guest (its connection
# refused) before sandgate has logged its VMM's exit, and the dump shows
# the VMM's own log line. So a sandgate exit counts only before the
# harness asked it to stop.
microvm_triple_fault() {
  tr -d '\r' <"$work/console.log" | grep -qa 'guest shut down (triple fault)' || return 1
  ! tr -d '\r' <"$work/console.log" | grep -qaE 'segfault|general protection|traps:' || return 1
  ! tr -d '\r' <"$work/console.log" | sed '/^SG-HARNESS: stop requested/,$d' | grep -qa 'SG-HARNESS: sandgate exited'
}

# Whether the outer guest's own kernel panicked (its console, not a
# microVM's, which sandgate's log lines carry after a timestamp) and QEMU
# is gone. It runs nothing of sandgate's but the ioctls of KVM: under
# TCG's emulated SVM it has panicked inside __svm_vcpu_run
# (docs/kvm-harness.md). Retried like a stall.
outer_kernel_panicked() {
  [ -z "$qemu_pid" ] || ! kill -0 "$qemu_pid" 2>/dev/null || return 1
  tr -d '\r' <"$work/console.log" | grep -qaE '^\[ *[0-9]+\.[0-9]+\] Kernel panic - not syncing'
}

# A command that runs past its time: what the outer guest's threads are
# doing (outer-init prints it on "stacks"), so that a hang shows where.
dump_guest() {
  log "asking the outer guest for its threads' stacks"
  timeout 10 sh -c 'echo stacks >"$1"' sh "$work/ctl.in" || log "could not write to the guest's control port"
  local end=$(($(date +%s) + 40))
  while [ "$(date +%s)" -lt "$end" ] && ! grep -q 'SG-HARNESS: --- end of stacks' "$work/console.log"; do sleep 0.5; done
  grep -q 'SG-HARNESS: --- end of stacks' "$work/console.log" || log "the outer guest did not print its stacks in 40 s"
}

# Every syscall a VMM makes on the paths these tests take must be on its
# seccomp allow list (vm/confine.h): sandgate logs each refusal it finds in
# a VMM's log, and a run with any fails.
check_seccomp() {
  local refused
  refused=$(tr -d '\r' <"$work/console.log" | grep -ao 'seccomp: refused syscall [0-9]*' | sort | uniq -c || true)
  [ -z "$refused" ] && return 0
  log "the VMMs' seccomp filter refused syscalls (add them to vmm_syscall_policy if the VMM needs them):"
  printf '%s\n' "$refused" | sed 's/^/  | /' >&2
  return 1
}

if [ -n "$exec_cmd" ]; then
  test_freeze=${SANDGATE_HARNESS_TEST_FREEZE:-}
  case "$test_freeze" in '' | run | boot) ;; *) fail "SANDGATE_HARNESS_TEST_FREEZE must be run or boot, not '$test_freeze'" ;; esac
  for boot in $(seq 1 "$max_boots"); do
    start_qemu
    deadline=$(($(date +%s) + boot_timeout + test_timeout))
    froze=''
    started=''
    while kill -0 "$qemu_pid" 2>/dev/null && [ "$(date +%s)" -lt "$deadline" ]; do
      [ -n "$started" ] || ! grep -q '^SG-HARNESS: exec: ' "$work/console.log" || started=1
      if [ "$test_freeze" = run ] && [ -n "$started" ]; then
        # The live guest must answer first: the check tells the two apart.
        guest_answers || fail "SANDGATE_HARNESS_TEST_FREEZE: the running outer guest did not answer a ping"
        log "SANDGATE_HARNESS_TEST_FREEZE: the running guest answered a ping; stopping its vCPUs"
        monitor stop >/dev/null
        test_freeze=''
      fi
      if [ "$test_freeze" = boot ] && grep -q '^SG-HARNESS: stage 2 up' "$work/console.log"; then
        log "SANDGATE_HARNESS_TEST_FREEZE: stopping the booting guest's vCPUs"
        monitor stop >/dev/null
        test_freeze=''
      fi
      if [ -z "$started" ]; then
        check_heartbeat "$boot_silence_s" 15 || { froze=boot; break; }
      else
        check_heartbeat || { froze=1; break; }
      fi
      sleep 0.2
    done
    [ "$froze" = boot ] || break
    kill_qemu
    [ "$boot" -lt "$max_boots" ] || { show_console; frozen "the outer guest froze while booting, $max_boots boots in a row"; }
    log "the outer guest froze while booting (boot $boot of $max_boots); booting it again"
  done
  rc=$(tr -d '\r' <"$work/console.log" | sed -n 's/^SG-HARNESS: exec exited rc=\([0-9]*\) .*/\1/p' | tail -n 1)
  if [ -z "$rc" ] && [ -z "$froze" ] && kill -0 "$qemu_pid" 2>/dev/null; then
    dump_guest
    guest_answers || froze=1
  fi
  tr -d '\r' <"$work/console.log" | sed -n '/^SG-HARNESS: exec: /,$p' | sed 's/^/  | /' >&2
  if [ -z "$rc" ]; then
    grep -q '^SG-HARNESS: exec: ' "$work/console.log" || show_console
    [ -z "$froze" ] || frozen "the outer guest stopped running before the command finished"
    if outer_kernel_panicked; then
      frozen "the outer guest's kernel panicked before the command finished (an emulator fault under TCG, not sandgate's: it runs in that guest's user space)"
    fi
    kill -0 "$qemu_pid" 2>/dev/null || fail "QEMU exited before the command finished inside the guest"
    fail "the command did not finish inside the guest within $((boot_timeout + test_timeout)) s"
  fi
  log "the command exited with status $rc"
  [ "$rc" -ne 0 ] || check_seccomp || fail "seccomp refusals"
  if [ "$rc" -ne 0 ] && doctest_stalled_only; then
    frozen "every failed check was a microVM that stopped answering pings (a stalled guest)"
  fi
  exit "$rc"
fi

url=''
key=''
for attempt in $(seq 1 "$max_boots"); do
  start_qemu
  t_boot=$(date +%s)
  while :; do
    if grep -q '^SG-HARNESS: \(FAILED\|sandgate exited\)' "$work/console.log"; then
      show_console
      fail "the outer guest failed before sandgate was up"
    fi
    if ! kill -0 "$qemu_pid" 2>/dev/null; then
      wait "$qemu_pid" && qrc=0 || qrc=$?
      qemu_pid=
      if grep -q 'Could not set up host forwarding' "$work/qemu.out" && [ "$attempt" -lt "$max_boots" ]; then
        log "port $port was taken; retrying with another"
        continue 2
      fi
      show_console
      fail "QEMU exited (status $qrc) before sandgate was up"
    fi
    key=$(sed -n 's/^API key (tenant "local"): \(e2b_[0-9a-f]\{40\}\).*/\1/p' "$work/console.log" | head -n 1)
    if grep -q 'listening on https\?://' "$work/console.log" && [ -n "$key" ]; then
      url=http://127.0.0.1:$port
      break 2
    fi
    if ! check_heartbeat "$boot_silence_s" 15; then
      kill_qemu
      [ "$attempt" -lt "$max_boots" ] || { show_console; frozen "the outer guest froze while booting, $max_boots boots in a row"; }
      log "the outer guest froze while booting (boot $attempt of $max_boots); booting it again"
      continue 2
    fi
    if [ $(($(date +%s) - t_boot)) -ge "$boot_timeout" ]; then
      show_console
      fail "sandgate's banner did not appear on the serial console within $boot_timeout s"
    fi
    sleep 0.2
  done
done
log "sandgate is up inside the guest; $url -> guest :8080 (guest uptime $(sed -n 's/^SG-HARNESS: starting sandgate.* at \([0-9.]*\) s.*/\1/p' "$work/console.log") s at sandgate start)"

# --- the tests, from the host.
# They run in the background so that a frozen outer guest (no heartbeat,
# no answer) ends them at once instead of at each request's timeout.
SANDGATE_E2E_URL=$url SANDGATE_HARNESS_CTL=$work/ctl.in SANDGATE_E2E_KEY=$key SANDGATE_E2E_RUNTIME=$runtime \
  SANDGATE_E2E_MODEL_URL=$model_url SANDGATE_E2E_MODEL_KEY=$model_key \
  timeout --kill-after=10 "$test_timeout" node --test --test-concurrency=1 \
  --test-reporter=tap --test-reporter-destination=stdout \
  --test-reporter=tap --test-reporter-destination="$work/tests.tap" "${tests[@]}" &
tests_pid=$!
froze=''
# A case that failed by a timeout or a dropped connection (stalled_only)
# ends the run at once: such a run is retried whatever the later cases do,
# and a stalled microVM makes each later case wait out its own timeouts
# (a run here on 2026-12-06 spent 137 s on its first case, then went on).
stalled_early=''
while kill -0 "$tests_pid" 2>/dev/null; do
  if ! check_heartbeat; then
    froze=1
    log "ending the tests: the outer guest is frozen"
    kill -TERM "$tests_pid" 2>/dev/null || true
    break
  fi
  if stalled_only; then
    stalled_early=1
    log "ending the tests: a case failed by a timeout or a dropped connection, and sandgate did not exit"
    kill -TERM "$tests_pid" 2>/dev/null || true
    break
  fi
  sleep 1
done
wait "$tests_pid" && test_rc=0 || test_rc=$?
tests_pid=
[ -z "$stalled_early" ] || [ "$test_rc" -ne 0 ] || test_rc=1
[ "$test_rc" -eq 124 ] && log "the tests ran past $test_timeout s"
log "tests finished with status $test_rc"
report_memory
[ "$test_rc" -eq 0 ] || diagnose
stalled=''
if [ -z "$froze" ] && [ "$test_rc" -ne 0 ] && { [ -n "$stalled_early" ] || stalled_only; }; then
  stalled="the tests failed only by timeouts and dropped connections (a stalled guest)"
  log "every failed case failed by a timeout or a dropped connection, and sandgate did not exit: the nested guests stalled"
fi
# Failed tests: was it the guest that stopped? (A live one answers.)
if [ -z "$froze" ] && [ "$test_rc" -ne 0 ] && kill -0 "$qemu_pid" 2>/dev/null; then
  guest_answers || froze=1
fi
if [ -n "$froze" ]; then
  show_console 100
  frozen "the outer guest stopped running while the tests ran"
fi

# --- shutdown: ask the guest to stop sandgate (SIGTERM) and power off.
# After failed tests it first prints the sandboxes' logs on the console.
word=stop
[ "$test_rc" -eq 0 ] || word=dump
# shellcheck disable=SC2016 # expanded by the inner sh
timeout 10 sh -c 'echo "$2" >"$1"' sh "$work/ctl.in" "$word" || log "could not write to the guest's control port"
stop_rc=
deadline=$(($(date +%s) + 60))
while kill -0 "$qemu_pid" 2>/dev/null && [ "$(date +%s)" -lt "$deadline" ]; do sleep 0.2; done
if kill -0 "$qemu_pid" 2>/dev/null; then
  if [ "$test_rc" -eq 0 ] && ! grep -q '^SG-HARNESS: stop requested' "$work/console.log" && ! guest_answers; then
    show_console
    frozen "the outer guest stopped running after the tests passed"
  fi
  log "the outer guest did not power off within 60 s; killing QEMU"
else
  wait "$qemu_pid" || true
  qemu_pid=
fi
stop_rc=$(sed -n 's/^SG-HARNESS: sandgate exited rc=\([0-9]*\).*/\1/p' "$work/console.log" | tail -n 1)
if [ "$test_rc" -ne 0 ]; then
  show_console 200
  check_seccomp || true
  # Asked only now: the dump above has the VMM's own log line.
  if [ -z "$stalled" ] && microvm_triple_fault; then
    log "a microVM's guest triple-faulted and sandgate did not exit on its own: taken as an emulator fault, the run is retried"
    stalled="a microVM's guest triple-faulted under the emulator"
  fi
  [ -z "$stalled" ] || frozen "$stalled"
  if outer_kernel_panicked; then
    frozen "the outer guest's kernel panicked (an emulator fault under TCG, not sandgate's: it runs in that guest's user space)"
  fi
  exit "$test_rc"
fi
check_seccomp || fail "seccomp refusals"
if [ "$stop_rc" != 0 ]; then
  show_console
  fail "the tests passed but sandgate did not stop cleanly (exit status '${stop_rc:-none}')"
fi
log "done: tests passed, sandgate stopped cleanly"
exit 0
