// Seccomp filters: a small compiler from a policy (a default action and
// per-syscall rules, optionally conditioned on one argument) to a classic
// BPF program, and its installation. Used by the agent to filter every
// process of a process-backend sandbox (agent/harden.*, a deny list) and by
// sandgate-vmm for itself (vm/confine.*, an allow list).
//
// The program always checks the architecture first: a syscall made through
// another ABI (the i386 int 0x80 entry on x86_64, x32) has other numbers,
// so a filter written for the native table would not see it; such calls
// get policy.foreign_action. Arguments are compared on their low 32 bits
// (flags and ioctl-style values; the kernel's own checks on those bits are
// what the rules mirror).
#pragma once

#include <linux/filter.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "base/status.h"

namespace sg::sys::seccomp {

// Actions (the SECCOMP_RET_* values, with the errno where there is one).
uint32_t allow();
uint32_t fail_with(int err);  // the syscall returns -1 with errno err
uint32_t kill_process();
uint32_t trap();              // SIGSYS to the caller (si_syscall says which); the syscall is not made

struct ArgCheck {
  enum class Op {
    kAnyBitSet,  // (arg & value) != 0
    kNoBitSet,   // (arg & value) == 0
    kEquals,     // arg == value
  };
  unsigned index = 0;  // 0..5
  Op op = Op::kAnyBitSet;
  uint32_t value = 0;
};

struct Rule {
  long nr = -1;                   // the native syscall number
  uint32_t action = 0;
  std::optional<ArgCheck> when;   // the rule applies only if this holds
};

struct Policy {
  uint32_t default_action = 0;
  uint32_t foreign_action = 0;    // another ABI's syscalls
  std::vector<Rule> rules;        // first matching rule wins
};

// Syscalls that reach kernel surface neither a sandbox nor a VMM has use
// for, and that namespaces do not confine: keyrings, bpf, perf events,
// io_uring, module and kexec loading, reboot, syslog, acct, swap,
// quotactl, the old and new mount API, file handles, and on x86_64 iopl,
// ioperm, uselib and _sysctl. A deny list (the sandbox's) refuses these and
// adds its own.
std::vector<long> unneeded_kernel_surface();

// The BPF program for policy. kInvalid for a bad rule (negative number,
// argument index over 5) or a program over the kernel's 4096 instructions.
Result<std::vector<sock_filter>> compile(const Policy& policy);

// Installs program on the calling thread, or on every thread of the
// process with all_threads (SECCOMP_FILTER_FLAG_TSYNC). Without
// CAP_SYS_ADMIN the caller must have set no_new_privs. Irrevocable.
Status install(const std::vector<sock_filter>& program, bool all_threads);

}  // namespace sg::sys::seccomp
