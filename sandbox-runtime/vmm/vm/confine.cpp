// VMM process confinement (confine.h).
#include "vm/confine.h"

#include <sched.h>
#include <sys/prctl.h>
#include <sys/syscall.h>

#include <cerrno>

#include "sys/sys.h"

namespace sg::vmm {

sys::seccomp::Policy vmm_syscall_policy() {
  using namespace sys::seccomp;
  Policy p;
  p.default_action = allow();
  p.foreign_action = kill_process();
  const uint32_t deny = fail_with(EPERM);
  // Threads only: a clone that does not share the thread group is a new process.
  p.rules.push_back(Rule{SYS_clone, deny, ArgCheck{0, ArgCheck::Op::kNoBitSet, CLONE_THREAD}});
  p.rules.push_back(Rule{SYS_clone3, fail_with(ENOSYS), std::nullopt});
  for (long nr : {SYS_execve, SYS_execveat, SYS_fork, SYS_vfork,
                  // sockets: the VMM has its two and needs no more
                  SYS_socket, SYS_socketpair, SYS_connect, SYS_bind, SYS_listen,
                  // other processes
                  SYS_ptrace, SYS_process_vm_readv, SYS_process_vm_writev, SYS_kcmp, SYS_pidfd_getfd,
                  // namespaces, root
                  SYS_unshare, SYS_setns, SYS_chroot,
                  // identity
                  SYS_setuid, SYS_setgid, SYS_setreuid, SYS_setregid, SYS_setresuid, SYS_setresgid, SYS_setgroups,
                  SYS_setfsuid, SYS_setfsgid, SYS_capset})
    p.rules.push_back(Rule{nr, deny, std::nullopt});
  for (long nr : unneeded_kernel_surface()) p.rules.push_back(Rule{nr, deny, std::nullopt});
  return p;
}

Status confine_vmm() {
  if (::unshare(CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS) != 0)
    return sys::errno_error("unshare", "network, IPC and UTS namespaces");
  if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return sys::errno_error("prctl PR_SET_NO_NEW_PRIVS", "vmm");
  auto program = sys::seccomp::compile(vmm_syscall_policy());
  if (!program) return program.error();
  return sys::seccomp::install(*program, /*all_threads=*/false);
}

}  // namespace sg::vmm
