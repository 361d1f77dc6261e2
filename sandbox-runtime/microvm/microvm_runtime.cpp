// The microVM backend: spawning sandgate-vmm, template snapshots, clones.
#include "sandbox-runtime/microvm/microvm_runtime.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <linux/kvm.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>
#include <vector>

#include "sandbox-runtime/channel/control_message.h"
#include "sandbox-runtime/host/cgroup.h"
#include "sandbox-runtime/host/envd_client.h"
#include "sandbox-runtime/host/host_channel.h"
#include "sandbox-runtime/vmm/vm/attach_protocol.h"
#include "base/log.h"
#include "base/sys.h"

extern char** environ;

namespace sg::microvm {

using json = nlohmann::json;

namespace {

constexpr const char* kCmdline =
    "console=ttyS0 reboot=k panic=-1 quiet loglevel=4 i8042.nokbd i8042.noaux i8042.nopnp pci=off "
    "random.trust_cpu=on sandgate.hostname=sandbox";

uint64_t mtime_ns(const struct stat& st) {
  return static_cast<uint64_t>(st.st_mtim.tv_sec) * 1000000000ull + static_cast<uint64_t>(st.st_mtim.tv_nsec);
}

Result<struct stat> stat_of(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return sys::errno_error("stat", path);
  return st;
}

// Serialises the builds of one image: two sandgate processes never share
// a templates dir's writes, but two threads of one may both find it
// missing. One lock per image, so that a template's minute of mkfs does
// not hold up creates from others.
std::mutex& image_lock(const std::string& image) {
  static std::mutex map_mu;
  static std::map<std::string, std::unique_ptr<std::mutex>> locks;
  std::lock_guard g(map_mu);
  std::unique_ptr<std::mutex>& m = locks[image];
  if (!m) m = std::make_unique<std::mutex>();
  return *m;
}

// Bytes a directory tree needs on ext4: its blocks plus an inode's worth
// per entry. Does not follow symlinks or cross into other file systems'
// mounts (a template dir has none).
Result<uint64_t> tree_bytes(const std::string& dir) {
  std::error_code ec;
  uint64_t total = 0;
  auto it = std::filesystem::recursive_directory_iterator(dir, std::filesystem::directory_options::none, ec);
  if (ec) return internal_error("walk " + dir + ": " + ec.message());
  for (auto end = std::filesystem::recursive_directory_iterator(); it != end; it.increment(ec)) {
    if (ec) return internal_error("walk " + dir + ": " + ec.message());
    struct stat st {};
    if (::lstat(it->path().c_str(), &st) == 0) total += static_cast<uint64_t>(st.st_blocks) * 512 + 4096;
  }
  return total;
}

// A SOCK_SEQPACKET request/reply client for the VMM's control socket.
class Control {
 public:
  explicit Control(UniqueFd fd) : fd_(std::move(fd)) {}
  // fd_out: receives an fd the reply carries (SCM_RIGHTS), if any.
  // fds_in: descriptors sent with the command (at most 2).
  Result<std::string> call(const std::string& cmd, std::chrono::milliseconds timeout, UniqueFd* fd_out = nullptr,
                           std::vector<int> fds_in = {}) {
    std::lock_guard lock(mu_);
    // Replies carry no request id: after a timeout a late reply would be
    // taken for the next request's, so the socket is not used again.
    if (out_of_step_) return Error(ErrorKind::kUnavailable, "microVM control socket unusable after an earlier timeout");
    {
      struct iovec iov = {const_cast<char*>(cmd.data()), cmd.size()};
      struct msghdr mh {};
      mh.msg_iov = &iov;
      mh.msg_iovlen = 1;
      alignas(struct cmsghdr) char cbuf[CMSG_SPACE(2 * sizeof(int))] = {};
      if (!fds_in.empty()) {
        if (fds_in.size() > 2) return invalid_error("at most two descriptors ride with a command");
        mh.msg_control = cbuf;
        mh.msg_controllen = CMSG_SPACE(fds_in.size() * sizeof(int));
        struct cmsghdr* c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(fds_in.size() * sizeof(int));
        std::memcpy(CMSG_DATA(c), fds_in.data(), fds_in.size() * sizeof(int));
      }
      ssize_t n;
      do n = ::sendmsg(fd_.get(), &mh, MSG_NOSIGNAL);
      while (n < 0 && errno == EINTR);
      if (n != static_cast<ssize_t>(cmd.size()))
        return Error(ErrorKind::kUnavailable, "microVM control socket: " + std::string(std::strerror(errno)));
    }
    uint64_t deadline = sys::monotonic_ns() + static_cast<uint64_t>(timeout.count()) * 1000000ull;
    for (;;) {
      uint64_t now = sys::monotonic_ns();
      if (now >= deadline) {
        out_of_step_ = true;
        return Error(ErrorKind::kTimeout, "microVM did not answer \"" + cmd + "\" in time");
      }
      struct pollfd p = {fd_.get(), POLLIN, 0};
      int n = ::poll(&p, 1, static_cast<int>((deadline - now) / 1000000 + 1));
      if (n > 0) break;
      if (n < 0 && errno != EINTR) return sys::errno_error("poll", "microVM control socket");
    }
    char buf[4096];
    struct iovec iov = {buf, sizeof buf};
    struct msghdr mh {};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    alignas(struct cmsghdr) char cbuf[CMSG_SPACE(sizeof(int))];
    mh.msg_control = cbuf;
    mh.msg_controllen = sizeof cbuf;
    ssize_t r = ::recvmsg(fd_.get(), &mh, MSG_CMSG_CLOEXEC);
    if (r <= 0) return Error(ErrorKind::kUnavailable, "microVM control socket closed (the VMM exited)");
    UniqueFd passed;
    for (struct cmsghdr* c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS && c->cmsg_len == CMSG_LEN(sizeof(int))) {
        int fd = -1;
        std::memcpy(&fd, CMSG_DATA(c), sizeof fd);
        passed = UniqueFd(fd);
      }
    }
    if (fd_out) *fd_out = std::move(passed);
    std::string reply(buf, static_cast<size_t>(r));
    if (reply.rfind("ok", 0) == 0) return reply.size() > 3 ? reply.substr(3) : std::string();
    return internal_error("microVM: " + reply);
  }

 private:
  std::mutex mu_;
  UniqueFd fd_;         // GUARDED_BY(mu_)
  bool out_of_step_ = false;  // GUARDED_BY(mu_)
};

struct Spawned {
  pid_t pid = -1;
  UniqueFd channel;  // host end
  std::unique_ptr<Control> control;
};

// outlive: the VMM runs on when sandgate goes and waits for the next one
// (--outlive, docs/vmm.md "Restarts"); otherwise it dies with it.
// tap_fd: the host end of its network (fd 5 in the VMM), -1: none.
Result<Spawned> spawn_vmm(const std::string& vmm, std::vector<std::string> args, const std::string& dir,
                          const process::Cgroup* cgroup, bool outlive, int tap_fd = -1) {
  int ch[2], ctl[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, ch) != 0) return sys::errno_error("socketpair", "channel");
  UniqueFd ch_host(ch[0]), ch_vm(ch[1]);
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, ctl) != 0) return sys::errno_error("socketpair", "control");
  UniqueFd ctl_host(ctl[0]), ctl_vm(ctl[1]);
  // The dup2 actions below run in order: a source numbered 3, 4 or 5
  // would be overwritten by an earlier one (a TAP opened first in a
  // process with few fds is fd 3). Every source moves above them first.
  UniqueFd tap_high;
  for (UniqueFd* f : {&ch_vm, &ctl_vm}) {
    f->reset(::fcntl(f->get(), F_DUPFD_CLOEXEC, 16));
    if (!*f) return sys::errno_error("fcntl F_DUPFD", "VMM descriptors");
  }
  if (tap_fd >= 0) {
    tap_high.reset(::fcntl(tap_fd, F_DUPFD_CLOEXEC, 16));
    if (!tap_high) return sys::errno_error("fcntl F_DUPFD", "the TAP");
    tap_fd = tap_high.get();
  }
  std::vector<std::string> argv = {vmm};
  argv.insert(argv.end(), args.begin(), args.end());
  for (const char* a : {"--channel-fd", "3", "--control-fd", "4"}) argv.emplace_back(a);
  if (tap_fd >= 0)
    for (const char* a : {"--tap-fd", "5"}) argv.emplace_back(a);
  argv.emplace_back(outlive ? "--outlive" : "--die-with-parent");
  argv.emplace_back("--serial-log");
  argv.push_back(dir + "/serial.log");
  if (cgroup)
    for (const std::string& d : cgroup->dirs()) {
      argv.emplace_back("--cgroup-procs");
      argv.push_back(d + "/cgroup.procs");
    }
  std::string log = dir + "/vmm.log";
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  posix_spawn_file_actions_adddup2(&fa, ch_vm.get(), 3);
  posix_spawn_file_actions_adddup2(&fa, ctl_vm.get(), 4);
  if (tap_fd >= 0) posix_spawn_file_actions_adddup2(&fa, tap_fd, 5);
  // Nothing else of sandgate's (its listening sockets, its database):
  // a VMM that outlives it must not hold its port.
  posix_spawn_file_actions_addclosefrom_np(&fa, tap_fd >= 0 ? 6 : 5);
  std::vector<char*> cargs;
  for (auto& a : argv) cargs.push_back(a.data());
  cargs.push_back(nullptr);
  char* envp[] = {nullptr};
  Spawned s;
  int rc = ::posix_spawn(&s.pid, vmm.c_str(), &fa, nullptr, cargs.data(), envp);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) return sys::errno_error("spawn", vmm, rc);
  s.channel = std::move(ch_host);
  s.control = std::make_unique<Control>(std::move(ctl_host));
  return s;
}

