// The agent's private tmpfs copy (agent_tree.h).
#include "sandbox-runtime/process/agent_tree.h"

#include <fcntl.h>
#include <sys/mount.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "base/sys.h"

namespace sg::process {

namespace {

constexpr const char* kAgentName = "sandgate-agent";

Status fsconfig_string(int fs, const char* key, const std::string& value) {
  if (::fsconfig(fs, FSCONFIG_SET_STRING, key, value.c_str(), 0) != 0)
    return sys::errno_error(std::string("fsconfig ") + key, "the agent's tmpfs");
  return Status::Ok();
}

}  // namespace

Result<UniqueFd> make_agent_tree(const std::string& agent_path) {
  UniqueFd src(::open(agent_path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!src) return sys::errno_error("open", agent_path);
  struct stat st {};
  if (::fstat(src.get(), &st) != 0) return sys::errno_error("fstat", agent_path);
  if (!S_ISREG(st.st_mode)) return internal_error("agent binary " + agent_path + ": not a regular file");

  UniqueFd fs(::fsopen("tmpfs", FSOPEN_CLOEXEC));
  if (!fs) {
    int err = errno;
    return Error(ErrorKind::kUnavailable, std::string("fsopen tmpfs: ") + std::strerror(err));
  }
  // Room for the file and tmpfs's own rounding; "sandgate" is what
  // mountinfo shows as the source.
  uint64_t size = ((static_cast<uint64_t>(st.st_size) >> 20) + 2) << 20;
  for (auto [k, v] : {std::pair<const char*, std::string>{"source", "sandgate"},
                      {"size", std::to_string(size)}, {"nr_inodes", "16"}, {"mode", "0755"}})
    if (Status s = fsconfig_string(fs.get(), k, v); !s) return s.error();
  if (::fsconfig(fs.get(), FSCONFIG_CMD_CREATE, nullptr, nullptr, 0) != 0)
    return sys::errno_error("fsconfig FSCONFIG_CMD_CREATE", "the agent's tmpfs");
  UniqueFd tree(::fsmount(fs.get(), FSMOUNT_CLOEXEC, MOUNT_ATTR_NODEV | MOUNT_ATTR_NOSUID));
  if (!tree) return sys::errno_error("fsmount", "the agent's tmpfs");

  UniqueFd dst(::openat(tree.get(), kAgentName, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0755));
  if (!dst) return sys::errno_error("create", std::string("the agent's copy on its tmpfs"));
  for (off_t done = 0; done < st.st_size;) {
    ssize_t n = ::sendfile(dst.get(), src.get(), &done, static_cast<size_t>(st.st_size - done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return sys::errno_error("copy", agent_path + " to the agent's tmpfs");
    if (n == 0) return internal_error("copy " + agent_path + ": it shrank while being copied");
  }
  // The umask applied at create; the agent must be executable by a
  // sandbox's root, which in a user namespace is not the file's owner.
  if (::fchmod(dst.get(), 0755) != 0) return sys::errno_error("fchmod", "the agent's copy");
  dst.reset();
  // Kernels before 6.15 refuse to clone from a detached mount: find out
  // now, once, rather than at every create.
  if (Result<UniqueFd> probe = clone_agent(tree.get()); !probe)
    return Error(ErrorKind::kUnavailable, probe.error().message());
  return tree;
}

Result<UniqueFd> clone_agent(int tree, sys::Os& os) {
  UniqueFd c(os.open_tree(tree, kAgentName, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC));
  if (!c) return sys::errno_error("open_tree OPEN_TREE_CLONE", "the agent's tmpfs copy");
  int hi = ::fcntl(c.get(), F_DUPFD_CLOEXEC, 10);
  if (hi < 0) return sys::errno_error("fcntl F_DUPFD_CLOEXEC", "the agent's mount");
  return UniqueFd(hi);
}

}  // namespace sg::process
