// User namespaces and idmapped template trees for process sandboxes (userns.h).
#include "sandbox-runtime/process/userns.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "base/sys.h"

namespace sg::process {

Status user_namespaces_available() {
  auto max = sys::read_file("/proc/sys/user/max_user_namespaces", 64);
  if (max && std::atol(max->c_str()) <= 0)
    return Error(ErrorKind::kUnavailable, "user namespaces are disabled (/proc/sys/user/max_user_namespaces is 0)");
  Result<UniqueFd> ns = make_user_namespace(kUidsPerSandbox, 1);
  if (!ns) return Error(ErrorKind::kUnavailable, ns.error().message());
  return Status::Ok();
}

Result<UniqueFd> make_user_namespace(uint32_t host_base, uint32_t count) {
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) return sys::errno_error("pipe2", "user namespace helper");
  UniqueFd rd(p[0]), wr(p[1]);
  // A bare clone (no handlers, no allocation in the child): the helper only
  // waits for EOF on the pipe, which also comes if this process dies.
  long pid = ::syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, nullptr, nullptr, nullptr, nullptr);
  if (pid < 0) return sys::errno_error("clone CLONE_NEWUSER", "user namespace helper");
  if (pid == 0) {
    ::close(p[1]);  // else its own copy keeps the pipe open
    char c;
    while (::read(p[0], &c, 1) < 0 && errno == EINTR) {
    }
    ::_exit(0);
  }
  rd.reset();
  auto finish = [&] {
    wr.reset();
    int st;
    while (::waitpid(static_cast<pid_t>(pid), &st, 0) < 0 && errno == EINTR) {
    }
  };
  std::string proc = "/proc/" + std::to_string(pid);
  std::string map = "0 " + std::to_string(host_base) + " " + std::to_string(count) + "\n";
  for (const char* f : {"/uid_map", "/gid_map"}) {
    if (Status s = sys::write_file(proc + f, map); !s) {
      finish();
      return s.error().with_context("map the sandbox user namespace onto host ids " + std::to_string(host_base) +
                                    ".." + std::to_string(host_base + count - 1));
    }
  }
  UniqueFd ns(::open((proc + "/ns/user").c_str(), O_RDONLY | O_CLOEXEC));
  int err = errno;
  finish();
  if (!ns) return sys::errno_error("open", proc + "/ns/user", err);
  return ns;
}

Result<UniqueFd> idmapped_tree(const std::string& dir, int userns_fd, sys::Os& os) {
  UniqueFd tree(os.open_tree(AT_FDCWD, dir.c_str(), OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE));
  if (!tree) return sys::errno_error("open_tree", dir);
  struct mount_attr attr {};
  attr.attr_set = MOUNT_ATTR_IDMAP | MOUNT_ATTR_RDONLY | MOUNT_ATTR_NODEV;
  attr.userns_fd = static_cast<uint64_t>(userns_fd);
  if (::mount_setattr(tree.get(), "", AT_EMPTY_PATH | AT_RECURSIVE, &attr, sizeof attr) != 0) {
    int err = errno;
    if (err == EINVAL || err == ENOSYS || err == EPERM || err == EOPNOTSUPP)
      return Error(ErrorKind::kUnavailable, "idmapped mount of " + dir + ": " + std::strerror(err) +
                                                " (its filesystem or this kernel cannot idmap mounts)");
    return sys::errno_error("mount_setattr MOUNT_ATTR_IDMAP", dir, err);
  }
  return tree;
}

Result<UidSlots::Slot> UidSlots::acquire() {
  std::lock_guard<std::mutex> l(mu_);
  for (uint32_t i = 0; i < used_.size(); ++i) {
    if (used_[i]) continue;
    uint32_t base = first_uid_ + i * kUidsPerSandbox;
    if (!ns_[i]) {
      Result<UniqueFd> ns = make_user_namespace(base, kUidsPerSandbox);
      if (!ns) return ns.error();
      ns_[i] = std::move(*ns);
    }
    used_[i] = true;
    return Slot{i, base, ns_[i].get()};
  }
  return Error(ErrorKind::kQuota, "all " + std::to_string(used_.size()) + " sandbox uid ranges are in use");
}

Result<UidSlots::Slot> UidSlots::adopt(uint32_t index, UniqueFd userns) {
  std::lock_guard<std::mutex> l(mu_);
  if (index >= used_.size()) return invalid_error("uid slot " + std::to_string(index) + " is out of range");
  if (used_[index]) return conflict_error("uid slot " + std::to_string(index) + " is held by another sandbox");
  ns_[index] = std::move(userns);
  used_[index] = true;
  return Slot{index, first_uid_ + index * kUidsPerSandbox, ns_[index].get()};
}

void UidSlots::release(uint32_t index) {
  std::lock_guard<std::mutex> l(mu_);
  if (index < used_.size()) used_[index] = false;
}

}  // namespace sg::process
