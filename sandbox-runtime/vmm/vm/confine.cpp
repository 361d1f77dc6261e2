// VMM process confinement (confine.h).
#include "sandbox-runtime/vmm/vm/confine.h"

#include <fcntl.h>
#include <grp.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>

#include "sandbox-runtime/vmm/kvm/kvm.h"
#include "sandbox-runtime/vmm/kvm/memory.h"
#include "base/sys.h"

namespace sg::vmm {

sys::seccomp::Policy vmm_syscall_policy(pid_t self, bool snapshot_files) {
  using namespace sys::seccomp;
  Policy p;
  p.default_action = trap();  // refused_syscall: logged, then EPERM
  p.foreign_action = kill_process();
  const uint32_t ok = allow();
  auto allow_all = [&](std::initializer_list<long> nrs) {
    for (long nr : nrs) p.rules.push_back(Rule{nr, ok, std::nullopt});
  };
  // ioctl first (KVM_RUN is the hottest call), by request: KVM's on the
  // VM and vCPU fds, and userfaultfd's for the memory offload.
  for (unsigned long req : kvm::running_ioctls())
    p.rules.push_back(Rule{SYS_ioctl, ok, ArgCheck{1, ArgCheck::Op::kEquals, static_cast<uint32_t>(req)}});
  for (unsigned long req : GuestMemory::userfaultfd_ioctls())
    p.rules.push_back(Rule{SYS_ioctl, ok, ArgCheck{1, ArgCheck::Op::kEquals, static_cast<uint32_t>(req)}});
  // The other calls checked by argument come next: the kernel runs the
  // filter for them on every call, so the fewer rules before them the
  // better. Calls allowed whatever their arguments (the rest) are decided
  // once per syscall number by the kernel's cache (Linux 5.11+), so their
  // place does not matter.
  // Memory: no new executable mappings (nothing the VMM runs is made at
  // run time); guest RAM's release and restore (madvise, userfaultfd,
  // memfd).
  p.rules.push_back(Rule{SYS_mmap, trap(), ArgCheck{2, ArgCheck::Op::kAnyBitSet, PROT_EXEC}});
  p.rules.push_back(Rule{SYS_mprotect, trap(), ArgCheck{2, ArgCheck::Op::kAnyBitSet, PROT_EXEC}});
  allow_all({SYS_mmap, SYS_mprotect, SYS_munmap, SYS_mremap, SYS_madvise, SYS_brk, SYS_userfaultfd,
             SYS_memfd_create});
  // Threads, and nothing else: a clone that does not share the thread
  // group is a new process, and one with a namespace flag a way out.
  const uint32_t namespaces = CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER |
                              CLONE_NEWPID | CLONE_NEWNET;
  p.rules.push_back(Rule{SYS_clone, trap(), ArgCheck{0, ArgCheck::Op::kNoBitSet, CLONE_THREAD}});
  p.rules.push_back(Rule{SYS_clone, trap(), ArgCheck{0, ArgCheck::Op::kAnyBitSet, namespaces}});
  allow_all({SYS_clone});
  // clone3's flags are in memory the filter cannot read: ENOSYS, so the C
  // library falls back to clone (expected, so not logged).
  p.rules.push_back(Rule{SYS_clone3, fail_with(ENOSYS), std::nullopt});
  // Signals to its own threads only (the vCPU kick).
  p.rules.push_back(Rule{SYS_tgkill, ok, ArgCheck{0, ArgCheck::Op::kEquals, static_cast<uint32_t>(self)}});
  // prctl: the parent-death signal (set again after the jail's uid
  // change) and thread names.
  for (uint32_t op : {PR_SET_PDEATHSIG, PR_SET_NAME, PR_GET_NAME})
    p.rules.push_back(Rule{SYS_prctl, ok, ArgCheck{0, ArgCheck::Op::kEquals, op}});
  // seccomp: a filter more, which can only narrow (each vCPU thread adds
  // its own, vcpu_thread_policy); no other operation.
  p.rules.push_back(Rule{SYS_seccomp, ok, ArgCheck{0, ArgCheck::Op::kEquals, SECCOMP_SET_MODE_FILTER}});
  // Devices, the channel and the control socket (inherited: no socket,
  // connect, bind or accept), the logs, waiting.
  allow_all({SYS_read, SYS_write, SYS_readv, SYS_writev, SYS_pread64, SYS_pwrite64, SYS_preadv, SYS_pwritev,
             SYS_preadv2, SYS_pwritev2, SYS_lseek, SYS_close, SYS_fsync, SYS_fdatasync, SYS_ftruncate,
             SYS_fallocate, SYS_fcntl, SYS_fstat, SYS_newfstatat, SYS_statx, SYS_sendmsg, SYS_recvmsg, SYS_sendto,
             SYS_recvfrom, SYS_shutdown, SYS_ppoll, SYS_eventfd2, SYS_futex, SYS_sched_yield, SYS_nanosleep,
             SYS_clock_nanosleep, SYS_clock_gettime, SYS_clock_getres, SYS_gettimeofday, SYS_getrandom});
#ifdef SYS_poll
  allow_all({SYS_poll});
#endif
#ifdef SYS_time
  allow_all({SYS_time});
#endif
  // Opening and naming files, only for a VMM that is to write a snapshot
  // (in a jail the one writable place is /snapshot); any other VMM opens
  // nothing once it runs, jailed or not.
  if (snapshot_files) {
    allow_all({SYS_openat, SYS_mkdirat, SYS_renameat, SYS_renameat2, SYS_unlinkat});
#ifdef SYS_open
    allow_all({SYS_open, SYS_mkdir, SYS_rename, SYS_unlink});
#endif
  }
  allow_all({SYS_set_robust_list, SYS_rseq, SYS_gettid, SYS_getpid, SYS_getppid, SYS_getuid, SYS_geteuid,
             SYS_getgid, SYS_getegid, SYS_exit, SYS_exit_group, SYS_rt_sigaction, SYS_rt_sigprocmask,
             SYS_rt_sigreturn, SYS_sigaltstack, SYS_restart_syscall, SYS_sched_getaffinity});
  return p;
}

sys::seccomp::Policy vcpu_thread_policy() {
  using namespace sys::seccomp;
  Policy p;
  p.default_action = allow();  // the process's allow list decides the rest
  p.foreign_action = kill_process();
  // clone fails with EPERM, unlogged: the C library blocks every signal
  // around it, and a trap's SIGSYS while blocked kills the process.
  p.rules.push_back(Rule{SYS_clone, fail_with(EPERM), std::nullopt});
  for (long nr : {long(SYS_openat), long(SYS_mkdirat), long(SYS_renameat), long(SYS_renameat2), long(SYS_unlinkat),
                  long(SYS_memfd_create), long(SYS_userfaultfd), long(SYS_eventfd2),
                  long(SYS_sendmsg), long(SYS_recvmsg), long(SYS_sendto), long(SYS_recvfrom), long(SYS_shutdown),
                  long(SYS_ftruncate), long(SYS_fallocate)})
    p.rules.push_back(Rule{nr, trap(), std::nullopt});
#ifdef SYS_open
  for (long nr : {long(SYS_open), long(SYS_mkdir), long(SYS_rename), long(SYS_unlink)})
    p.rules.push_back(Rule{nr, trap(), std::nullopt});
#endif
  return p;
}

Status confine_vcpu_thread() {
  auto program = sys::seccomp::compile(vcpu_thread_policy());
  if (!program) return program.error();
  if (Status s = sys::seccomp::install(*program, /*all_threads=*/false); !s)
    return s.error().with_context("vcpu thread filter");
  return Status::Ok();
}

namespace {

// SIGSYS from either filter's trap: one line on the VMM's log
// (stderr) naming the syscall, and the call fails with EPERM. Only
// async-signal-safe calls (write, which the filter allows).
void refused_syscall(int, siginfo_t* info, void* context) {
  char line[80] = "sandgate-vmm: seccomp: refused syscall ";
  size_t n = std::strlen(line);
  char digits[12];
  size_t d = 0;
  unsigned v = static_cast<unsigned>(info->si_syscall);
  do digits[d++] = static_cast<char>('0' + v % 10); while ((v /= 10) != 0 && d < sizeof(digits));
  while (d > 0) line[n++] = digits[--d];
  line[n++] = '\n';
  ssize_t w = ::write(STDERR_FILENO, line, n);
  (void)w;
  auto* uc = static_cast<ucontext_t*>(context);
#if defined(__x86_64__)
  uc->uc_mcontext.gregs[REG_RAX] = -EPERM;
#elif defined(__aarch64__)
  uc->uc_mcontext.regs[0] = static_cast<uint64_t>(-EPERM);
#endif
}

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

Status confine_vmm(const Jail* jail, bool snapshot_files) {
  // The C library reads the time zone (/etc/localtime) on the first
  // gmtime_r, which the log's time stamps call: done now, while files can
  // still be opened, not on the first log line after the filter.
  ::tzset();
  if (::unshare(CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS) != 0)
    return sys::errno_error("unshare", "network, IPC and UTS namespaces");
  if (jail)
    if (Status s = enter_jail(*jail); !s) return s.error().with_context("jail");
  if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return sys::errno_error("prctl PR_SET_NO_NEW_PRIVS", "vmm");
  auto program = sys::seccomp::compile(vmm_syscall_policy(::getpid(), snapshot_files));
  if (!program) return program.error();
  struct sigaction sa {};
  sa.sa_sigaction = refused_syscall;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  if (::sigaction(SIGSYS, &sa, nullptr) != 0) return sys::errno_error("sigaction", "SIGSYS");
  return sys::seccomp::install(*program, /*all_threads=*/false);
}

}  // namespace sg::vmm
