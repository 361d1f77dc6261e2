// Sandbox hardening by the agent (harden.h).
#include "sandbox-runtime/agent/harden.h"

#include <grp.h>
#include <linux/capability.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "base/log.h"
#include "base/sys.h"

namespace sg::agent {

namespace {

// What a container runtime masks (an empty file or directory over it) and
// what it makes read-only, under /proc; relative paths.
constexpr const char* kProcMasked[] = {"asound", "acpi", "kcore", "keys", "latency_stats", "timer_list",
                                       "timer_stats", "sched_debug", "scsi", "sysvipc"};
constexpr const char* kProcReadOnly[] = {"bus", "fs", "irq", "sys", "sysrq-trigger"};

Status mask(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return Status::Ok();
    return sys::errno_error("stat", path);
  }
  if (S_ISDIR(st.st_mode)) {
    if (::mount("tmpfs", path.c_str(), "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=0,mode=555") != 0)
      return sys::errno_error("mask (tmpfs over)", path);
  } else if (::mount("/dev/null", path.c_str(), nullptr, MS_BIND, nullptr) != 0) {
    return sys::errno_error("mask (/dev/null over)", path);
  }
  return Status::Ok();
}

Status read_only(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return Status::Ok();
    return sys::errno_error("stat", path);
  }
  if (::mount(path.c_str(), path.c_str(), nullptr, MS_BIND | MS_REC, nullptr) != 0)
    return sys::errno_error("bind", path);
  if (::mount(nullptr, path.c_str(), nullptr, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
              nullptr) != 0)
    return sys::errno_error("remount read-only", path);
  return Status::Ok();
}

int last_cap() {
  auto t = sys::read_file("/proc/sys/kernel/cap_last_cap", 64);
  int v = t ? std::atoi(t->c_str()) : 0;
  return v > 0 && v < 64 ? v : 40;
}

}  // namespace

sys::seccomp::Policy sandbox_syscall_policy() {
  using namespace sys::seccomp;
  Policy p;
  p.default_action = allow();
  p.foreign_action = kill_process();
  const uint32_t deny = fail_with(EPERM);
  auto refuse = [&](long nr) { p.rules.push_back(Rule{nr, deny, std::nullopt}); };
  // A new user namespace hands its creator every capability inside it (and
  // with them mount, the network stack's privileged paths, ...).
  p.rules.push_back(Rule{SYS_unshare, deny, ArgCheck{0, ArgCheck::Op::kAnyBitSet, CLONE_NEWUSER}});
  p.rules.push_back(Rule{SYS_clone, deny, ArgCheck{0, ArgCheck::Op::kAnyBitSet, CLONE_NEWUSER}});
  p.rules.push_back(Rule{SYS_clone3, fail_with(ENOSYS), std::nullopt});
  // setns: no joining other namespaces; userfaultfd: a tool of kernel exploits.
  for (long nr : {SYS_setns, SYS_userfaultfd}) refuse(nr);
  for (long nr : unneeded_kernel_surface()) refuse(nr);
  return p;
}

uint64_t kept_capabilities() {
  uint64_t m = 0;
  for (int c : {CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_FSETID, CAP_FOWNER, CAP_SETGID, CAP_SETUID, CAP_SETPCAP,
                CAP_NET_BIND_SERVICE, CAP_NET_RAW, CAP_SYS_CHROOT, CAP_KILL, CAP_AUDIT_WRITE, CAP_SETFCAP})
    m |= 1ull << c;
  return m;
}

Status harden_sandbox(int userns_fd, const std::string& proc_root, const std::string& sys_root) {
  if (userns_fd >= 0) {
    // Per network namespace; written while /proc/sys is still writable
    // and this process is host root. Conveniences, not boundaries: a
    // failure is logged and the sandbox starts.
    for (auto [knob, value] : {std::pair{"ip_unprivileged_port_start", "0"}, std::pair{"ping_group_range", "0 2147483647"}})
      if (Status s = sys::write_file(proc_root + "/sys/net/ipv4/" + knob, value); !s)
        LOG_WARN("agent: " << s.error().message() << " (root inside cannot bind ports under 1024 or ping)");
  }
  for (const char* p : kProcMasked)
    if (Status s = mask(proc_root + "/" + p); !s) return s;
  if (Status s = mask(sys_root + "/firmware"); !s) return s;
  // Read-only last: "sys" is among them, and the masks above do not touch it.
  for (const char* p : kProcReadOnly)
    if (Status s = read_only(proc_root + "/" + p); !s) return s;

  if (userns_fd >= 0) {
    if (::setns(userns_fd, CLONE_NEWUSER) != 0) return sys::errno_error("setns", "the sandbox user namespace");
    ::close(userns_fd);
    // Still the host's uid 0, which the namespace does not map: become its
    // root (the sandbox's host uid range starts there).
    if (::setgroups(0, nullptr) != 0) return sys::errno_error("setgroups", "user namespace");
    if (::setresgid(0, 0, 0) != 0) return sys::errno_error("setresgid 0", "user namespace");
    if (::setresuid(0, 0, 0) != 0) return sys::errno_error("setresuid 0", "user namespace");
  }
  // The bounding set: every capability not kept goes.
  uint64_t keep = kept_capabilities();
  for (int c = 0; c <= last_cap(); ++c) {
    if (keep & (1ull << c)) continue;
    if (::prctl(PR_CAPBSET_DROP, c, 0, 0, 0) != 0 && errno != EINVAL)
      return sys::errno_error("prctl PR_CAPBSET_DROP", "capability " + std::to_string(c));
  }
  // Inheritable caps would pass an exec whatever the bounding set says.
  struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
  struct __user_cap_data_struct data[2] = {};
  if (::syscall(SYS_capget, &hdr, data) != 0) return sys::errno_error("capget", "agent");
  data[0].inheritable = data[1].inheritable = 0;
  if (::syscall(SYS_capset, &hdr, data) != 0) return sys::errno_error("capset", "agent");
  if (::prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0 && errno != EINVAL)
    return sys::errno_error("prctl PR_CAP_AMBIENT_CLEAR_ALL", "agent");
  // Last: the filter refuses mount, which the masks above needed. The agent
  // still has CAP_SYS_ADMIN, so no_new_privs is not needed (and not set:
  // setuid programs inside keep working).
  auto program = sys::seccomp::compile(sandbox_syscall_policy());
  if (!program) return program.error();
  return sys::seccomp::install(*program, /*all_threads=*/true);
}

}  // namespace sg::agent