// chown 0:0 of a directory and the files in it (a snapshot: flat).
Status own_by_root(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (!d) return sys::errno_error("opendir", dir);
  Status st;
  while (struct dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n == "." || n == "..") continue;
    std::string p = dir + "/" + n;
    if (::lchown(p.c_str(), 0, 0) != 0 && st) st = sys::errno_error("chown", p);
  }
  ::closedir(d);
  if (::chown(dir.c_str(), 0, 0) != 0 && st) st = sys::errno_error("chown", dir);
  return st;
}

// Host uids (gid = uid) of jailed VMMs: first + k for the k-th in use, so
// no two live VMMs share one (one could signal or read the other).
class VmmUids {
 public:
  VmmUids(uint32_t first, uint32_t n) : first_(first), used_(n, false) {}
  Result<uint32_t> acquire() {
    std::lock_guard lock(mu_);
    for (size_t k = 0; k < used_.size(); ++k)
      if (!used_[k]) {
        used_[k] = true;
        return first_ + static_cast<uint32_t>(k);
      }
    return Error(ErrorKind::kQuota, "all " + std::to_string(used_.size()) + " VMM uids are in use");
  }
  void release(uint32_t uid) {
    std::lock_guard lock(mu_);
    if (uid >= first_ && uid - first_ < used_.size()) used_[uid - first_] = false;
  }
  // A VMM of a previous run, taken back, holds its uid again.
  Status adopt(uint32_t uid) {
    std::lock_guard lock(mu_);
    if (uid < first_ || uid - first_ >= used_.size()) return invalid_error("VMM uid " + std::to_string(uid) + " is outside the range");
    if (used_[uid - first_]) return conflict_error("VMM uid " + std::to_string(uid) + " is in use by another VMM");
    used_[uid - first_] = true;
    return {};
  }

 private:
  std::mutex mu_;
  uint32_t first_;
  std::vector<bool> used_;  // GUARDED_BY(mu_)
};

// The uid a jailed VMM holds, given back once the VMM is reaped.
struct HeldUid {
  std::shared_ptr<VmmUids> pool;
  uint32_t uid = 0;
  HeldUid() = default;
  HeldUid(std::shared_ptr<VmmUids> p, uint32_t u) : pool(std::move(p)), uid(u) {}
  HeldUid(HeldUid&& o) noexcept : pool(std::move(o.pool)), uid(o.uid) {}
  HeldUid& operator=(HeldUid&& o) noexcept {
    reset();
    pool = std::move(o.pool);
    uid = o.uid;
    return *this;
  }
  ~HeldUid() { reset(); }
  void reset() {
    if (pool) pool->release(uid);
    pool.reset();
  }
};

// A sandbox's network (runtime::SandboxNetworks), released when the
// holder goes: a failed create, or the sandbox's VMM reaped.
struct HeldNetwork {
  runtime::SandboxNetworks* networks = nullptr;
  std::string id;
  runtime::SandboxNetworks::Link link;
  HeldNetwork() = default;
  HeldNetwork(runtime::SandboxNetworks* n, std::string i) : networks(n), id(std::move(i)) {}
  HeldNetwork(HeldNetwork&& o) noexcept
      : networks(std::exchange(o.networks, nullptr)), id(std::move(o.id)), link(std::move(o.link)) {}
  HeldNetwork& operator=(HeldNetwork&& o) noexcept {
    reset();
    networks = std::exchange(o.networks, nullptr);
    id = std::move(o.id);
    link = std::move(o.link);
    return *this;
  }
  ~HeldNetwork() { reset(); }
  explicit operator bool() const { return networks != nullptr; }
  // Kept for the next server (a sandbox that outlives this one): not released.
  void let_go() { networks = nullptr; }
  void reset() {
    if (networks) networks->release(id);
    networks = nullptr;
  }
};

// The lines of a VMM's log in which its seccomp filter refused a syscall
// (vm/confine.h): each is a path the allow list lacks, reported so an
// operator sees it (the KVM harness fails a run that has any).
void report_seccomp_refusals(const std::string& id, const std::string& log_path) {
  const std::string log = sys::read_tail(log_path, 64 * 1024);
  size_t at = 0;
  for (int n = 0; n < 8 && (at = log.find("seccomp: refused", at)) != std::string::npos; ++n) {
    size_t end = std::min(log.find('\n', at), at + 80);
    LOG_WARN("sandbox " << id << ": sandgate-vmm " << log.substr(at, end - at));
    at = end;
  }
}

void kill_and_reap(pid_t pid) {
  if (pid <= 0) return;
  ::kill(pid, SIGKILL);
  while (::waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
  }
}

class MicrovmSandbox final : public runtime::Sandbox {
 public:
  MicrovmSandbox(std::string id, std::string dir, Spawned s, uint64_t mem_limit)
      : id_(std::move(id)), dir_(std::move(dir)), pid_(s.pid), channel_(std::move(s.channel)),
        control_(std::move(s.control)), mem_limit_(mem_limit) {}
  // A sandbox that outlives sandgate (set_outlive) is let go, not killed:
  // its channel and control socket close and the VMM waits for the next host.
  ~MicrovmSandbox() override {
    if (outlive_) {
      std::shared_ptr<process::HostChannel> h;
      {
        std::lock_guard lock(mu_);
        h = std::move(host_);
        net_.let_go();  // its TAP stays with the VMM for the next server (adopt_tap)
      }
      if (h) h->stop();
      return;
    }
    (void)kill();
  }
  void set_outlive(bool on) { outlive_ = on; }
  // A VMM a previous run of sandgate started: not our child, so its end
  // is read from pidfd (poll) rather than waitpid.
  void set_adopted(UniqueFd pidfd) { pidfd_ = std::move(pidfd); }
  void set_paused_flag(bool p) { paused_ = p; }

  // The VMM's cgroup, removed once the VMM is gone.
  void set_cgroup(process::Cgroup cg) { cgroup_ = std::move(cg); }
  // The jailed VMM's uid, free for another VMM once this one is reaped.
  void set_uid(HeldUid uid) { uid_ = std::move(uid); }
  // Its network, released once the VMM is reaped.
  void set_network(HeldNetwork n) {
    std::lock_guard lock(mu_);
    net_ = std::move(n);
  }
  std::optional<runtime::SandboxNetworks::Link> network_link() {
    std::lock_guard lock(mu_);
    if (!net_) return std::nullopt;
    return net_.link;
  }
  uint32_t uid() {
    std::lock_guard lock(mu_);
    return uid_.uid;
  }
  // After new_host() to a running agent (recover()): what it queued for
  // the previous host is dropped, and this host's frames go out once it
  // has answered (HostChannel::settle; kTimeout: not yet, they wait).
  Status settle(std::chrono::milliseconds wait) {
    auto h = host();
    if (!h) return Error(ErrorKind::kUnavailable, "sandbox " + id_ + " has no channel");
    return h->settle(wait);
  }

  void attach_channel(const runtime::ServiceOpener& open_service) {
    host_ = std::make_shared<process::HostChannel>(id_, channel_.get(), open_service);
  }
  // A clone's agent is told that this is a new host: it drops the streams
  // and output of the one its snapshot was taken under.
  void new_host() {
    if (auto h = host()) h->release(/*reset=*/true);
  }

  const std::string& id() const override { return id_; }
  int init_pid() const override { return pid_; }
  int channel_fd() const override { return channel_.get(); }

