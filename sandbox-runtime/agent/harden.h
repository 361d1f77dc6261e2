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
//    /proc files and channel socket, change the clock, or undo the masks.
// The agent keeps its own capabilities (it needs none of the dropped ones
// after this, but dropping them from itself would not add a boundary:
// nothing in the sandbox can act as the agent).
#pragma once

#include <cstdint>
#include <string>

#include "sys/status.h"

namespace sg::agent {

// The bounding set kept, as a bit mask of CAP_* numbers.
uint64_t kept_capabilities();

// Masks and read-only remounts under proc_root ("/proc") and sys_root
// ("/sys"), then the capability drop. Paths the kernel does not have are
// skipped. Any other failure is returned (the agent then refuses to start:
// a sandbox is not run half-hardened).
Status harden_sandbox(const std::string& proc_root = "/proc", const std::string& sys_root = "/sys");

}  // namespace sg::agent
