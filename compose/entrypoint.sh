#!/bin/sh
# Entrypoint of the sandgate image (compose/Dockerfile). Before it execs
# sandgate it
#   1. makes the container's cgroup mounts writable and, on cgroup v2,
#      delegates cpu, memory and pids below the container's own cgroup: the
#      process backend puts each sandbox in a cgroup of its own for limits,
#      usage and the freezer (pause);
#   2. offers /dev/kvm to the kvm backend where the host has KVM, so one
#      compose file serves hosts with and without it, and /dev/loop-control
#      for size-limited sandbox disks where the host lets the container
#      use loop devices;
#   3. lets the data volume hold device nodes and programs: engines mount
#      named volumes nodev (podman) or may mount them noexec/nosuid, and
#      the template build (debootstrap), sandboxes' loop devices and
#      set-uid programs in templates need them;
#   4. turns the SANDGATE_* variables compose.yaml sets into `sandgate serve`
#      options.
# docs/compose.md explains each step and the privilege it relies on.
# SANDGATE_CONTAINER_SETUP=0 skips steps 1 to 3 (an engine that already
# delegates a writable cgroup; a run outside any container, as
# tests/compose/check_compose.py does, where they would change the host).
#
# Arguments: `serve [OPTIONS]` (the image's CMD), options alone (taken as
# serve options), another sandgate command (`kvm check`, `tenant list`,
# ...), or any other program, which runs instead of sandgate.
set -eu

log() { echo "sandgate-entrypoint: $*" >&2; }

# "MOUNTPOINT OPTIONS" for each cgroup (v1) or cgroup2 mount; the file system
# type is the field after the "-" separator of /proc/self/mountinfo.
cgroup_mounts() {
  awk '{ for (i = 7; i <= NF; i++) if ($i == "-") {
           if ($(i + 1) == "cgroup" || $(i + 1) == "cgroup2") print $5, $6
           break } }' /proc/self/mountinfo
}

setup_cgroups() {
  # Docker mounts the container's own cgroup tree read-only unless the
  # container is privileged. A bind remount changes only this mount's flag;
  # the tree below is still just the container's cgroup.
  cgroup_mounts | while read -r mp opts; do
    case ",$opts," in
    *,ro,*)
      mount -o remount,bind,rw "$mp" 2>/dev/null ||
        log "cannot remount $mp read-write (it needs CAP_SYS_ADMIN and no AppArmor mount denial, see docs/compose.md): the process backend cannot create sandboxes"
      ;;
    esac
  done
  cg=/sys/fs/cgroup
  # cgroup v1: sandgate makes its directories in each hierarchy itself.
  [ -f "$cg/cgroup.controllers" ] || return 0
  # cgroup v2 lets a cgroup hand controllers to its children only while no
  # process lives in it. Move this container's processes into a leaf,
  # init/ (docker exec joins PID 1's cgroup, so it lands there too); the
  # sandboxes go to sandgate/<id> beside it.
  if ! mkdir -p "$cg/init" 2>/dev/null; then
    log "cannot create $cg/init: the process backend cannot create sandboxes"
    return 0
  fi
  pids=$(cat "$cg/cgroup.procs")
  for pid in $pids; do
    echo "$pid" 2>/dev/null >"$cg/init/cgroup.procs" || :
  done
  missing=""
  for c in cpu memory pids; do
    grep -qw "$c" "$cg/cgroup.controllers" || missing="$missing $c"
  done
  if [ -n "$missing" ]; then
    log "cgroup v2 controllers not available to this container:$missing (the process backend needs cpu, memory and pids)"
    return 0
  fi
  echo "+cpu +memory +pids" 2>/dev/null >"$cg/cgroup.subtree_control" ||
    log "cannot enable cpu, memory and pids in $cg/cgroup.subtree_control: the process backend cannot create sandboxes"
}

