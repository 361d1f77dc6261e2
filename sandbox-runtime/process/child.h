// The cloned child of a process sandbox, from clone() to execve() of the
// agent. It runs in a copy of a multi-threaded parent's address space, so it
// may only make async-signal-safe system calls: no allocation, no locks, no
// stdio. Everything it needs is prepared by the parent in ChildArgs. A
// failing step is reported as (step, errno) on err_fd (close-on-exec, so EOF
// there means execve succeeded); the parent turns it into a message.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

namespace sg::process {

enum class ChildStep : int32_t {
  kSyncWait = 1,
  kPdeathSig,
  kCgroupNs,
  kHostname,
  kMakePrivate,
  kRlimit,
  kChdirState,
  kMountDisk,
  kMkdirLayer,
  kAttachLower,
  kMountOverlay,
  kMkdirSandgate,
  kCreateAgentFile,
  kBindAgent,
  kRemountAgentRo,
  kMountProc,
  kMountDev,
  kMknod,
  kMountDevpts,
  kMountShm,
  kSymlinkDev,
  kMountSys,
  kPivotRoot,
  kDetachOldRoot,
  kChdir,
  kSetupFds,
  kExecAgent,
};

struct ChildDevice {
  const char* path;  // absolute host path under merged/dev
  mode_t mode;
  dev_t dev;
};

struct ChildSymlink {
  const char* target;
  const char* path;
};

inline constexpr int kChildDevices = 6;
inline constexpr int kChildSymlinks = 5;
inline constexpr int kChildMaxLayers = 64;  // runtime::kMaxTemplateLayers

struct ChildArgs {
  // Descriptors, all >= 10 so the fixed targets 0..4 never collide.
  int sync_fd = -1;      // read end: one byte means "you are in the cgroups, go"
  int sync_wr_fd = -1;   // parent's write end, closed by the child first
  int err_fd = -1;       // write end of the error pipe
  int err_rd_fd = -1;    // parent's read end
  int channel_fd = -1;   // sandbox end of the channel, becomes fd 3
  int host_channel_fd = -1;
  int null_fd = -1;      // /dev/null of the host, becomes fd 0
  int log_fd = -1;       // agent log file, becomes fds 1 and 2
  bool die_with_parent = true;  // PR_SET_PDEATHSIG SIGKILL (RuntimeConfig::sandboxes_outlive_host off)

  // RLIMIT_NOFILE of every process in the sandbox (set while the child is
  // still host root; nothing inside can raise the hard limit).
  uint64_t nofile_soft = 0;
  uint64_t nofile_hard = 0;
  const char* hostname = nullptr;
  size_t hostname_len = 0;
  const char* merged = nullptr;
  // The sandbox's state directory, the child's working directory from the
  // first mount on: the overlay's options and the disk's source are
  // relative to it, because the kernel shows them in the sandbox's
  // /proc/self/mountinfo as given, and host paths must not show there.
  const char* state_dir = nullptr;
  // The size-limited writable layer (process/disk.h), mounted here before
  // the overlay; disk_node null: the layer is a plain host directory.
  const char* disk_node = nullptr;   // relative to state_dir
  const char* disk_dir = nullptr;
  const char* disk_upper = nullptr;  // disk_dir/upper and disk_dir/work,
  const char* disk_work = nullptr;   // named in overlay_opts
  // The template: a detached tree of it (idmapped in user namespace mode,
  // process/userns.h), attached on lower_dir before the overlay (named in
  // overlay_opts). In user namespace mode the disk's upper and work
  // directories are given to layer_owner (the sandbox's root) and
  // userns_fd becomes fd 5 for the agent to join.
  int lower_tree_fd = -1;
  const char* lower_dir = nullptr;
  // A built template's layers over it, attached the same way (named in
  // overlay_opts above lower_dir).
  int layer_tree_fds[kChildMaxLayers] = {};
  const char* layer_dirs[kChildMaxLayers] = {};
  int layers = 0;
  int layer_owner = -1;
  int userns_fd = -1;
  const char* overlay_opts = nullptr;
  const char* sandgate_dir = nullptr;  // merged/.sandgate
  // The agent: a detached clone of its private tmpfs copy
  // (process/agent_tree.h), moved onto agent_dst; where the kernel cannot
  // make one (-1), agent_src, the host file, is bound there instead.
  int agent_tree_fd = -1;
  const char* agent_src = nullptr;
  const char* agent_dst = nullptr;     // merged/.sandgate/sandgate-agent
  const char* proc_dir = nullptr;
  const char* dev_dir = nullptr;
  const char* devpts_dir = nullptr;
  const char* devpts_opts = nullptr;  // its gid= is the sandbox's tty group as the host sees it
  const char* shm_dir = nullptr;
  const char* sys_dir = nullptr;
  ChildDevice devices[kChildDevices] = {};
  ChildSymlink symlinks[kChildSymlinks] = {};
  const char* agent_exec = nullptr;  // path inside the sandbox
  char* const* argv = nullptr;
  char* const* envp = nullptr;
};

struct ChildError {
  int32_t step = 0;
  int32_t err = 0;
};

// clone() entry point; arg is a ChildArgs*. Returns only on failure.
int child_main(void* arg);

// "mount overlay on /state/x/merged" for the parent's error message.
std::string describe_step(ChildStep step, const ChildArgs& a);

}  // namespace sg::process
