// Sandbox hardening by the agent (harden.h).
#include "agent/harden.h"

#include <linux/capability.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "sys/sys.h"

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

uint64_t kept_capabilities() {
  uint64_t m = 0;
  for (int c : {CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_FSETID, CAP_FOWNER, CAP_SETGID, CAP_SETUID, CAP_SETPCAP,
                CAP_NET_BIND_SERVICE, CAP_NET_RAW, CAP_SYS_CHROOT, CAP_KILL, CAP_AUDIT_WRITE, CAP_SETFCAP})
    m |= 1ull << c;
  return m;
}

Status harden_sandbox(const std::string& proc_root, const std::string& sys_root) {
  for (const char* p : kProcMasked)
    if (Status s = mask(proc_root + "/" + p); !s) return s;
  if (Status s = mask(sys_root + "/firmware"); !s) return s;
  // Read-only last: "sys" is among them, and the masks above do not touch it.
  for (const char* p : kProcReadOnly)
    if (Status s = read_only(proc_root + "/" + p); !s) return s;

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
  return Status::Ok();
}

}  // namespace sg::agent