  Status pause() override {
    auto r = control_->call("pause", std::chrono::milliseconds(10000));
    if (r) paused_ = true;
    return r ? Status() : Status(r.error());
  }
  Status resume() override {
    auto r = control_->call("resume", std::chrono::milliseconds(10000));
    if (r) paused_ = false;
    return r ? Status() : Status(r.error());
  }

  // A microVM snapshot into dest (runtime::is_vm_snapshot_layer): the
  // channel is held first (docs/channel.md, "Hold"), so nothing is in
  // flight in the snapshot, then the VM paused and its RAM and state
  // written by the VMM into files opened here (a jailed VMM opens none);
  // then it runs on (or stays paused) and the channel is released. What
  // is made of dest starts with the sandbox's processes and memory.
  Status export_layer(const std::string& dest) override {
    auto h = host();
    if (!h) return Error(ErrorKind::kUnavailable, "sandbox " + id_ + " has no channel");
    const bool was_paused = paused_;
    // The agent answers HOLD only while the VM runs.
    if (was_paused)
      if (Status r = resume(); !r) return r.error().with_context("run the paused microVM for its snapshot");
    if (Status held = h->hold(std::chrono::milliseconds(30000)); !held) {
      if (was_paused) (void)pause();
      return held.error().with_context("hold the channel for the snapshot");
    }
    Status written = [&]() -> Status {
      if (Status p = pause(); !p) return p;
      if (::mkdir(dest.c_str(), 0700) != 0) return sys::errno_error("mkdir", dest);
      std::string mem = dest + "/memory", state = dest + "/vm.state";
      UniqueFd mfd(::open(mem.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
      if (!mfd) return sys::errno_error("open", mem);
      UniqueFd sfd(::open((state + ".partial").c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
      if (!sfd) return sys::errno_error("open", state + ".partial");
      auto r = control_->call("snapshot-fds", std::chrono::milliseconds(600000), nullptr, {mfd.get(), sfd.get()});
      if (!r) return r.error();
      // vm.state last: its presence says the snapshot is whole.
      if (::rename((state + ".partial").c_str(), state.c_str()) != 0) return sys::errno_error("rename", state);
      UniqueFd d(::open(dest.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
      if (!d || ::fsync(d.get()) != 0) return sys::errno_error("fsync", dest);
      return {};
    }();
    Status back = was_paused ? Status() : resume();
    h->release(false);
    if (!written) return written.error().with_context("microVM snapshot of sandbox " + id_);
    if (!back) return back.error().with_context("resume sandbox " + id_ + " after its snapshot");
    return {};
  }
  Status kill() override {
    std::shared_ptr<process::HostChannel> h;
    {
      std::lock_guard lock(mu_);
      if (killed_) return {};
      killed_ = true;
      h = std::move(host_);
    }
    if (h && !h->running())
      LOG_WARN("sandbox " << id_ << ": killed after its channel closed; serial console: "
                          << sys::read_tail(dir_ + "/serial.log", 2000));
    if (h) h->stop();
    {
      std::lock_guard lock(mu_);
      // A VMM that ended on its own before this kill (the liveness sweep
      // had not looked yet) is reported: its logs go with the directory.
      int st = 0;
      if (pidfd_) {
        struct pollfd p = {pidfd_.get(), POLLIN, 0};
        if (!reaped_ && ::poll(&p, 1, 0) == 0) {
          ::syscall(SYS_pidfd_send_signal, pidfd_.get(), SIGKILL, nullptr, 0);
          if (::poll(&p, 1, 10000) != 1) LOG_WARN("sandbox " << id_ << ": its VMM (pid " << pid_ << ") did not end in 10 s");
        }
        reaped_ = true;  // init reaps it: it is not our child
      }
      if (!reaped_ && ::waitpid(pid_, &st, WNOHANG) == pid_) {
        reaped_ = true;
        LOG_WARN("sandbox " << id_ << ": " << exit_report_locked(st));
      }
      if (!reaped_) {
        kill_and_reap(pid_);
        reaped_ = true;
      }
      report_seccomp_refusals(id_, dir_ + "/vmm.log");
      uid_.reset();
      net_.reset();
      if (cgroup_) {
        if (Status s = cgroup_->destroy(std::chrono::milliseconds(5000)); !s)
          LOG_WARN("sandbox " << id_ << ": VMM cgroup: " << s.error().message());
        cgroup_.reset();
      }
    }
    return sys::remove_tree(dir_);
  }
  bool alive() override {
    std::lock_guard lock(mu_);
    if (reaped_ || killed_) return false;
    if (pidfd_) {
      struct pollfd p = {pidfd_.get(), POLLIN, 0};
      if (::poll(&p, 1, 0) == 0) return true;
      reaped_ = true;
      LOG_WARN("sandbox " << id_ << ": its VMM ended: " << sys::read_tail(dir_ + "/vmm.log", 1000));
      return false;
    }
    int st = 0;
    if (::waitpid(pid_, &st, WNOHANG) == pid_) {
      reaped_ = true;
      LOG_WARN("sandbox " << id_ << ": " << exit_report_locked(st));
      return false;
    }
    return true;
  }
  Result<runtime::Usage> usage() override {
    runtime::Usage u;
    u.mem_limit_bytes = mem_limit_;
    auto stat = sys::read_file("/proc/" + std::to_string(pid_) + "/stat", 4096);
    if (!stat) return Error(ErrorKind::kUnavailable, "microVM is gone");
    size_t rp = stat->rfind(')');
    if (rp != std::string::npos) {
      // Fields after ')': state(3) ppid(4) ... utime(14) stime(15).
      std::vector<std::string> f;
      size_t pos = rp + 2;
      while (pos < stat->size() && f.size() < 13) {
        size_t sp = stat->find(' ', pos);
        f.push_back(stat->substr(pos, sp - pos));
        if (sp == std::string::npos) break;
        pos = sp + 1;
      }
      if (f.size() >= 13) {
        uint64_t ticks = std::strtoull(f[11].c_str(), nullptr, 10) + std::strtoull(f[12].c_str(), nullptr, 10);
        u.cpu_usage_ns = ticks * (1000000000ull / static_cast<uint64_t>(::sysconf(_SC_CLK_TCK)));
      }
    }
    auto status = sys::read_file("/proc/" + std::to_string(pid_) + "/status", 16384);
    if (status) {
      size_t p = status->find("VmRSS:");
      if (p != std::string::npos) u.mem_used_bytes = std::strtoull(status->c_str() + p + 6, nullptr, 10) * 1024;
    }
    return u;
  }
  void set_template_memory(std::string path) { template_memory_ = std::move(path); }
  Result<runtime::GuestMemoryInfo> guest_memory() override {
    auto r = control_->call("meminfo", std::chrono::milliseconds(10000));
    if (!r) return r.error();
    auto j = nlohmann::json::parse(*r, nullptr, false);
    if (!j.is_object() || !j.contains("base") || !j["base"].is_number_unsigned() || !j.contains("size") ||
        !j["size"].is_number_unsigned() || !j.contains("backing") || !j["backing"].is_string())
      return internal_error("microVM: meminfo reply \"" + r->substr(0, 200) + "\"");
    runtime::GuestMemoryInfo m;
    m.pid = pid_;
    m.base = j["base"].get<uint64_t>();
    m.size = j["size"].get<uint64_t>();
    m.backing = j["backing"].get<std::string>();
    m.template_memory = template_memory_;
    return m;
  }
  Result<runtime::GuestMemoryRelease> release_guest_memory() override {
    UniqueFd fd;
    auto r = control_->call("release-memory", std::chrono::milliseconds(10000), &fd);
    if (!r) return r.error();
    auto j = nlohmann::json::parse(*r, nullptr, false);
    if (!j.is_object() || !j.contains("uffd") || !j["uffd"].is_boolean() || !j.contains("features") ||
        !j["features"].is_number_unsigned())
      return internal_error("microVM: release-memory reply \"" + r->substr(0, 200) + "\"");
    if (j["uffd"].get<bool>() != bool(fd)) return internal_error("microVM: release-memory reply and passed fd disagree");
    runtime::GuestMemoryRelease out;
    out.uffd = std::move(fd);
    out.features = j["features"].get<uint64_t>();
    return out;
  }
  Result<UniqueFd> open_port(uint16_t port) override {
    auto h = host();
    if (!h) return Error(ErrorKind::kUnavailable, "sandbox " + id_ + " has no channel");
    return h->open_port(port);
  }
  Result<std::string> control(std::string request, std::chrono::milliseconds timeout) override {
    auto h = host();
    if (!h) return Error(ErrorKind::kUnavailable, "sandbox " + id_ + " has no channel");
    return h->control(std::move(request), timeout);
  }
  Result<std::string> vmm(const std::string& cmd, std::chrono::milliseconds timeout) { return control_->call(cmd, timeout); }

 private:
  // How the VMM ended on its own: its wait status, the OOM kills its
  // cgroup counted, the ends of its log and of the guest's serial console.
  std::string exit_report_locked(int st) {
    std::string r = "sandgate-vmm exited (" +
                    (WIFEXITED(st) ? "status " + std::to_string(WEXITSTATUS(st)) : "signal " + std::to_string(WTERMSIG(st)));
    if (cgroup_) {
      Result<uint64_t> oom = cgroup_->oom_kills();
      if (oom && *oom > 0) r += "; the OOM killer of its cgroup killed " + std::to_string(*oom) + " task(s)";
    }
    return r + "): " + sys::read_tail(dir_ + "/vmm.log", 1000) + "; serial console: " +
           sys::read_tail(dir_ + "/serial.log", 2000);
  }

  std::shared_ptr<process::HostChannel> host() {
    std::lock_guard lock(mu_);
    return host_;
  }

  std::string id_, dir_;
  pid_t pid_;
  UniqueFd channel_;
  std::unique_ptr<Control> control_;
  std::string template_memory_;
  uint64_t mem_limit_;
  std::atomic<bool> paused_{false};  // as the last pause()/resume() left it
  std::atomic<bool> outlive_{false};
  UniqueFd pidfd_;  // set for a VMM taken back after a restart (not our child)
  std::mutex mu_;
  std::shared_ptr<process::HostChannel> host_;  // GUARDED_BY(mu_)
  std::optional<process::Cgroup> cgroup_;        // GUARDED_BY(mu_)
  HeldUid uid_;                                  // GUARDED_BY(mu_)
  HeldNetwork net_;                              // GUARDED_BY(mu_)
  bool killed_ = false, reaped_ = false;         // GUARDED_BY(mu_)
};

class MicrovmRuntime final : public runtime::Runtime {
 public:
  explicit MicrovmRuntime(MicrovmConfig cfg) : cfg_(std::move(cfg)) {
    if (cfg_.cgroup_parent.empty()) return;
    Result<process::CgroupLayout> l = process::detect_cgroup_layout();
    if (l)
      layout_ = *l;
    else
      LOG_WARN("kvm: VMMs run without cgroups: " << l.error().message());
  }
  std::string name() const override { return "kvm"; }

  Status cleanup_stale() override { return cleanup_stale_except({}); }

  // What a previous run left, but the sandboxes in keep (taken back with
  // recover()): VMMs that outlived it are killed, directories removed
  // (the template snapshots stay: they are still valid), cgroups removed.
  Status cleanup_stale_except(const std::set<std::string>& keep) override {
    if (Status s = sys::make_dirs(cfg_.state_root, 0700); !s) return s;
    DIR* d = ::opendir(cfg_.state_root.c_str());
    if (!d) return sys::errno_error("opendir", cfg_.state_root);
    std::vector<std::string> stale;
    while (struct dirent* e = ::readdir(d)) {
      std::string n = e->d_name;
      if (n == "." || n == ".." || n == "snapshots" || keep.count(n)) continue;
      stale.push_back(n);
    }
    ::closedir(d);
    for (const auto& n : stale) {
      std::string p = cfg_.state_root + "/" + n;
      if (Result<VmmRecord> rec = read_record(p)) end_vmm_of_record(*rec, n);
      if (Status s = sys::remove_tree(p); !s) return s;
    }
    if (layout_) {
      Status s = keep.empty()
                     ? process::remove_cgroup_parent(*layout_, cfg_.cgroup_parent, std::chrono::milliseconds(5000))
                     : process::remove_cgroups_except(*layout_, cfg_.cgroup_parent, keep, std::chrono::milliseconds(5000));
      if (!s) return s;
    }
    return {};
  }

  bool sandboxes_outlive_host() const override { return cfg_.sandboxes_outlive_host; }

  // A VMM a previous run started and left running (--outlive), checked to
  // be that one (pid, start time), attached with new sockets through its
  // attach descriptor (vm/attach.h), and its agent told this is a new host
  // (RELEASE reset), then a barrier (HostChannel::settle): whatever the
  // agent had queued for the old host is dropped, and nothing is asked of
  // it before that is through.
  Result<std::unique_ptr<runtime::Sandbox>> recover(const std::string& id) override {
    if (!cfg_.sandboxes_outlive_host)
      return Error(ErrorKind::kUnavailable, "sandbox " + id + ": sandboxes do not outlive sandgate here");
    if (id.empty() || id.find('/') != std::string::npos || id[0] == '.') return invalid_error("invalid sandbox id");
    std::string dir = cfg_.state_root + "/" + id;
    Result<VmmRecord> rec = read_record(dir);
    if (!rec) return rec.error().with_context("recover sandbox " + id);
    UniqueFd pidfd(static_cast<int>(::syscall(SYS_pidfd_open, rec->pid, 0)));
    if (!pidfd) {
      if (errno == ESRCH) return not_found_error("its VMM is gone");
      return sys::errno_error("pidfd_open", std::to_string(rec->pid));
    }
    Result<uint64_t> start = sys::process_start_ticks(rec->pid);
    struct pollfd pp = {pidfd.get(), POLLIN, 0};
    if (!start || *start != rec->start_ticks || ::poll(&pp, 1, 0) != 0)
      return not_found_error("its VMM is gone (pid " + std::to_string(rec->pid) + " is another process now)");
    UniqueFd attach(static_cast<int>(::syscall(SYS_pidfd_getfd, pidfd.get(), vmm::kAttachFd, 0)));
    if (!attach) return sys::errno_error("pidfd_getfd", "its VMM's attach descriptor");
    int ch[2], ctl[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, ch) != 0) return sys::errno_error("socketpair", "channel");
    UniqueFd ch_host(ch[0]), ch_vm(ch[1]);
    if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, ctl) != 0) return sys::errno_error("socketpair", "control");
    UniqueFd ctl_host(ctl[0]), ctl_vm(ctl[1]);
    if (Status a = send_attach(attach.get(), ch_vm.get(), ctl_vm.get()); !a)
      return a.error().with_context("attach to its VMM");
    ch_vm.reset();
    ctl_vm.reset();
    Spawned sp;
    sp.pid = rec->pid;
    sp.channel = std::move(ch_host);
    sp.control = std::make_unique<Control>(std::move(ctl_host));
    auto sb = std::make_unique<MicrovmSandbox>(id, dir, std::move(sp), rec->mem_bytes);
    sb->set_adopted(std::move(pidfd));
    if (layout_) sb->set_cgroup(process::Cgroup::attach(*layout_, cfg_.cgroup_parent, id));
    if (rec->uid > 0) {
      if (Status u = uids_->adopt(rec->uid); !u) {
        (void)sb->kill();
        return u.error();
      }
      sb->set_uid(HeldUid(uids_, rec->uid));
    }
    sb->set_template_memory(rec->template_memory);
    Status ok = [&]() -> Status {
      auto mi = sb->guest_memory();
      if (!mi) return mi.error();
      if (mi->backing == "userfaultfd")
        return Error(ErrorKind::kUnavailable,
                     "its memory was offloaded into the previous sandgate's pool, which went with it");
      auto st = sb->vmm("stats", std::chrono::milliseconds(10000));
      if (!st) return st.error();
      bool paused = st->find("\"state\":\"paused\"") != std::string::npos;
      sb->set_paused_flag(paused);
      if (paused)
        if (Status r = sb->resume(); !r) return r;
      sb->attach_channel(cfg_.open_service);
      sb->new_host();
      // A guest that is slow to answer (starved of CPU, or its vCPUs
      // stalled) is taken back all the same: it runs and holds what its
      // user wrote. What is asked of it waits behind the barrier, so the
      // wait here is short: it only tells a slow guest in the log (and
      // lets a paused one settle before it is paused again).
      Status settled = sb->settle(std::chrono::milliseconds(5000));
      if (!settled && settled.error().kind() == ErrorKind::kTimeout) {
        LOG_WARN("sandbox " << id << ": its agent has not answered within 5 s of the restart; taken back, and "
                            "what is asked of it waits until it answers");
        settled = Status::Ok();
      }
      if (paused)
        if (Status p = sb->pause(); !p && settled) settled = p;
      return settled;
    }();
    if (!ok) {
      (void)sb->kill();
      return ok.error().with_context("recover sandbox " + id);
    }
    // Its network: the TAP its VMM kept open, with the address it had.
    if (cfg_.networks && !rec->address.empty()) {
      HeldNetwork n(cfg_.networks, id);
      if (Status a = cfg_.networks->adopt_tap(id, rec->address); !a) {
        n.let_go();  // nothing of it is this server's
        LOG_WARN("sandbox " << id << " is taken back without its network: " << a.error().message());
      } else {
        struct in_addr a4 {};
        char gw[INET_ADDRSTRLEN] = {};
        ::inet_pton(AF_INET, rec->address.c_str(), &a4);  // parsed by adopt_tap
        a4.s_addr = htonl(ntohl(a4.s_addr) - 1);          // the /30's .1
        ::inet_ntop(AF_INET, &a4, gw, sizeof gw);
        n.link = {rec->address, gw};
        sb->set_network(std::move(n));
      }
    }
    sb->set_outlive(true);
    LOG_INFO("sandbox " << id << " taken back, VMM pid " << rec->pid);
    return std::unique_ptr<runtime::Sandbox>(std::move(sb));
  }

  bool runs_start_command() const override { return cfg_.use_snapshots; }

  bool snapshots_memory() const override { return true; }

  Status prepare_template(const runtime::SandboxSpec& spec) override {
    auto split = split_layers(spec.layers);
    if (!split) return split.error();
    auto image = ensure_template_image(spec.rootfs, split->first);
    if (!image) return image.error();
    if (!cfg_.use_snapshots || !split->second.empty()) return {};
    auto snap = snapshot_for(spec, *image);
    if (!snap) return snap.error();
    return {};
  }

  // The image and every snapshot made of it (each snapshot names its image
  // in the file "image").
  uint64_t drop_template(const std::string& root) override {
    std::string image = root + ".ext4";
    std::string dir = cfg_.state_root + "/snapshots";
    std::vector<std::string> names;
    if (DIR* d = ::opendir(dir.c_str())) {
      while (struct dirent* e = ::readdir(d)) {
        std::string n = e->d_name;
        if (n[0] == '.' || n.find('.') != std::string::npos) continue;  // ., .., *.partial, *.boot
        Result<std::string> of = sys::read_file(dir + "/" + n + "/image");
        if (of && *of == image) names.push_back(n);
      }
      ::closedir(d);
    }
    uint64_t freed = 0;
    for (const std::string& n : names) {
      std::mutex* mu;
      {
        std::lock_guard lock(map_mu_);
        mu = &snapshot_mu_[n];
      }
      std::lock_guard lock(*mu);
      std::string snap = dir + "/" + n;
      uint64_t bytes = sys::disk_usage(snap);
      if (Status s = sys::remove_tree(snap); !s) {
        LOG_WARN("kvm: remove snapshot " << snap << ": " << s.error().message());
        continue;
      }
      freed += bytes;
      LOG_INFO("kvm: removed snapshot " << snap << " of " << image);
    }
    std::lock_guard lock(image_lock(image));
    struct stat st;
    if (::stat(image.c_str(), &st) == 0 && ::unlink(image.c_str()) == 0) freed += static_cast<uint64_t>(st.st_blocks) * 512;
    return freed;
  }

  Result<std::unique_ptr<runtime::Sandbox>> create(const runtime::SandboxSpec& spec) override {
    uint64_t t0 = sys::monotonic_ns();
    auto split = split_layers(spec.layers);
    if (!split) return split.error();
    auto image = ensure_template_image(spec.rootfs, split->first);
    if (!image) return image.error();
    std::string dir = cfg_.state_root + "/" + spec.id;
    if (::mkdir(dir.c_str(), 0700) != 0) return sys::errno_error("mkdir", dir);
    auto sb = !split->second.empty() ? restore(spec, split->second, dir)
              : cfg_.use_snapshots   ? clone(spec, *image, dir)
                                     : boot(spec, *image, dir);
    if (!sb) {
      (void)sys::remove_tree(dir);
      return sb.error();
    }
    if (cfg_.sandboxes_outlive_host) {
      if (Status w = write_record(**sb, spec); !w) {
        (void)(*sb)->kill();
        return w.error().with_context("record sandbox " + spec.id + " for later runs");
      }
      (*sb)->set_outlive(true);
    }
    LOG_DEBUG("sandbox " << spec.id << " microVM ready in " << (sys::monotonic_ns() - t0) / 1000 << " us");
    return std::unique_ptr<runtime::Sandbox>(std::move(*sb));
  }

 private:
  std::vector<std::string> boot_args(const runtime::SandboxSpec& spec, const std::string& image) const {
    std::string cmdline = kCmdline;
    if (!cfg_.extra_cmdline.empty()) cmdline += " " + cfg_.extra_cmdline;
    return {"--kernel", cfg_.guest_dir + "/vmlinuz", "--initrd", cfg_.guest_dir + "/initramfs.cpio",
            "--initrd-file", "sandgate-agent=" + cfg_.agent_path, "--disk", image, "--mem-mib",
            std::to_string(spec.memory_mb), "--cpus", std::to_string(spec.cpu_count), "--cmdline", cmdline};
  }

  // Spawns a VMM for spec in its own cgroup (named name) where there are
  // cgroups; the cgroup is handed to the sandbox made from it.
  struct Started {
    Spawned vmm;
    std::optional<process::Cgroup> cgroup;
    HeldUid uid;
    HeldNetwork net;  // a sandbox's (not a template VM's), where sandboxes have networks
  };
  // snapshot_dir: where a template VMM is to write its snapshot (created
  // here, for the jailed VMM's uid, when it is jailed); the only VMMs that
  // may open files once they run.
  // A template VMM (snapshot_dir set) never outlives sandgate; a
  // sandbox's does when sandboxes outlive it.
  Result<Started> start_vmm(const std::string& name, const runtime::SandboxSpec& spec, std::vector<std::string> args,
                            const std::string& dir, const std::string& snapshot_dir = "") {
    const bool outlive = cfg_.sandboxes_outlive_host && snapshot_dir.empty() && name == spec.id;
    Started st;
    Result<bool> jailed = jail_available();
    if (!jailed) return jailed.error();
    if (*jailed) {
      Result<uint32_t> uid = uids_->acquire();
      if (!uid) return uid.error();
      st.uid = HeldUid(uids_, *uid);
      std::string root = dir + "/jail";
      if (::mkdir(root.c_str(), 0755) != 0) return sys::errno_error("mkdir", root);
      std::string u = std::to_string(*uid);
      args.insert(args.end(), {"--jail", root, "--jail-uid", u, "--jail-gid", u});
      if (!snapshot_dir.empty()) {
        if (::mkdir(snapshot_dir.c_str(), 0700) != 0) return sys::errno_error("mkdir", snapshot_dir);
        if (::chown(snapshot_dir.c_str(), *uid, *uid) != 0) return sys::errno_error("chown", snapshot_dir);
        args.push_back("--jail-snapshot-dir");
        args.push_back(snapshot_dir);
      }
    } else if (!snapshot_dir.empty()) {
      args.push_back("--snapshot-dir");
      args.push_back(snapshot_dir);
    }
    if (layout_) {
      process::CgroupLimits lim;
      lim.cpu_count = spec.cpu_count + 1;  // the vCPUs and the VMM's I/O threads
      lim.memory_bytes = (spec.memory_mb + 256) << 20;
      lim.max_pids = spec.cpu_count + 32;
      Result<process::Cgroup> cg = process::Cgroup::create(*layout_, cfg_.cgroup_parent, name, lim);
      if (!cg) return cg.error().with_context("the VMM's cgroup");
      st.cgroup = std::move(*cg);
    }
    // A sandbox's own network: the TAP its VMM's virtio-net is the guest
    // end of (a template VM has none: its snapshot's device is unplugged).
    UniqueFd tap;
    if (cfg_.networks && snapshot_dir.empty() && name == spec.id) {
      st.net = HeldNetwork(cfg_.networks, spec.id);
      Result<runtime::SandboxNetworks::Link> link = cfg_.networks->reserve(spec.id);
      Result<UniqueFd> t = link ? cfg_.networks->attach_tap(spec.id) : Result<UniqueFd>(link.error());
      if (!t) {
        if (st.cgroup) (void)st.cgroup->destroy(std::chrono::milliseconds(5000));
        return t.error().with_context("sandbox " + spec.id + "'s network");
      }
      st.net.link = *link;
      tap = std::move(*t);
    }
    auto s = spawn_vmm(cfg_.vmm_path, std::move(args), dir, st.cgroup ? &*st.cgroup : nullptr, outlive, tap.get());
    if (!s) {
      if (st.cgroup) (void)st.cgroup->destroy(std::chrono::milliseconds(5000));
      return s.error();
    }
    st.vmm = std::move(*s);
    return st;
  }

  // Boots a VM to agent-ready (the ready frame consumed).
  Result<std::unique_ptr<MicrovmSandbox>> boot_to_ready(const runtime::SandboxSpec& spec, const std::string& image,
                                                        const std::string& dir, std::chrono::milliseconds timeout,
                                                        const std::string& cgroup_name,
                                                        const std::string& snapshot_dir = "") {
    auto s = start_vmm(cgroup_name, spec, boot_args(spec, image), dir, snapshot_dir);
    if (!s) return s.error();
    pid_t pid = s->vmm.pid;
    int ch = s->vmm.channel.get();
    auto sb = std::make_unique<MicrovmSandbox>(spec.id, dir, std::move(s->vmm), spec.memory_mb << 20);
    if (s->cgroup) sb->set_cgroup(std::move(*s->cgroup));
    sb->set_uid(std::move(s->uid));
    sb->set_network(std::move(s->net));
    uint64_t deadline = sys::monotonic_ns() + static_cast<uint64_t>(timeout.count()) * 1000000ull;
    // A pidfd of the VMM: its exit means no ready will come.
    UniqueFd pidfd(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)));
    if (!pidfd) return sys::errno_error("pidfd_open", "sandgate-vmm");
    if (Status r = process::read_ready_frame(ch, pidfd.get(), deadline); !r)
      return Error(r.error().kind(), "microVM: " + r.error().message() + "; sandgate-vmm: " +
                                         sys::read_tail(dir + "/vmm.log", 600) +
                                         "; serial console: " + sys::read_tail(dir + "/serial.log", 1500));
    return sb;
  }

  Status configure(MicrovmSandbox& sb, const runtime::SandboxSpec& spec) {
    json env = json::object();
    for (const auto& [k, v] : spec.env) env[k] = v;
    struct timespec ts {};
    ::clock_gettime(CLOCK_REALTIME, &ts);
    json req = {{"type", "configure"},
                {"sandboxId", spec.id},
                {"envdAccessToken", spec.envd_access_token},
                {"env", env},
                {"unixTimeNs", static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec},
                {"entropy", sys::random_hex(64)}};
    if (auto link = sb.network_link())
      req["network"] = {{"address", link->address}, {"gateway", link->gateway}, {"prefix", 30}};
    auto r = sb.control(req.dump(), std::max(spec.ready_timeout, std::chrono::milliseconds(30000)));
    if (!r) return r.error().with_context("configure the microVM's agent");
    json reply = json::parse(*r, nullptr, false);
    if (!reply.is_object() || channel::control_type(reply) != "configured")
      return internal_error("agent refused configure: " + r->substr(0, 200));
    return {};
  }

  Result<std::unique_ptr<MicrovmSandbox>> boot(const runtime::SandboxSpec& spec, const std::string& image,
                                               const std::string& dir) {
    auto sb = boot_to_ready(spec, image, dir, std::max(spec.ready_timeout, cfg_.boot_timeout), spec.id);
    if (!sb) return sb.error();
    (*sb)->attach_channel(cfg_.open_service);
    if (Status s = configure(**sb, spec); !s) return s.error();
    return sb;
  }

  // The snapshot directory for this template and shape, built on first use.
  Result<std::string> snapshot_for(const runtime::SandboxSpec& spec, const std::string& image) {
    std::string key;
    for (const std::string& p : {image, cfg_.guest_dir + "/vmlinuz", cfg_.guest_dir + "/initramfs.cpio", cfg_.agent_path, cfg_.vmm_path}) {
      auto st = stat_of(p);
      if (!st) return st.error();
      key += p + ":" + std::to_string(st->st_size) + ":" + std::to_string(mtime_ns(*st)) + ";";
    }
    key += std::to_string(spec.memory_mb) + "m" + std::to_string(spec.cpu_count) + "c" + cfg_.extra_cmdline;
    if (spec.start) {
      json st = {{"script", spec.start->script}, {"ready", spec.start->ready}, {"user", spec.start->user},
                 {"cwd", spec.start->cwd}, {"env", spec.start->env}};
      key += ";start=" + st.dump();
    }
    std::string name = std::to_string(std::hash<std::string>{}(key)) + "-" + std::to_string(spec.memory_mb) + "m" +
                       std::to_string(spec.cpu_count) + "c";
    std::string snap = cfg_.state_root + "/snapshots/" + name;
    std::mutex* mu;
    {
      std::lock_guard lock(map_mu_);
      mu = &snapshot_mu_[name];
    }
    std::lock_guard lock(*mu);
    if (sys::path_exists(snap + "/vm.state")) return snap;
    uint64_t t0 = sys::monotonic_ns();
    LOG_INFO("kvm: booting a template microVM for " << image << " (" << spec.memory_mb << " MiB, " << spec.cpu_count
                                                   << " vCPUs) to snapshot it");
    std::string work = cfg_.state_root + "/snapshots/" + name + ".partial";
    (void)sys::remove_tree(work);
    std::string vmdir = cfg_.state_root + "/snapshots/" + name + ".boot";
    (void)sys::remove_tree(vmdir);
    if (Status s = sys::make_dirs(vmdir, 0700); !s) return s.error();
    runtime::SandboxSpec tspec = spec;
    tspec.id = "template";
    tspec.env.clear();  // a create's own envVars are not the template's
    auto vm = boot_to_ready(tspec, image, vmdir, cfg_.boot_timeout, "template-" + sys::random_hex(6), work);
    if (!vm) return vm.error().with_context("template microVM");
    if (spec.start)
      if (Status s = warm_start(**vm, tspec, *spec.start); !s) {
        (void)(*vm)->kill();
        (void)sys::remove_tree(vmdir);
        return s.error();
      }
    uint64_t t1 = sys::monotonic_ns();
    auto p = (*vm)->vmm("pause", std::chrono::milliseconds(10000));
    if (!p) return p.error();
    auto r = (*vm)->vmm("snapshot " + work, std::chrono::milliseconds(300000));
    if (!r) return r.error().with_context("snapshot the template microVM");
    (void)(*vm)->kill();
    (void)sys::remove_tree(vmdir);
    // A jailed template VMM wrote the files as its uid, which the next VMM
    // may get: they become root's.
    if (Status o = own_by_root(work); !o) return o.error();
    if (Status w = sys::write_file(work + "/image", image); !w) return w.error();  // for drop_template
    if (::rename(work.c_str(), snap.c_str()) != 0) return sys::errno_error("rename", work);
    LOG_INFO("kvm: template snapshot " << snap << " ready: boot " << (t1 - t0) / 1000000 << " ms, snapshot "
                                       << (sys::monotonic_ns() - t1) / 1000000 << " ms");
    return snap;
  }

  // A template's start command, run in its template microVM before the
  // snapshot (E2B's semantics): configured with a token of its own (each
  // clone is configured again, with its own), the command started, the
  // ready command run until it exits 0; then one ping, so that the agent
  // has answered everything before the VM is paused.
  Status warm_start(MicrovmSandbox& vm, const runtime::SandboxSpec& tspec, const runtime::StartCommand& start) {
    uint64_t t0 = sys::monotonic_ns();
    vm.attach_channel(cfg_.open_service);
    runtime::SandboxSpec cs = tspec;
    cs.envd_access_token = sys::random_hex(16);
    if (Status c = configure(vm, cs); !c) return c.error().with_context("template microVM");
    if (Status s = host::start_and_wait_ready(vm, cs.envd_access_token, start); !s)
      return s.error().with_context("the template's start command");
    auto pong = vm.control(R"({"type":"ping","id":1})", std::chrono::milliseconds(30000));
    if (!pong) return pong.error().with_context("the template microVM after its start command");
    LOG_INFO("kvm: the template's start command is ready in its microVM after "
             << (sys::monotonic_ns() - t0) / 1000000 << " ms; snapshotting it running");
    return {};
  }

  // What a later run needs to take a sandbox's VMM back
  // (<state_root>/<id>/vmm.json, written once the sandbox is ready).
  struct VmmRecord {
    int pid = -1;
    uint64_t start_ticks = 0;  // tells the VMM from a later process with its pid
    uint32_t uid = 0;          // its jail uid; 0: unjailed
    uint64_t mem_bytes = 0;
    std::string template_memory;  // the snapshot memory it was restored from
    std::string address;          // its guest's address on its own network; "": none
  };

  Status write_record(MicrovmSandbox& sb, const runtime::SandboxSpec& spec) {
    Result<uint64_t> start = sys::process_start_ticks(sb.init_pid());
    if (!start) return start.error();
    auto mi = sb.guest_memory();
    json j = {{"pid", sb.init_pid()},
              {"start", *start},
              {"uid", sb.uid()},
              {"memBytes", mi ? mi->size : spec.memory_mb << 20},
              {"templateMemory", mi ? mi->template_memory : std::string()}};
    if (auto link = sb.network_link()) j["address"] = link->address;
    return sys::write_file_atomic(cfg_.state_root + "/" + spec.id + "/vmm.json", j.dump());
  }

  static Result<VmmRecord> read_record(const std::string& dir) {
    Result<std::string> text = sys::read_file(dir + "/vmm.json", 4096);
    if (!text) return not_found_error("no record of it in " + dir + " (" + text.error().message() + ")");
    json j = json::parse(*text, nullptr, false);
    if (!j.is_object() || !j.contains("pid") || !j["pid"].is_number_integer() || !j.contains("start") ||
        !j["start"].is_number_unsigned() || !j.contains("uid") || !j["uid"].is_number_unsigned() ||
        !j.contains("memBytes") || !j["memBytes"].is_number_unsigned() || !j.contains("templateMemory") ||
        !j["templateMemory"].is_string() || j["pid"].get<int64_t>() <= 1 || j["pid"].get<int64_t>() > INT_MAX)
      return internal_error("its record " + dir + "/vmm.json is damaged");
    VmmRecord r;
    r.pid = j["pid"].get<int>();
    r.start_ticks = j["start"].get<uint64_t>();
    r.uid = j["uid"].get<uint32_t>();
    r.mem_bytes = j["memBytes"].get<uint64_t>();
    r.template_memory = j["templateMemory"].get<std::string>();
    if (auto a = j.find("address"); a != j.end()) {
      if (!a->is_string() || a->get_ref<const std::string&>().size() > 15)
        return internal_error("its record " + dir + "/vmm.json is damaged");
      r.address = a->get<std::string>();
    }
    return r;
  }

  // Kills the VMM a record names if it is still that process.
  static void end_vmm_of_record(const VmmRecord& rec, const std::string& id) {
    UniqueFd pidfd(static_cast<int>(::syscall(SYS_pidfd_open, rec.pid, 0)));
    if (!pidfd) return;  // gone
    Result<uint64_t> start = sys::process_start_ticks(rec.pid);
    struct pollfd p = {pidfd.get(), POLLIN, 0};
    if (!start || *start != rec.start_ticks || ::poll(&p, 1, 0) != 0) return;  // another process now
    LOG_INFO("kvm: ending the VMM of sandbox " << id << " (pid " << rec.pid << "), left by an earlier run");
    ::syscall(SYS_pidfd_send_signal, pidfd.get(), SIGKILL, nullptr, 0);
    (void)::poll(&p, 1, 10000);
  }

  // The attach hello with the VMM's ends of the new sockets; its answer.
  static Status send_attach(int attach, int ch_vm, int ctl_vm) {
    struct iovec iov = {const_cast<char*>(vmm::kAttachHello), sizeof vmm::kAttachHello};
    struct msghdr mh {};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    alignas(struct cmsghdr) char cbuf[CMSG_SPACE(2 * sizeof(int))] = {};
    mh.msg_control = cbuf;
    mh.msg_controllen = sizeof cbuf;
    struct cmsghdr* c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(2 * sizeof(int));
    int fds[2] = {ch_vm, ctl_vm};
    std::memcpy(CMSG_DATA(c), fds, sizeof fds);
    ssize_t n;
    do n = ::sendmsg(attach, &mh, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    if (n != static_cast<ssize_t>(sizeof vmm::kAttachHello)) return sys::errno_error("sendmsg", "attach");
    struct pollfd p = {attach, POLLIN, 0};
    if (::poll(&p, 1, 10000) != 1) return Error(ErrorKind::kTimeout, "the VMM did not answer the attach in 10 s");
    char buf[512];
    ssize_t r = ::recv(attach, buf, sizeof buf, 0);
    if (r <= 0) return Error(ErrorKind::kUnavailable, "the VMM closed its attach socket");
    std::string reply(buf, static_cast<size_t>(r));
    if (reply != "ok") return internal_error("the VMM refused the attach: " + reply);
    return {};
  }

  // A template's layers: the file layers (the image), and the microVM
  // snapshot on top if there is one (a snapshot of a sandbox, a fork's, a
  // pause's), which the sandbox is restored from instead.
  static Result<std::pair<std::vector<std::string>, std::string>> split_layers(const std::vector<std::string>& layers) {
    std::pair<std::vector<std::string>, std::string> out;
    for (const std::string& l : layers) {
      if (!out.second.empty())
        return invalid_error("template layer " + l + " lies over the microVM snapshot " + out.second);
      if (runtime::is_vm_snapshot_layer(l))
        out.second = l;
      else
        out.first.push_back(l);
    }
    return out;
  }

  Result<std::unique_ptr<MicrovmSandbox>> clone(const runtime::SandboxSpec& spec, const std::string& image,
                                                const std::string& dir) {
    auto snap = snapshot_for(spec, image);
    if (!snap) return snap.error();
    return restore(spec, *snap, dir);
  }

  // A sandbox from a snapshot: a template's (the agent waits for
  // configure) or a sandbox's (its processes run on; the agent drops the
  // old host's streams and is configured again with this sandbox's id,
  // token, environment, clock and entropy).
  Result<std::unique_ptr<MicrovmSandbox>> restore(const runtime::SandboxSpec& spec, const std::string& snap,
                                                  const std::string& dir) {
    // A pause's RAM is kept packed (wait-engine/memory/pause_pack.h); the
    // service makes it whole before a restore.
    if (!sys::path_exists(snap + "/memory") && sys::path_exists(snap + "/memory.sgm"))
      return internal_error("the microVM snapshot " + snap + " keeps its memory packed (memory.sgm), not unpacked");
    auto s = start_vmm(spec.id, spec, {"--restore", snap}, dir);
    if (!s) return s.error();
    auto sb = std::make_unique<MicrovmSandbox>(spec.id, dir, std::move(s->vmm), spec.memory_mb << 20);
    if (s->cgroup) sb->set_cgroup(std::move(*s->cgroup));
    sb->set_uid(std::move(s->uid));
    sb->set_network(std::move(s->net));
    sb->set_template_memory(snap + "/memory");
    sb->attach_channel(cfg_.open_service);
    sb->new_host();
    if (Status c = configure(*sb, spec); !c) {
      std::string why = c.error().message();
      // A VMM that could not restore the snapshot exits at once; its
      // channel may close a moment before it can be reaped.
      for (int i = 0; i < 100 && sb->alive(); ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(20));  // polling a process state
      if (!sb->alive()) why += "; sandgate-vmm: " + sys::read_tail(dir + "/vmm.log", 600);
      LOG_WARN("sandbox " << spec.id << ": restore from " << snap << " failed: " << why << "; serial console: "
                          << sys::read_tail(dir + "/serial.log", 3000));
      return Error(c.error().kind(), why);
    }
    return sb;
  }

  // Whether VMMs are jailed here: decided at the first create by a probe
  // (sandgate-vmm --jail-probe), then fixed.
  Result<bool> jail_available() {
    std::lock_guard lock(jail_mu_);
    if (!jail_probed_) {
      jail_probed_ = true;
      jail_why_ = probe_jail();
      if (!jail_why_.empty() && cfg_.jail == MicrovmConfig::Jail::kAuto)
        LOG_WARN("kvm: VMMs run without a jail (their own root and uid): " << jail_why_);
      if (jail_why_.empty()) LOG_INFO("kvm: VMMs run jailed: an empty root of their own, uids from " << cfg_.first_vmm_uid);
    }
    if (cfg_.jail == MicrovmConfig::Jail::kOff) return false;
    if (!jail_why_.empty() && cfg_.jail == MicrovmConfig::Jail::kOn)
      return Error(ErrorKind::kUnavailable, "the VMM jail is required (--vmm-jail on) but unavailable: " + jail_why_);
    return jail_why_.empty();
  }
  // Empty when the jail works; why not otherwise.
  std::string probe_jail() {
    if (cfg_.jail == MicrovmConfig::Jail::kOff) return "off";
    if (::geteuid() != 0) return "sandgate does not run as root";
    if (::access("/dev/userfaultfd", R_OK | W_OK) != 0)
      return std::string("/dev/userfaultfd: ") + std::strerror(errno) + " (Linux 6.1 or later has it)";
    std::string dir = cfg_.state_root + "/.jail-probe";
    (void)sys::remove_tree(dir);
    if (Status s = sys::make_dirs(dir, 0755); !s) return s.error().message();
    Status r = sys::run_and_wait({cfg_.vmm_path, "--jail-probe", "--jail", dir, "--jail-uid",
                                  std::to_string(cfg_.first_vmm_uid), "--jail-gid", std::to_string(cfg_.first_vmm_uid)},
                                 cfg_.state_root + "/.jail-probe.log");
    (void)sys::remove_tree(dir);
    ::unlink((cfg_.state_root + "/.jail-probe.log").c_str());
    return r ? "" : r.error().message();
  }

  MicrovmConfig cfg_;
  std::shared_ptr<VmmUids> uids_ = std::make_shared<VmmUids>(cfg_.first_vmm_uid, cfg_.vmm_uids);
  std::mutex jail_mu_;
  bool jail_probed_ = false;  // GUARDED_BY(jail_mu_)
  std::string jail_why_;      // GUARDED_BY(jail_mu_): why VMMs are not jailed; empty when they are
  std::optional<process::CgroupLayout> layout_;  // set when VMMs get cgroups
  std::mutex map_mu_;
  std::map<std::string, std::mutex> snapshot_mu_;  // GUARDED_BY(map_mu_) (the map; each mutex guards its snapshot)
};

}  // namespace

bool kvm_usable(std::string* why) {
  UniqueFd fd(::open("/dev/kvm", O_RDWR | O_CLOEXEC));
  if (!fd) {
    *why = "/dev/kvm: " + std::string(std::strerror(errno));
    return false;
  }
  if (::ioctl(fd.get(), KVM_GET_API_VERSION, 0) != KVM_API_VERSION) {
    *why = "/dev/kvm has an unexpected API version";
    return false;
  }
  for (long cap : {KVM_CAP_IRQCHIP, KVM_CAP_IRQFD, KVM_CAP_IMMEDIATE_EXIT, KVM_CAP_PIT2})
    if (::ioctl(fd.get(), KVM_CHECK_EXTENSION, cap) <= 0) {
      *why = "/dev/kvm lacks capability " + std::to_string(cap);
      return false;
    }
  // PVM (kvm_pvm) is software virtualisation that runs only PVM-enabled
  // guest kernels; the guest image is a stock Debian kernel.
  bool hw = sys::path_exists("/sys/module/kvm_intel") || sys::path_exists("/sys/module/kvm_amd");
  if (!hw && sys::path_exists("/sys/module/kvm_pvm")) {
    *why = "/dev/kvm is PVM (kvm_pvm), which boots only PVM-enabled guest kernels, not the stock Debian kernel of the guest image";
    return false;
  }
  return true;
}

Status check_guest_dir(const std::string& guest_dir) {
  for (const char* f : {"vmlinuz", "initramfs.cpio"})
    if (::access((guest_dir + "/" + f).c_str(), R_OK) != 0)
      return Error(ErrorKind::kNotFound, "guest image " + guest_dir + "/" + f +
                                             " not found: build it with scripts/guest-image.sh " + guest_dir);
  return {};
}

namespace {

// mkfs.ext4 -d of a directory tree into image (through image.partial, so a
// crash leaves no half image under the real name).
Status make_image(const std::string& dir, const std::string& image, const std::string& what) {
  auto bytes = tree_bytes(dir);
  if (!bytes) return bytes.error();
  uint64_t mib = (*bytes + *bytes / 4) / (1 << 20) + 128;
  std::string tmp = image + ".partial";
  ::unlink(tmp.c_str());
  LOG_INFO("kvm: building the root filesystem image " << image << " (" << mib << " MiB) from " << what);
  if (Status s = sys::run_and_wait({"mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-L", "sandgate-root", "-d", dir,
                                    tmp, std::to_string(mib) + "M"},
                                   image + ".log");
      !s) {
    ::unlink(tmp.c_str());
    return s.error().with_context("build " + image);
  }
  ::unlink((image + ".log").c_str());
  if (::rename(tmp.c_str(), image.c_str()) != 0) return sys::errno_error("rename", tmp);
  return {};
}

// The merged tree of a built template: a read-only overlay of its layers
// over the base, mounted at <work>/mnt. The lower directories are named
// by short links in work, relative to it (64 layers' absolute paths
// would pass the page that mount options fit in); mount(8) runs there.
class MergedTree {
 public:
  static Result<std::unique_ptr<MergedTree>> mount(const std::string& work, const std::string& base,
                                                   const std::vector<std::string>& layers) {
    (void)sys::remove_tree(work);
    if (Status s = sys::make_dirs(work + "/mnt", 0700); !s) return s.error();
    auto t = std::unique_ptr<MergedTree>(new MergedTree(work));
    // The links are resolved from work: their targets must be absolute.
    auto absolute = [](const std::string& p) -> Result<std::string> {
      char buf[PATH_MAX];
      if (!::realpath(p.c_str(), buf)) return sys::errno_error("realpath", p);
      return std::string(buf);
    };
    std::string lower;
    for (size_t i = layers.size(); i > 0; --i) {
      std::string link = "l" + std::to_string(i);
      Result<std::string> target = absolute(layers[i - 1]);
      if (!target) return target.error();
      if (::symlink(target->c_str(), (work + "/" + link).c_str()) != 0)
        return sys::errno_error("symlink", work + "/" + link);
      lower += link + ":";
    }
    Result<std::string> base_abs = absolute(base);
    if (!base_abs) return base_abs.error();
    if (::symlink(base_abs->c_str(), (work + "/b").c_str()) != 0) return sys::errno_error("symlink", work + "/b");
    lower += "b";
    if (Status s = sys::run_and_wait({"sh", "-c", "cd \"$1\" && exec mount -t overlay -o \"ro,lowerdir=$2\" sandgate-template mnt",
                                      "sh", work, lower},
                                     work + ".log");
        !s)
      return s.error().with_context("mount the template's layers");
    ::unlink((work + ".log").c_str());
    t->mounted_ = true;
    return t;
  }
  ~MergedTree() {
    if (mounted_ && ::umount2((work_ + "/mnt").c_str(), 0) != 0) {
      LOG_WARN("kvm: umount " << work_ << "/mnt: " << std::strerror(errno) << "; detaching it");
      ::umount2((work_ + "/mnt").c_str(), MNT_DETACH);
    }
    (void)sys::remove_tree(work_);
  }
  std::string root() const { return work_ + "/mnt"; }

