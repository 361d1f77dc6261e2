// The sandbox child between clone() and execve(): see child.h for the rules
// it lives by (async-signal-safe calls only, every input prepared by the
// parent). The mount sequence is documented in docs/process-backend.md.
#include "sandbox-runtime/process/child.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>

namespace sg::process {

namespace {

int fail(const ChildArgs& a, ChildStep step) {
  ChildError e{static_cast<int32_t>(step), errno};
  ssize_t r = ::write(a.err_fd, &e, sizeof e);
  (void)r;
  ::_exit(127);
}

bool ok_or_exists(int rc) { return rc == 0 || errno == EEXIST; }

}  // namespace

int child_main(void* arg) {
  // SAFETY: clone() passes back the pointer create() gave it, to a ChildArgs
  // that lives in the parent's frame until the child has exec'd or failed
  // (the child has its own copy of that memory anyway).
  auto& a = *static_cast<ChildArgs*>(arg);
  ::close(a.sync_wr_fd);
  ::close(a.err_rd_fd);
  ::close(a.host_channel_fd);

  // Die with the thread that created us (the Runtime's spawner thread),
  // unless the sandbox is to outlive sandgate. If it already died before
  // this line, the sync read below sees EOF.
  if (a.die_with_parent && ::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) return fail(a, ChildStep::kPdeathSig);
  char go = 0;
  ssize_t n;
  do {
    n = ::read(a.sync_fd, &go, 1);
  } while (n < 0 && errno == EINTR);
  if (n != 1) {
    if (n == 0) errno = EPIPE;
    return fail(a, ChildStep::kSyncWait);
  }
  ::close(a.sync_fd);
  // The parent has put us in the sandbox's cgroups: a cgroup namespace
  // rooted there makes /proc/<pid>/cgroup read "/" inside, not the host's
  // cgroup names.
  if (::unshare(CLONE_NEWCGROUP) != 0) return fail(a, ChildStep::kCgroupNs);

  // Reset what the server's threads may have changed and exec keeps: the
  // signal mask and ignored signals.
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  struct sigaction dfl = {};
  dfl.sa_handler = SIG_DFL;
  for (int sig = 1; sig < NSIG; ++sig) ::sigaction(sig, &dfl, nullptr);

  if (::sethostname(a.hostname, a.hostname_len) != 0) return fail(a, ChildStep::kHostname);
  struct rlimit nofile = {a.nofile_soft, a.nofile_hard};
  if (::setrlimit(RLIMIT_NOFILE, &nofile) != 0) return fail(a, ChildStep::kRlimit);
  if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return fail(a, ChildStep::kMakePrivate);
  if (::chdir(a.state_dir) != 0) return fail(a, ChildStep::kChdirState);
  if (a.disk_node) {
    // In this namespace only (/ is private now): it goes when the sandbox does.
    if (::mount(a.disk_node, a.disk_dir, "ext4", MS_NODEV, "discard") != 0) return fail(a, ChildStep::kMountDisk);
    if (!ok_or_exists(::mkdir(a.disk_upper, 0755)) || !ok_or_exists(::mkdir(a.disk_work, 0700)))
      return fail(a, ChildStep::kMkdirLayer);
    if (a.layer_owner >= 0 && ::chown(a.disk_upper, a.layer_owner, a.layer_owner) != 0)
      return fail(a, ChildStep::kMkdirLayer);
  }
  if (::move_mount(a.lower_tree_fd, "", AT_FDCWD, a.lower_dir, MOVE_MOUNT_F_EMPTY_PATH) != 0)
    return fail(a, ChildStep::kAttachLower);
  for (int i = 0; i < a.layers; ++i)
    if (::move_mount(a.layer_tree_fds[i], "", AT_FDCWD, a.layer_dirs[i], MOVE_MOUNT_F_EMPTY_PATH) != 0)
      return fail(a, ChildStep::kAttachLower);
  if (::mount("overlay", a.merged, "overlay", 0, a.overlay_opts) != 0) return fail(a, ChildStep::kMountOverlay);

  if (!ok_or_exists(::mkdir(a.sandgate_dir, 0755))) return fail(a, ChildStep::kMkdirSandgate);
  int f = ::open(a.agent_dst, O_WRONLY | O_CREAT | O_CLOEXEC, 0755);
  if (f < 0) return fail(a, ChildStep::kCreateAgentFile);
  ::close(f);
  if (a.agent_tree_fd >= 0) {
    if (::move_mount(a.agent_tree_fd, "", AT_FDCWD, a.agent_dst, MOVE_MOUNT_F_EMPTY_PATH) != 0)
      return fail(a, ChildStep::kBindAgent);
  } else if (::mount(a.agent_src, a.agent_dst, nullptr, MS_BIND, nullptr) != 0) {
    return fail(a, ChildStep::kBindAgent);
  }
  if (::mount(nullptr, a.agent_dst, nullptr, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, nullptr) != 0)
    return fail(a, ChildStep::kRemountAgentRo);

  if (!ok_or_exists(::mkdir(a.proc_dir, 0555)) ||
      ::mount("proc", a.proc_dir, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr) != 0)
    return fail(a, ChildStep::kMountProc);

  if (!ok_or_exists(::mkdir(a.dev_dir, 0755)) ||
      ::mount("tmpfs", a.dev_dir, "tmpfs", MS_NOSUID | MS_STRICTATIME, "mode=755,size=65536k") != 0)
    return fail(a, ChildStep::kMountDev);
  for (const ChildDevice& d : a.devices) {
    if (::mknod(d.path, d.mode, d.dev) != 0) return fail(a, ChildStep::kMknod);
    // mknod applies the umask; the nodes must be world-usable.
    if (::chmod(d.path, d.mode & 07777) != 0) return fail(a, ChildStep::kMknod);
  }
  if (!ok_or_exists(::mkdir(a.devpts_dir, 0755)) ||
      ::mount("devpts", a.devpts_dir, "devpts", MS_NOSUID | MS_NOEXEC, a.devpts_opts) != 0)
    return fail(a, ChildStep::kMountDevpts);
  if (!ok_or_exists(::mkdir(a.shm_dir, 01777)) ||
      ::mount("shm", a.shm_dir, "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=65536k") != 0)
    return fail(a, ChildStep::kMountShm);
  for (const ChildSymlink& s : a.symlinks)
    if (::symlink(s.target, s.path) != 0) return fail(a, ChildStep::kSymlinkDev);

  if (!ok_or_exists(::mkdir(a.sys_dir, 0555)) ||
      ::mount("sysfs", a.sys_dir, "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr) != 0)
    return fail(a, ChildStep::kMountSys);

  // pivot_root(".", ".") stacks the old root on top of the new one; the
  // detach then drops every host mount from this namespace.
  if (::chdir(a.merged) != 0) return fail(a, ChildStep::kChdir);
  if (::syscall(SYS_pivot_root, ".", ".") != 0) return fail(a, ChildStep::kPivotRoot);
  if (::umount2(".", MNT_DETACH) != 0) return fail(a, ChildStep::kDetachOldRoot);
  if (::chdir("/") != 0) return fail(a, ChildStep::kChdir);

  // Fixed descriptors: 0 /dev/null, 1-2 the agent log, 3 the channel, 4 the
  // error pipe until exec. Sources are >= 10, so no dup2 clobbers another.
  if (::dup2(a.null_fd, 0) < 0 || ::dup2(a.log_fd, 1) < 0 || ::dup2(a.log_fd, 2) < 0 ||
      ::dup2(a.channel_fd, 3) < 0 || ::dup3(a.err_fd, 4, O_CLOEXEC) < 0)
    return fail(a, ChildStep::kSetupFds);
  a.err_fd = 4;
  unsigned first_closed = 5;
  if (a.userns_fd >= 0) {
    if (::dup2(a.userns_fd, 5) < 0) return fail(a, ChildStep::kSetupFds);  // the agent closes it
    first_closed = 6;
  }
  // Whatever else the server's threads had open stays out of the sandbox.
  if (::syscall(SYS_close_range, first_closed, ~0u, 0u) != 0) return fail(a, ChildStep::kSetupFds);

  ::execve(a.agent_exec, a.argv, a.envp);
  return fail(a, ChildStep::kExecAgent);
}

std::string describe_step(ChildStep step, const ChildArgs& a) {
  auto s = [](const char* p) { return std::string(p ? p : "?"); };
  switch (step) {
    case ChildStep::kSyncWait: return "wait for the parent";
    case ChildStep::kPdeathSig: return "prctl PR_SET_PDEATHSIG";
    case ChildStep::kCgroupNs: return "unshare CLONE_NEWCGROUP";
    case ChildStep::kChdirState: return "chdir into " + s(a.state_dir);
    case ChildStep::kHostname: return "sethostname " + s(a.hostname);
    case ChildStep::kMakePrivate: return "make / rprivate";
    case ChildStep::kRlimit: return "setrlimit RLIMIT_NOFILE";
    case ChildStep::kMountDisk:
      return "mount the writable layer " + s(a.state_dir) + "/" + s(a.disk_node) + " on " + s(a.disk_dir);
    case ChildStep::kMkdirLayer: return "mkdir " + s(a.disk_upper) + " and " + s(a.disk_work);
    case ChildStep::kAttachLower: return "attach the template on " + s(a.lower_dir);
    case ChildStep::kMountOverlay: return "mount overlay on " + s(a.merged) + " (" + s(a.overlay_opts) + ")";
    case ChildStep::kMkdirSandgate: return "mkdir " + s(a.sandgate_dir);
    case ChildStep::kCreateAgentFile: return "create mount point " + s(a.agent_dst);
    case ChildStep::kBindAgent:
      return (a.agent_tree_fd >= 0 ? std::string("attach the agent's copy") : "bind " + s(a.agent_src)) + " on " +
             s(a.agent_dst);
    case ChildStep::kRemountAgentRo: return "remount read-only " + s(a.agent_dst);
    case ChildStep::kMountProc: return "mount proc on " + s(a.proc_dir);
    case ChildStep::kMountDev: return "mount tmpfs on " + s(a.dev_dir);
    case ChildStep::kMknod: return "mknod in " + s(a.dev_dir);
    case ChildStep::kMountDevpts: return "mount devpts on " + s(a.devpts_dir);
    case ChildStep::kMountShm: return "mount tmpfs on " + s(a.shm_dir);
    case ChildStep::kSymlinkDev: return "create symlinks in " + s(a.dev_dir);
    case ChildStep::kMountSys: return "mount sysfs on " + s(a.sys_dir);
    case ChildStep::kPivotRoot: return "pivot_root into " + s(a.merged);
    case ChildStep::kDetachOldRoot: return "detach the old root";
    case ChildStep::kChdir: return "chdir into " + s(a.merged);
    case ChildStep::kSetupFds: return "set up descriptors 0-4";
    case ChildStep::kExecAgent: return "execve " + s(a.agent_exec);
  }
  return "step " + std::to_string(static_cast<int>(step));
}

}  // namespace sg::process