setup_kvm() {
  # /dev/userfaultfd (misc 10:257, Linux 6.1+) lets jailed VMMs, which are
  # not root, take userfaultfds for the memory offload (docs/vmm.md,
  # "Confinement"); without it sandgate runs VMMs unjailed and says so.
  if [ ! -e /dev/userfaultfd ] && mknod -m 0600 /dev/userfaultfd c 10 257 2>/dev/null; then
    (: <>/dev/userfaultfd) 2>/dev/null || rm -f /dev/userfaultfd
  fi
  [ -e /dev/kvm ] && return 0
  # KVM is the misc device 10:232 on every Linux host, and compose.yaml lets
  # the container use that device (device_cgroup_rules), so a node made here
  # works wherever the host has KVM. Where it has none the node does not open
  # (ENXIO) and is removed: sandgate then logs that /dev/kvm is missing and
  # uses the process backend.
  mknod -m 0600 /dev/kvm c 10 232 2>/dev/null || return 0
  if ! (: <>/dev/kvm) 2>/dev/null; then
    rm -f /dev/kvm
  fi
}

# The mount options of the mount at exactly $1, "" when $1 is no mount point.
mount_options() {
  awk -v mp="$1" '$5 == mp { opts = $6 } END { print opts }' /proc/self/mountinfo
}

setup_volume() {
  dir=${SANDGATE_DATA_DIR:-/var/lib/sandgate}
  opts=$(mount_options "$dir")
  case ",$opts," in
  *,nodev,* | *,noexec,* | *,nosuid,*) ;;
  *) return 0 ;;
  esac
  # A bind remount changes only this mount's flags (ro or rw kept): the
  # volume's own file system is not touched.
  rw=rw
  case ",$opts," in *,ro,*) rw=ro ;; esac
  if mount -o "remount,bind,$rw,dev,exec,suid" "$dir" 2>/dev/null; then
    log "remounted the data volume $dir with dev,exec,suid (it was mounted $opts)"
  else
    log "the data volume $dir is mounted $opts and cannot be remounted (it needs CAP_SYS_ADMIN and no AppArmor mount denial, see docs/compose.md): building the base template and size-limited disks will fail; mount it with dev,exec,suid"
  fi
}

setup_loop() {
  # /dev/loop-control (misc 10:237): sandgate asks it for a free loop
  # device and makes that device's node itself. Kept only where it opens
  # (compose.yaml's device_cgroup_rules allow it); otherwise sandgate logs
  # that sandbox disks are not size-limited (--disk-limit auto) or refuses
  # creates (--disk-limit on).
  [ -e /dev/loop-control ] && return 0
  mknod -m 0600 /dev/loop-control c 10 237 2>/dev/null || return 0
  if ! (: <>/dev/loop-control) 2>/dev/null; then
    rm -f /dev/loop-control
  fi
}

case "${1:-}" in
"" | -*) set -- serve "$@" ;;
esac

case "$1" in
serve | kvm)
  if [ "${SANDGATE_CONTAINER_SETUP:-1}" != 0 ]; then
    setup_cgroups
    setup_kvm
    setup_loop
    setup_volume
  fi
  ;;
esac

if [ "$1" = serve ]; then
  shift
  # Put in front, so an option given as an argument wins (the last of a
  # repeated option counts). Empty variables add nothing.
  [ -z "${SANDGATE_ANTHROPIC_KEY_FILE:-}" ] || set -- --anthropic-key-file "$SANDGATE_ANTHROPIC_KEY_FILE" "$@"
  [ -z "${SANDGATE_ANTHROPIC_BASE_URL:-}" ] || set -- --anthropic-base-url "$SANDGATE_ANTHROPIC_BASE_URL" "$@"
  [ -z "${SANDGATE_OPENAI_KEY_FILE:-}" ] || set -- --openai-key-file "$SANDGATE_OPENAI_KEY_FILE" "$@"
  [ -z "${SANDGATE_OPENAI_BASE_URL:-}" ] || set -- --openai-base-url "$SANDGATE_OPENAI_BASE_URL" "$@"
  [ -z "${SANDGATE_LOG_LEVEL:-}" ] || set -- --log-level "$SANDGATE_LOG_LEVEL" "$@"
  [ -z "${SANDGATE_PUBLIC_URL:-}" ] || set -- --public-url "$SANDGATE_PUBLIC_URL" "$@"
  [ -z "${SANDGATE_RUNTIME:-}" ] || set -- --runtime "$SANDGATE_RUNTIME" "$@"
  [ -z "${SANDGATE_NETWORK:-}" ] || set -- --network "$SANDGATE_NETWORK" "$@"
  exec sandgate serve "$@"
fi

case "$1" in
tenant | key | llm | template | kvm | version) exec sandgate "$@" ;;
esac
exec "$@"
