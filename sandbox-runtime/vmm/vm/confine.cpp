// VMM process confinement (confine.h).
#include "vm/confine.h"

#include <fcntl.h>
#include <grp.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>

#include "kvm/memory.h"
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

namespace {

Status enter_jail(const Jail& j) {
  if (j.uid == 0 || j.gid == 0) return invalid_error("jail: uid and gid must not be 0");
  // The device first: after the uid change it could not be opened.
  int uffd_dev = ::open("/dev/userfaultfd", O_RDWR | O_CLOEXEC);
  if (uffd_dev < 0) return sys::errno_error("open", "/dev/userfaultfd");
  GuestMemory::use_userfaultfd_device(uffd_dev);  // kept for the process's life
  if (::unshare(CLONE_NEWNS) != 0) return sys::errno_error("unshare", "mount namespace");
  // Nothing done here may reach the host's mounts.
  if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0)
    return sys::errno_error("mount MS_PRIVATE", "/");
  const unsigned long locked = MS_NOSUID | MS_NODEV | MS_NOEXEC;
  if (::mount("sandgate-vmm-jail", j.root.c_str(), "tmpfs", locked, "size=16k,nr_inodes=16,mode=0555") != 0)
    return sys::errno_error("mount tmpfs", j.root);
  if (!j.snapshot_dir.empty()) {
    std::string at = j.root + kJailSnapshotDir;
    if (::mkdir(at.c_str(), 0700) != 0) return sys::errno_error("mkdir", at);
    if (::mount(j.snapshot_dir.c_str(), at.c_str(), nullptr, MS_BIND, nullptr) != 0)
      return sys::errno_error("bind mount", j.snapshot_dir);
    if (::mount(nullptr, at.c_str(), nullptr, MS_REMOUNT | MS_BIND | locked, nullptr) != 0)
      return sys::errno_error("remount nosuid,nodev,noexec", at);
  }
  if (::mount(nullptr, j.root.c_str(), nullptr, MS_REMOUNT | MS_BIND | MS_RDONLY | locked, nullptr) != 0)
    return sys::errno_error("remount read-only", j.root);
  // pivot_root(".", "."): the old root ends up on top of the new one,
  // and is detached at once.
  if (::chdir(j.root.c_str()) != 0) return sys::errno_error("chdir", j.root);
  if (::syscall(SYS_pivot_root, ".", ".") != 0) return sys::errno_error("pivot_root", j.root);
  if (::umount2(".", MNT_DETACH) != 0) return sys::errno_error("umount2", "the host's root");
  if (::chdir("/") != 0) return sys::errno_error("chdir", "/");
  // Groups, then gid, then uid: a non-zero uid takes every capability away.
  if (::setgroups(0, nullptr) != 0) return sys::errno_error("setgroups", "jail");
  if (::setresgid(j.gid, j.gid, j.gid) != 0) return sys::errno_error("setresgid", std::to_string(j.gid));
  if (::setresuid(j.uid, j.uid, j.uid) != 0) return sys::errno_error("setresuid", std::to_string(j.uid));
  if (::geteuid() != j.uid || ::getegid() != j.gid) return internal_error("jail: the uid change did not hold");
  return Status::Ok();
}

}  // namespace

Status confine_vmm(const Jail* jail) {
  if (::unshare(CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS) != 0)
    return sys::errno_error("unshare", "network, IPC and UTS namespaces");
  if (jail)
    if (Status s = enter_jail(*jail); !s) return s.error().with_context("jail");
  if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return sys::errno_error("prctl PR_SET_NO_NEW_PRIVS", "vmm");
  auto program = sys::seccomp::compile(vmm_syscall_policy());
  if (!program) return program.error();
  return sys::seccomp::install(*program, /*all_threads=*/false);
}

}  // namespace sg::vmm
