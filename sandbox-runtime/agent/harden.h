// Hardening of a process-backend sandbox from inside, by its agent (PID 1,
// root, its own mount and PID namespaces), before any sandbox process runs
// (docs/threat-model.md, docs/process-backend.md "Isolation"):
//  - /proc and /sys paths that reach the host kernel are masked (an empty
//    file or directory over them) or made read-only, as container runtimes
//    do: kcore, keys, timer_list, sched_debug, ... masked; sys, sysrq-
//    trigger, irq, bus, fs read-only; /sys/firmware masked;
//  - the capability bounding set keeps only what ordinary root work in a
//    sandbox needs (file ownership and modes, setuid/setgid, kill, binding
//    low ports, raw sockets on loopback, chroot); the inheritable and
//    ambient sets are emptied. Every program started from then on (envd's
//    processes, setuid binaries) gets at most that set, so root inside can
//    no longer mount, load modules, mknod, ptrace the agent or read its
//    /proc files and channel socket, change the clock, or undo the masks;
//  - a seccomp filter on the agent and so on every process after it
//    (sandbox_syscall_policy below) refuses, with EPERM, the syscalls that
//    reach kernel surface a sandbox has no use for and that namespaces do
//    not confine: new user namespaces (in which dropped capabilities come
//    back), keyrings, bpf, perf events, userfaultfd, io_uring, module and
//    kexec loading, the mount API, file handles, swap, accounting; clone3 is
//    ENOSYS (its flags cannot be inspected; the C library falls back to
//    clone); syscalls through another ABI (i386, x32) kill the process.
//  - with a user namespace (process/userns.h) the agent joins it between
//    the masks (which need host root) and the capability drop, so root
//    inside is an unprivileged host uid whose capabilities count only in
//    its own namespace, which owns none of the sandbox's other namespaces.
// The agent keeps its own capabilities (it needs none of the dropped ones
// after this, but dropping them from itself would not add a boundary:
// nothing in the sandbox can act as the agent).
#pragma once

#include <cstdint>
#include <string>

#include "base/seccomp.h"
#include "base/status.h"

namespace sg::agent {

// The bounding set kept, as a bit mask of CAP_* numbers.
uint64_t kept_capabilities();

// The seccomp policy installed by harden_sandbox (default: allow).
sys::seccomp::Policy sandbox_syscall_policy();

// Masks and read-only remounts under proc_root ("/proc") and sys_root
// ("/sys"), then the capability drop, then the seccomp filter (all threads). Paths the kernel does not have are
// skipped. Any other failure is returned (the agent then refuses to start:
// a sandbox is not run half-hardened).
// With userns_fd >= 0, after the masks and before the capability drop:
// the sysctls a user-namespaced root needs in a network namespace it does
// not own (binding ports under 1024, ICMP echo sockets), then setns into
// the user namespace and uid, gid and groups 0 there (sandbox root becomes
// the namespace's unprivileged host uid); the descriptor is closed.
Status harden_sandbox(int userns_fd = -1, const std::string& proc_root = "/proc",
                      const std::string& sys_root = "/sys");

}  // namespace sg::agent
