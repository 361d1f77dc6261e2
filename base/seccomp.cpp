// Seccomp policy compiler and installer (seccomp.h).
#include "base/seccomp.h"

#include <linux/audit.h>
#include <linux/seccomp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <string>

#include "base/sys.h"

namespace sg::sys::seccomp {

namespace {

#if defined(__x86_64__)
constexpr uint32_t kNativeArch = AUDIT_ARCH_X86_64;
constexpr uint32_t kX32Bit = 0x40000000;  // __X32_SYSCALL_BIT: the x32 ABI shares the arch value
#elif defined(__aarch64__)
constexpr uint32_t kNativeArch = AUDIT_ARCH_AARCH64;
#else
#error "seccomp: no architecture value for this target"
#endif

constexpr size_t kMaxInstructions = 4096;  // BPF_MAXINSNS

sock_filter stmt(uint16_t code, uint32_t k) { return sock_filter{code, 0, 0, k}; }
sock_filter jump(uint16_t code, uint32_t k, uint8_t jt, uint8_t jf) { return sock_filter{code, jt, jf, k}; }

uint32_t arg_low_offset(unsigned index) {
  // Little-endian: the low word of args[index] comes first.
  return static_cast<uint32_t>(offsetof(seccomp_data, args) + 8 * index);
}

}  // namespace

uint32_t allow() { return SECCOMP_RET_ALLOW; }
uint32_t fail_with(int err) { return SECCOMP_RET_ERRNO | (static_cast<uint32_t>(err) & SECCOMP_RET_DATA); }
uint32_t kill_process() { return SECCOMP_RET_KILL_PROCESS; }
uint32_t trap() { return SECCOMP_RET_TRAP; }

std::vector<long> unneeded_kernel_surface() {
  std::vector<long> v = {SYS_add_key, SYS_keyctl, SYS_request_key,  // keyrings are not namespaced
                         SYS_bpf, SYS_perf_event_open, SYS_io_uring_setup, SYS_io_uring_enter, SYS_io_uring_register,
                         SYS_init_module, SYS_finit_module, SYS_delete_module, SYS_kexec_load, SYS_kexec_file_load,
                         SYS_reboot, SYS_syslog, SYS_acct, SYS_swapon, SYS_swapoff, SYS_quotactl,
                         SYS_mount, SYS_umount2, SYS_pivot_root, SYS_move_mount, SYS_open_tree, SYS_fsopen,
                         SYS_fsconfig, SYS_fsmount, SYS_fspick, SYS_mount_setattr,
                         SYS_open_by_handle_at, SYS_name_to_handle_at};  // handles reach files outside a root
#if defined(__x86_64__)
  v.insert(v.end(), {SYS_iopl, SYS_ioperm, SYS_uselib, SYS__sysctl});
#endif
  return v;
}

Result<std::vector<sock_filter>> compile(const Policy& policy) {
  std::vector<sock_filter> p;
  p.push_back(stmt(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, arch)));
  p.push_back(jump(BPF_JMP | BPF_JEQ | BPF_K, kNativeArch, 1, 0));
  p.push_back(stmt(BPF_RET | BPF_K, policy.foreign_action));
  p.push_back(stmt(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)));
#if defined(__x86_64__)
  p.push_back(jump(BPF_JMP | BPF_JGE | BPF_K, kX32Bit, 0, 1));
  p.push_back(stmt(BPF_RET | BPF_K, policy.foreign_action));
#endif
  for (const Rule& r : policy.rules) {
    if (r.nr < 0) return invalid_error("seccomp: rule for a negative syscall number " + std::to_string(r.nr));
    const uint32_t nr = static_cast<uint32_t>(r.nr);
    if (!r.when) {
      // nr == rule's: return its action; else on to the next rule.
      p.push_back(jump(BPF_JMP | BPF_JEQ | BPF_K, nr, 0, 1));
      p.push_back(stmt(BPF_RET | BPF_K, r.action));
      continue;
    }
    const ArgCheck& c = *r.when;
    if (c.index > 5) return invalid_error("seccomp: argument index " + std::to_string(c.index) + " (0..5)");
    const uint16_t op = c.op == ArgCheck::Op::kEquals ? BPF_JEQ : BPF_JSET;
    const bool negate = c.op == ArgCheck::Op::kNoBitSet;  // the rule holds when the test fails
    p.push_back(jump(BPF_JMP | BPF_JEQ | BPF_K, nr, 0, 4));  // not this syscall: skip the 4 below
    p.push_back(stmt(BPF_LD | BPF_W | BPF_ABS, arg_low_offset(c.index)));
    p.push_back(jump(BPF_JMP | op | BPF_K, c.value, negate ? 1 : 0, negate ? 0 : 1));
    p.push_back(stmt(BPF_RET | BPF_K, r.action));
    p.push_back(stmt(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)));  // no match: nr back in A
  }
  p.push_back(stmt(BPF_RET | BPF_K, policy.default_action));
  if (p.size() > kMaxInstructions)
    return invalid_error("seccomp: program of " + std::to_string(p.size()) + " instructions (at most " +
                         std::to_string(kMaxInstructions) + ")");
  return p;
}

Status install(const std::vector<sock_filter>& program, bool all_threads) {
  sock_fprog prog{};
  prog.len = static_cast<unsigned short>(program.size());
  prog.filter = const_cast<sock_filter*>(program.data());
  const unsigned flags = all_threads ? SECCOMP_FILTER_FLAG_TSYNC : 0;
  long r = ::syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, flags, &prog);
  if (r < 0) return errno_error("seccomp SECCOMP_SET_MODE_FILTER", std::to_string(program.size()) + " instructions");
  if (r > 0)  // TSYNC: the id of a thread that could not be synchronised
    return internal_error("seccomp SECCOMP_SET_MODE_FILTER: thread " + std::to_string(r) +
                          " has a conflicting filter");
  return Status::Ok();
}

}  // namespace sg::sys::seccomp