 private:
  explicit MergedTree(std::string work) : work_(std::move(work)) {}
  std::string work_;
  bool mounted_ = false;
};

}  // namespace

Result<std::string> ensure_rootfs_image(const std::string& rootfs_dir) {
  std::string image = rootfs_dir + ".ext4";
  std::lock_guard lock(image_lock(image));
  auto marker = stat_of(rootfs_dir + "/.sandgate-template");
  auto img = stat_of(image);
  if (img && (!marker || mtime_ns(*img) >= mtime_ns(*marker))) return image;
  if (!marker) return marker.error().with_context("template " + rootfs_dir + " is not complete");
  if (Status s = make_image(rootfs_dir, image, rootfs_dir); !s) return s.error();
  return image;
}

Result<std::string> ensure_template_image(const std::string& rootfs, const std::vector<std::string>& layers) {
  if (layers.size() > runtime::kMaxTemplateLayers)
    return invalid_error("a template has at most " + std::to_string(runtime::kMaxTemplateLayers) + " layers, this one " +
                         std::to_string(layers.size()));
  // A template directory (base, a `sandgate template build`) has a marker;
  // an image's unpacked root (fromImage, no steps) is complete once a
  // template names it, and never changes.
  if (layers.empty() && sys::path_exists(rootfs + "/.sandgate-template")) return ensure_rootfs_image(rootfs);
  const std::string& top = layers.empty() ? rootfs : layers.back();
  std::string image = top + ".ext4";
  std::lock_guard lock(image_lock(image));
  auto img = stat_of(image);
  auto base_marker = stat_of(rootfs + "/.sandgate-template");
  // Layers never change once exported; the base can be rebuilt in place.
  if (img && (!base_marker || mtime_ns(*img) >= mtime_ns(*base_marker))) return image;
  for (const std::string& d : layers)
    if (auto st = stat_of(d); !st) return st.error().with_context("template layer");
  if (layers.empty()) {
    if (Status s = make_image(rootfs, image, rootfs); !s) return s.error();
    return image;
  }
  auto merged = MergedTree::mount(top + ".merge", rootfs, layers);
  if (!merged) return merged.error();
  if (Status s = make_image((*merged)->root(), image,
                            std::to_string(layers.size()) + " layers over " + rootfs);
      !s)
    return s.error();
  return image;
}

std::unique_ptr<runtime::Runtime> make_microvm_runtime(const MicrovmConfig& cfg) {
  return std::make_unique<MicrovmRuntime>(cfg);
}

}  // namespace sg::microvm
