// Process backend: create, supervise and destroy namespaced process
// sandboxes (process_runtime.h, docs/process-backend.md).
//
// create() prepares everything the child needs (paths, argv, envp, fds) up
// front, clones it on the Runtime's spawner thread, moves it into its cgroups,
// releases it through a sync pipe, collects any (step, errno) failure from the
// error pipe, then waits for the agent's "ready" frame. Any failure runs the
// same teardown as Sandbox::kill(), so a failed create leaves nothing behind.
#include "sandbox-runtime/process/process_runtime.h"
#include "sandbox-runtime/process/swap.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <thread>

#include "sandbox-runtime/channel/control_message.h"
#include "sandbox-runtime/channel/frame.h"
#include "sandbox-runtime/process/agent_tree.h"
#include "sandbox-runtime/host/cgroup.h"
#include "sandbox-runtime/process/child.h"
#include "sandbox-runtime/process/disk.h"
#include "sandbox-runtime/process/disk_space.h"
#include "sandbox-runtime/process/layer_copy.h"
#include "sandbox-runtime/host/host_channel.h"
#include "sandbox-runtime/process/userns.h"
#include "base/log.h"
#include "base/os.h"
#include "base/sys.h"

namespace sg::process {

namespace {

using std::chrono::milliseconds;
constexpr milliseconds kTeardownTimeout{5000};
constexpr milliseconds kFreezeTimeout{5000};
constexpr size_t kChildStackSize = 256 * 1024;
constexpr uint64_t kSandboxNofileSoft = 1024;
constexpr uint64_t kSandboxNofileHard = 65536;

// Runs jobs on one thread that lives as long as the Runtime. Sandboxes are
// cloned here because PR_SET_PDEATHSIG is tied to the creating thread: a
// short-lived caller thread exiting would kill its sandboxes.
class Spawner {
 public:
  Spawner() : thread_([this] { loop(); }) {}
  ~Spawner() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void run(const std::function<void()>& f) {
    Job job{&f, false};
    std::unique_lock<std::mutex> l(mu_);
    queue_.push_back(&job);
    cv_.notify_all();
    cv_.wait(l, [&] { return job.done; });
  }

 private:
  struct Job {
    const std::function<void()>* fn;
    bool done;
  };
  void loop() {
    std::unique_lock<std::mutex> l(mu_);
    for (;;) {
      cv_.wait(l, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      Job* j = queue_.front();
      queue_.pop_front();
      l.unlock();
      (*j->fn)();
      l.lock();
      j->done = true;
      cv_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job*> queue_;  // GUARDED_BY(mu_)
  bool stop_ = false;       // GUARDED_BY(mu_)
  std::thread thread_;
};

class ProcessSandbox final : public runtime::Sandbox {
 public:
  ProcessSandbox(std::string id, std::string state_dir, sys::Os& os)
      : os_(os), id_(std::move(id)), state_dir_(std::move(state_dir)) {}
  ~ProcessSandbox() override { stop_channel(); }

  const std::string& id() const override { return id_; }
  int init_pid() const override { return pid_; }
  int channel_fd() const override { return channel_.get(); }

  Status pause() override {
    std::lock_guard<std::mutex> l(mu_);
    if (killed_ || !has_cgroup_) return conflict_error("pause sandbox " + id_ + ": it has been killed");
    if (Status s = cgroup_.freeze(kFreezeTimeout); !s) return s.error().with_context("pause sandbox " + id_);
    return Status::Ok();
  }

  Status resume() override {
    std::lock_guard<std::mutex> l(mu_);
    if (killed_ || !has_cgroup_) return conflict_error("resume sandbox " + id_ + ": it has been killed");
    if (Status s = cgroup_.thaw(); !s) return s.error().with_context("resume sandbox " + id_);
    return Status::Ok();
  }

  Status kill() override {
    std::lock_guard<std::mutex> l(mu_);
    return kill_locked();
  }

  // Offload to swap (swap.h). A paused sandbox stays frozen throughout;
  // an idle one runs on and faults back what it touches. mu_ is held, so a
  // kill waits for the page-out's current piece.
  Result<runtime::SwapOutAccount> swap_out(const std::atomic<bool>& cancel, SwapOutOf of) override {
    std::lock_guard<std::mutex> l(mu_);
    if (!swap_offload_) return runtime::Sandbox::swap_out(cancel, of);
    if (killed_ || !has_cgroup_) return conflict_error("swap out sandbox " + id_ + ": it has been killed");
    Result<bool> frozen = cgroup_.frozen();
    if (!frozen) return frozen.error().with_context("swap out sandbox " + id_);
    if (of == SwapOutOf::kPaused && !*frozen) return conflict_error("swap out sandbox " + id_ + ": it is not paused");
    Result<std::vector<int>> pids = cgroup_.pids();
    if (!pids) return pids.error().with_context("swap out sandbox " + id_);
    // The observer's begin and end bracket the page-out, whatever happens.
    // It sees a frozen sandbox's pages only: a running one's may change
    // between its reading and the page-out.
    runtime::SwapObserver* observer = of == SwapOutOf::kPaused ? swap_observer_ : nullptr;
    struct Observing {
      runtime::SwapObserver* o;
      ~Observing() {
        if (o) o->end();
      }
    } observing{observer};
    if (observer) observer->begin(id_, cohort_);
    Result<PageOutResult> r = page_out(*pids, cancel, observer, &read_back_);
    if (!r) return r.error().with_context("swap out sandbox " + id_);
    // What was resident at a page-out is what the sandbox touched since the
    // previous one, except at the first: then it is everything it ever
    // touched. Reading back what was touched in one run period reads far
    // more than the next touches (a page read back and not used sits in
    // RAM, charged to the sandbox, until the next page-out puts it back);
    // what was touched in the last two is read back.
    read_back_.clear();
    hot_ = overlap(last_resident_, r->hot);
    if (swapped_out_before_)
      last_resident_ = std::move(r->hot);
    swapped_out_before_ = true;
    runtime::SwapOutAccount a;
    a.resident_pages = r->resident_pages;
    a.out_pages = r->out_pages;
    a.hot_pages = page_count(hot_);
    a.unused_pages = r->unused_pages;
    return a;
  }

  Result<uint64_t> swap_in() override {
    std::lock_guard<std::mutex> l(mu_);
    if (!swap_offload_) return runtime::Sandbox::swap_in();
    if (killed_ || !has_cgroup_) return conflict_error("swap in sandbox " + id_ + ": it has been killed");
    Result<uint64_t> n = page_in(hot_);
    if (!n) return n.error().with_context("swap in sandbox " + id_);
    read_back_ = hot_;  // what of it the sandbox leaves untouched, the next swap_out puts back
    return n;
  }

  Status export_layer(const std::string& dest) override {
    std::lock_guard<std::mutex> l(mu_);
    if (killed_ || !has_cgroup_) return conflict_error("export the layer of sandbox " + id_ + ": it has been killed");
    bool was_frozen = false;
    if (auto f = cgroup_.frozen(); f) was_frozen = *f;
    if (Status s = cgroup_.freeze(kFreezeTimeout); !s) return s.error().with_context("export the layer of " + id_);
    IdShift shift;
    if (uid_slots_) shift = IdShift{uid_base_, kUidsPerSandbox};
    Result<LayerStats> copied = disk_image_.empty() ? copy_layer(state_dir_ + "/upper", dest, shift)
                                                    : copy_disk_layer(dest, shift);
    if (!was_frozen) {
      if (Status s = cgroup_.thaw(); !s) LOG_ERROR("thaw sandbox " << id_ << " after export: " << s.error().message());
    }
    if (!copied) return copied.error().with_context("export the layer of sandbox " + id_);
    return Status::Ok();
  }

  // A size-limited layer is mounted in the sandbox's mount namespace only.
  // Mounting its loop device here as well (while the sandbox is frozen)
  // reaches the same filesystem, as ext4 shares one superblock per device;
  // the mount goes, detached, once the copy is made.
  Result<LayerStats> copy_disk_layer(const std::string& dest, IdShift shift) {
    std::string mnt = state_dir_ + "/export";
    std::string node = state_dir_ + "/disk.dev";
    if (::mkdir(mnt.c_str(), 0700) != 0 && errno != EEXIST) return sys::errno_error("mkdir", mnt);
    if (::mount(node.c_str(), mnt.c_str(), "ext4", MS_NODEV | MS_NOSUID | MS_NOEXEC, nullptr) != 0)
      return sys::errno_error("mount the writable layer", node);
    Result<LayerStats> copied = copy_layer(mnt + "/upper", dest, shift);
    if (::umount2(mnt.c_str(), MNT_DETACH) != 0) LOG_ERROR("umount " << mnt << ": " << std::strerror(errno));
    ::rmdir(mnt.c_str());
    return copied;
  }

  bool alive() override {
    std::lock_guard<std::mutex> l(mu_);
    if (reaped_ || pid_ <= 0 || !pidfd_) return false;
    struct pollfd p = {pidfd_.get(), POLLIN, 0};
    return ::poll(&p, 1, 0) == 0;
  }

  Result<UniqueFd> open_port(uint16_t port) override {
    std::shared_ptr<HostChannel> ch = host_channel();
    if (!ch) return Error(ErrorKind::kUnavailable, "open port " + std::to_string(port) + " in sandbox " + id_ + ": it has been killed");
    return ch->open_port(port);
  }

  Result<std::string> control(std::string request, std::chrono::milliseconds timeout) override {
    std::shared_ptr<HostChannel> ch = host_channel();
    if (!ch) return Error(ErrorKind::kUnavailable, "control message to sandbox " + id_ + ": it has been killed");
    return ch->control(std::move(request), timeout);
  }

  Result<runtime::Usage> usage() override {
    std::lock_guard<std::mutex> l(mu_);
    if (killed_ || !has_cgroup_) return conflict_error("usage of sandbox " + id_ + ": it has been killed");
    auto st = cgroup_.stats();
    if (!st) return st.error().with_context("usage of sandbox " + id_);
    runtime::Usage u;
    u.cpu_usage_ns = st->cpu_usage_ns;
    u.mem_used_bytes = st->mem_used_bytes;
    u.mem_cache_bytes = st->mem_cache_bytes;
    u.mem_limit_bytes = st->mem_limit_bytes;
    if (!disk_image_.empty()) {
      u.disk_used_bytes = writable_disk_used_bytes(disk_image_);
      return u;
    }
    std::string upper = state_dir_ + "/upper";
    UniqueFd d(::open(upper.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (d) u.disk_used_bytes = sys::disk_usage(d.get());
    return u;
  }

  // Teardown; shared by kill() and failed creates.
  Status kill_locked() {
    if (killed_) return Status::Ok();
    // Streams end first (their fds close, their users see EOF), then the
    // agent goes; the Mux thread never takes mu_, so joining it here is safe.
    stop_channel();
    if (pid_ > 0 && !reaped_) {
      // Killing a PID namespace's init kills the whole namespace. Unless
      // it is signalled (or already gone), waiting for it would never end.
      if (os_.pidfd_send_signal(pidfd_.get(), SIGKILL) != 0 && errno != ESRCH)
        return sys::errno_error("pidfd_send_signal SIGKILL", "sandbox " + id_ + " init " + std::to_string(pid_));
      // v1 frozen tasks act on SIGKILL only once thawed.
      if (has_cgroup_) (void)cgroup_.thaw();
      if (adopted_) {
        // Another process reaps a sandbox taken back after a restart (its
        // parent was the previous sandgate): its pidfd says when it ended.
        struct pollfd p = {pidfd_.get(), POLLIN, 0};
        int r;
        do r = ::poll(&p, 1, static_cast<int>(kTeardownTimeout.count()));
        while (r < 0 && errno == EINTR);
        if (r == 0) return Error(ErrorKind::kTimeout, "kill sandbox " + id_ + ": init did not exit");
      } else {
        int status = 0;
        for (;;) {
          pid_t r = ::waitpid(pid_, &status, 0);
          if (r == pid_ || (r < 0 && errno == ECHILD)) break;
          if (r < 0 && errno != EINTR) return sys::errno_error("waitpid", std::to_string(pid_));
        }
      }
      reaped_ = true;
    }
    channel_.reset();
    pidfd_.reset();
    // Its init is gone: the host end of its link, its rules and its
    // addresses go (whatever else follows fails or not).
    if (networks_) {
      networks_->release(id_);
      networks_ = nullptr;
    }
    if (has_cgroup_) {
      if (Status s = cgroup_.destroy(kTeardownTimeout); !s) return s.error().with_context("kill sandbox " + id_);
      has_cgroup_ = false;
    }
    // Every process of the sandbox is gone (the cgroup is empty): its uid
    // range can go to the next sandbox.
    if (uid_slots_) {
      uid_slots_->release(uid_slot_);
      uid_slots_.reset();
    }
    if (Status s = sys::remove_tree(state_dir_, os_); !s) return s.error().with_context("kill sandbox " + id_);
    // Its disk image is gone: what it could have grown into is free again.
    disk_reservation_.reset();
    killed_ = true;
    return Status::Ok();
  }

  std::shared_ptr<HostChannel> host_channel() {
    std::lock_guard<std::mutex> l(chan_mu_);
    return host_channel_;
  }

  void stop_channel() {
    std::shared_ptr<HostChannel> ch;
    {
      std::lock_guard<std::mutex> l(chan_mu_);
      ch = std::move(host_channel_);
    }
    if (ch) ch->stop();
  }

  // Filled by create() before the sandbox is shared.
  sys::Os& os_;
  std::mutex chan_mu_;
  std::shared_ptr<HostChannel> host_channel_;  // GUARDED_BY(chan_mu_); null before ready and after kill
  std::mutex mu_;
  std::string id_;
  std::string state_dir_;
  std::string disk_image_;   // the size-limited writable layer's image; "" when unlimited
  DiskSpace::Reservation disk_reservation_;  // its share of the state root's filesystem
  // Its own network (reserved, maybe attached); released by kill_locked.
  runtime::SandboxNetworks* networks_ = nullptr;
  std::shared_ptr<UidSlots> uid_slots_;  // set when the sandbox holds uid_slot_
  uint32_t uid_slot_ = 0;
  uint32_t uid_base_ = 0;  // the slot's first host id
  Cgroup cgroup_;            // GUARDED_BY(mu_)
  bool has_cgroup_ = false;  // GUARDED_BY(mu_)
  int pid_ = -1;
  UniqueFd pidfd_;          // GUARDED_BY(mu_)
  UniqueFd channel_;        // host end
  bool reaped_ = false;     // GUARDED_BY(mu_)
  bool killed_ = false;     // GUARDED_BY(mu_)
  bool adopted_ = false;    // taken back after a restart: not our child
  bool swap_offload_ = false;
  runtime::SwapObserver* swap_observer_ = nullptr;
  std::string cohort_;  // the template's root and layers (the observer's cohort); "" after a recover
  bool swapped_out_before_ = false;  // GUARDED_BY(mu_)
  std::vector<ProcessPages> hot_;  // GUARDED_BY(mu_): what swap_in reads back
  std::vector<ProcessPages> last_resident_;  // GUARDED_BY(mu_): resident at the last swap_out (none: the first)
  std::vector<ProcessPages> read_back_;  // GUARDED_BY(mu_): what the last swap_in read back
};

Result<UniqueFd> high_fd(sys::Os& os, UniqueFd fd, const char* what) {
  int n = os.dup_high(fd.get(), 10);
  if (n < 0) return sys::errno_error("fcntl F_DUPFD_CLOEXEC", what);
  return UniqueFd(n);
}

class ProcessRuntime final : public runtime::Runtime {
 public:
  explicit ProcessRuntime(runtime::RuntimeConfig cfg)
      : cfg_(std::move(cfg)), os_(cfg_.os ? *cfg_.os : sys::Os::real()), layout_(detect_cgroup_layout()),
        disk_(cfg_.disk_limits == runtime::DiskLimits::kOff ? Status::Ok() : writable_disk_available()),
        userns_(cfg_.user_namespaces == runtime::UserNamespaces::kOff ? Status::Ok() : user_namespaces_available()),
        uid_slots_(std::make_shared<UidSlots>(cfg_.first_sandbox_uid, cfg_.sandbox_uid_slots)),
        disk_space_(DiskSpace::make(cfg_.state_root)) {
    if (cfg_.user_namespaces == runtime::UserNamespaces::kAuto && !userns_)
      LOG_WARN("sandbox root is host root (no user namespace): " << userns_.error().message()
                                                                << " (--user-namespaces=on requires one)");
    if (cfg_.disk_limits == runtime::DiskLimits::kAuto && !disk_)
      LOG_WARN("sandbox disks are not size-limited: " << disk_.error().message()
                                                      << " (--disk-limit=on requires it, =off silences this)");
  }

  std::string name() const override { return "process"; }

  Status cleanup_stale() override { return cleanup_stale_except({}); }

  Status cleanup_stale_except(const std::set<std::string>& keep) override {
    if (!layout_) return layout_.error();
    Status result;
    if (Status s = remove_cgroups_except(*layout_, cfg_.cgroup_parent, keep, kTeardownTimeout, os_); !s) result = s;
    DIR* d = ::opendir(cfg_.state_root.c_str());
    if (d) {
      std::vector<std::string> names;
      while (struct dirent* e = ::readdir(d)) {
        std::string n = e->d_name;
        if (n != "." && n != ".." && !keep.count(n)) names.push_back(n);
      }
      ::closedir(d);
      for (const std::string& n : names) {
        if (Status s = sys::remove_tree(cfg_.state_root + "/" + n, os_); !s && result) result = s;
      }
    }
    return result;
  }

  bool sandboxes_outlive_host() const override { return cfg_.sandboxes_outlive_host; }
  bool exports_layers() const override { return true; }

  Result<std::unique_ptr<runtime::Sandbox>> recover(const std::string& id) override {
    if (!layout_) return layout_.error();
    if (!cfg_.sandboxes_outlive_host)
      return Error(ErrorKind::kUnavailable, "sandbox " + id + ": sandboxes do not outlive sandgate here");
    if (!valid_sandbox_id(id)) return invalid_error("invalid sandbox id (want [a-z0-9]{1,64})");
    std::string dir = cfg_.state_root + "/" + id;
    Result<SandboxRecord> rec = read_record(dir);
    if (!rec) return rec.error().with_context("recover sandbox " + id);
    auto sb = std::make_unique<ProcessSandbox>(id, dir, os_);
    std::lock_guard<std::mutex> l(sb->mu_);
    sb->swap_offload_ = cfg_.swap_offload;
    sb->swap_observer_ = cfg_.swap_observer;
    sb->adopted_ = true;
    sb->cgroup_ = Cgroup::attach(*layout_, cfg_.cgroup_parent, id, os_);
    sb->has_cgroup_ = true;
    if (Status s = reattach(*sb, *rec); !s) {
      // What is left of it goes now (its processes too, if some remain).
      if (Status k = sb->kill_locked(); !k) LOG_ERROR("remove sandbox " << id << ": " << k.error().message());
      return s.error().with_context("recover sandbox " + id);
    }
    LOG_INFO("sandbox " << id << " taken back, init pid " << sb->pid_);
    return std::unique_ptr<runtime::Sandbox>(std::move(sb));
  }

  Result<std::unique_ptr<runtime::Sandbox>> create(const runtime::SandboxSpec& spec) override {
    uint64_t t0 = sys::monotonic_ns();
    for (const std::string& l : spec.layers)
      if (runtime::is_vm_snapshot_layer(l))
        return invalid_error("the template is a microVM snapshot (memory and processes, " + l +
                             "): it runs on the kvm backend only");
    auto sb = std::make_unique<ProcessSandbox>(spec.id, cfg_.state_root + "/" + spec.id, os_);
    std::lock_guard<std::mutex> l(sb->mu_);
    sb->swap_offload_ = cfg_.swap_offload;
    sb->swap_observer_ = cfg_.swap_observer;
    sb->cohort_ = spec.rootfs;
    for (const std::string& layer : spec.layers) sb->cohort_ += "\n" + layer;
    bool created_dir = false;
    Status s = start(spec, *sb, t0, created_dir);
    if (!s) {
      if (created_dir) {
        if (Status k = sb->kill_locked(); !k) LOG_ERROR("cleanup after failed create: " << k.error().message());
      }
      return s.error().with_context("create sandbox " + spec.id);
    }
    LOG_DEBUG("sandbox " << spec.id << " ready in " << (sys::monotonic_ns() - t0) / 1000 << " us, init pid "
                         << sb->pid_);
    return std::unique_ptr<runtime::Sandbox>(std::move(sb));
  }

 private:
  // What a later run of sandgate needs to take a sandbox back
  // (state_dir/sandbox.json, written once the agent is ready).
  struct SandboxRecord {
    int pid = -1;
    uint64_t start_ticks = 0;  // /proc/PID/stat field 22: tells the agent from a later process with its pid
    int64_t uid_slot = -1;
    uint64_t disk_mb = 0;
  };
  static constexpr const char* kRecordFile = "sandbox.json";

  Status write_record(const ProcessSandbox& sb, uint64_t disk_mb) {
    Result<uint64_t> start = sys::process_start_ticks(sb.pid_);
    if (!start) return start.error();
    nlohmann::json j = {{"pid", sb.pid_},
                        {"start", *start},
                        {"uidSlot", sb.uid_slots_ ? static_cast<int64_t>(sb.uid_slot_) : -1},
                        {"diskMb", sb.disk_image_.empty() ? 0 : disk_mb}};
    return sys::write_file_atomic(sb.state_dir_ + "/" + kRecordFile, j.dump(), os_);
  }

  static Result<SandboxRecord> read_record(const std::string& dir) {
    Result<std::string> text = sys::read_file(dir + "/" + kRecordFile, 4096);
    if (!text) return not_found_error("no record of it in " + dir + " (" + text.error().message() + ")");
    nlohmann::json j = nlohmann::json::parse(*text, nullptr, false);
    SandboxRecord r;
    if (!j.is_object() || !j.contains("pid") || !j["pid"].is_number_integer() || !j.contains("start") ||
        !j["start"].is_number_unsigned() || !j.contains("uidSlot") || !j["uidSlot"].is_number_integer() ||
        !j.contains("diskMb") || !j["diskMb"].is_number_unsigned())
      return internal_error("its record " + dir + "/" + kRecordFile + " is damaged");
    r.pid = j["pid"].get<int>();
    r.start_ticks = j["start"].get<uint64_t>();
    r.uid_slot = j["uidSlot"].get<int64_t>();
    r.disk_mb = j["diskMb"].get<uint64_t>();
    if (r.pid <= 1) return internal_error("its record " + dir + "/" + kRecordFile + " is damaged");
    return r;
  }

  // The agent a previous run started, checked to be that one (pid, start
  // time, cgroup), its uid range and disk counted again, and a channel
  // to it through its re-attach descriptor (channel::kReattachFd): a
  // frozen sandbox is thawed for the hello and frozen again.
  Status reattach(ProcessSandbox& sb, const SandboxRecord& rec) {
    int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, rec.pid, 0));
    if (pidfd < 0) {
      if (errno == ESRCH) return not_found_error("its processes are gone");
      return sys::errno_error("pidfd_open", std::to_string(rec.pid));
    }
    sb.pidfd_.reset(pidfd);
    Result<uint64_t> start = sys::process_start_ticks(rec.pid);
    struct pollfd p = {pidfd, POLLIN, 0};
    // Read while the pidfd shows the process alive: the pid is still its.
    if (!start || *start != rec.start_ticks || ::poll(&p, 1, 0) != 0)
      return not_found_error("its processes are gone (pid " + std::to_string(rec.pid) + " is another process now)");
    sb.pid_ = rec.pid;
    Result<std::vector<int>> pids = sb.cgroup_.pids();
    if (!pids || std::find(pids->begin(), pids->end(), rec.pid) == pids->end())
      return not_found_error("its init (pid " + std::to_string(rec.pid) + ") is not in its cgroup");
    if (rec.uid_slot >= 0) {
      std::string ns_path = "/proc/" + std::to_string(rec.pid) + "/ns/user";
      UniqueFd ns(::open(ns_path.c_str(), O_RDONLY | O_CLOEXEC));
      if (!ns) return sys::errno_error("open", ns_path);
      Result<UidSlots::Slot> slot = uid_slots_->adopt(static_cast<uint32_t>(rec.uid_slot), std::move(ns));
      if (!slot) return slot.error();
      sb.uid_slots_ = uid_slots_;
      sb.uid_slot_ = slot->index;
      sb.uid_base_ = slot->uid_base;
    }
    if (rec.disk_mb > 0) {
      sb.disk_image_ = writable_disk_image(sb.state_dir_);
      sb.disk_reservation_ = disk_space_->adopt(rec.disk_mb << 20, sb.disk_image_);
    }
    Result<bool> frozen = sb.cgroup_.frozen();
    if (!frozen) return frozen.error();
    if (*frozen)
      if (Status s = sb.cgroup_.thaw(); !s) return s;
    Status attached = attach_channel(sb);
    if (*frozen)
      if (Status s = sb.cgroup_.freeze(kFreezeTimeout); !s && attached) attached = s;
    if (attached && cfg_.networks) adopt_network(sb);
    return attached;
  }

  // Its own network, which outlived the previous server, counted again.
  // One that cannot be (made without a network, or its link gone) leaves
  // the sandbox as it is, with what its namespace still has.
  void adopt_network(ProcessSandbox& sb) {
    std::string ns_path = "/proc/" + std::to_string(sb.pid_) + "/ns/net";
    UniqueFd ns(::open(ns_path.c_str(), O_RDONLY | O_CLOEXEC));
    Status s = ns ? cfg_.networks->adopt(sb.id_, ns.get()) : Status(sys::errno_error("open", ns_path));
    if (s) {
      sb.networks_ = cfg_.networks;
      return;
    }
    cfg_.networks->release(sb.id_);  // whatever part of it was counted
    if (s.error().kind() == ErrorKind::kNotFound)
      LOG_INFO("sandbox " << sb.id_ << " has no network of this server's to take back: " << s.error().message());
    else
      LOG_WARN("sandbox " << sb.id_ << ": taking back its network: " << s.error().message());
  }

  Status attach_channel(ProcessSandbox& sb) {
    constexpr milliseconds kAttachTimeout{10000};
    int fd = static_cast<int>(::syscall(SYS_pidfd_getfd, sb.pidfd_.get(), channel::kReattachFd, 0));
    if (fd < 0) return sys::errno_error("pidfd_getfd", "its re-attach channel (the agent is older than re-attach?)");
    UniqueFd chan(fd);
    struct stat st;
    if (::fstat(chan.get(), &st) != 0 || !S_ISSOCK(st.st_mode))
      return internal_error("its re-attach descriptor is not a socket");
    if (::send(chan.get(), channel::kReattachHello, sizeof channel::kReattachHello, MSG_NOSIGNAL) !=
        static_cast<ssize_t>(sizeof channel::kReattachHello))
      return sys::errno_error("send", "re-attach hello");
    uint64_t deadline = sys::monotonic_ns() + static_cast<uint64_t>(kAttachTimeout.count()) * 1000000ull;
    if (Status s = read_ready_frame(chan.get(), sb.pidfd_.get(), deadline); !s) return s;
    sb.channel_ = std::move(chan);
    std::lock_guard<std::mutex> cl(sb.chan_mu_);
    sb.host_channel_ = std::make_shared<HostChannel>(sb.id_, sb.channel_.get(), cfg_.open_service);
    return Status::Ok();
  }

  // A sandbox's user namespace, as the child needs it: both descriptors
  // >= 10 (ChildArgs sources never collide with the fixed fds 0..5).
  struct SandboxUserns {
    UidSlots::Slot slot;
    UniqueFd tree;  // the idmapped template
    UniqueFd ns;    // a copy of the slot's namespace, for fd 5
  };

  // One create in progress: what start()'s steps make, in their order.
  // ChildArgs points into these strings and descriptors, so a Launch is
  // neither copied nor moved, and lives until the child has exec'd.
  struct Launch {
    Launch() = default;
    Launch(const Launch&) = delete;
    Launch& operator=(const Launch&) = delete;
    // check()
    std::string rootfs;  // the template, resolved
    // start(): the sandbox's DNS server where it has a network of its own
    std::string nameserver;
    // make_state_dir()
    std::string real_state, dir;
    bool limit_disk = false;
    // make_layers()
    std::optional<SandboxUserns> userns;
    std::optional<UidSlots::Slot> slot;
    int layer_owner = -1;
    std::string lower_dir, merged, disk_dir, upper, work;
    UniqueFd plain_lower, agent_tree;
    // A built template's layers over the template (lowest first): their
    // trees (idmapped in user namespace mode) and mount points.
    std::vector<UniqueFd> layer_trees;
    std::vector<std::string> layer_dirs;
    std::optional<WritableDisk> disk;  // its loop descriptor lives until the child has mounted it
    // make_descriptors(): every one close-on-exec; the child dup2s what the
    // agent keeps onto 0-3.
    UniqueFd host_chan, child_chan, sync_wr, sync_rd, err_rd, err_wr, null_fd, log_fd;
    std::string log_path;
    // child_args(): strings, argv and envp, all built before clone.
    std::string overlay_opts, devpts_opts, sandgate_dir, agent_dst, proc_dir, dev_dir, sys_dir, devpts, shm,
        disk_node;
    std::string node_paths[kChildDevices], link_paths[kChildSymlinks];
    std::vector<std::string> env_strings;
    std::vector<char*> envp;
    std::string argv0 = "/.sandgate/sandgate-agent";
    char* argv[2] = {nullptr, nullptr};
    ChildArgs a;
  };

  Status start(const runtime::SandboxSpec& spec, ProcessSandbox& sb, uint64_t t0, bool& created_dir) {
    Launch l;
    if (Status s = check(spec, l); !s) return s;
    if (Status s = make_state_dir(spec, sb, l, created_dir); !s) return s;
    if (Status s = make_layers(spec, sb, l); !s) return s;
    CgroupLimits lim;
    lim.cpu_count = spec.cpu_count;
    lim.memory_bytes = spec.memory_mb * 1024 * 1024;
    lim.max_pids = spec.max_pids;
    auto cg = Cgroup::create(*layout_, cfg_.cgroup_parent, spec.id, lim, os_);
    if (!cg) return cg.error();
    sb.cgroup_ = std::move(*cg);
    sb.has_cgroup_ = true;
    if (Status s = make_descriptors(l); !s) return s;
    if (cfg_.networks) {
      Result<runtime::SandboxNetworks::Link> link = cfg_.networks->reserve(spec.id);
      if (!link) return link.error();
      sb.networks_ = cfg_.networks;
      l.nameserver = link->gateway;
    }
    if (Status s = child_args(spec, l); !s) return s;
    return spawn(spec, sb, l, t0);
  }

  // The request itself: a template directory, the agent binary, sound
  // environment variables.
  Status check(const runtime::SandboxSpec& spec, Launch& l) {
    if (!layout_) return layout_.error();
    if (!valid_sandbox_id(spec.id)) return invalid_error("invalid sandbox id (want [a-z0-9]{1,64})");
    if (spec.layers.size() > runtime::kMaxTemplateLayers || spec.layers.size() > kChildMaxLayers)
      return invalid_error("template has " + std::to_string(spec.layers.size()) + " layers, at most " +
                           std::to_string(runtime::kMaxTemplateLayers));
    char real[PATH_MAX];
    if (!::realpath(spec.rootfs.c_str(), real)) return sys::errno_error("rootfs", spec.rootfs);
    l.rootfs = real;
    struct stat st;
    if (::stat(l.rootfs.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
      return invalid_error("rootfs " + spec.rootfs + ": not a directory");
    if (::stat(cfg_.agent_path.c_str(), &st) != 0 || !S_ISREG(st.st_mode))
      return internal_error("agent binary " + cfg_.agent_path + ": missing or not a regular file (build sandgate-agent)");
    for (const auto& [k, v] : spec.env) {
      if (k.empty() || k.find('=') != std::string::npos || k.find('\0') != std::string::npos ||
          v.find('\0') != std::string::npos)
        return invalid_error("invalid environment variable name " + k);
    }
    return Status::Ok();
  }

  // The sandbox's state directory, after its disk is reserved.
  Status make_state_dir(const runtime::SandboxSpec& spec, ProcessSandbox& sb, Launch& l, bool& created_dir) {
    if (Status s = sys::make_dirs(cfg_.state_root, 0700, os_); !s) return s;
    char real_state[PATH_MAX];
    if (!::realpath(cfg_.state_root.c_str(), real_state)) return sys::errno_error("realpath", cfg_.state_root);
    l.real_state = real_state;
    l.dir = l.real_state + "/" + spec.id;
    // The writable layer: a size-limited filesystem of its own that the
    // child mounts on disk_dir (disk.h), or plain directories in dir. Its
    // full size is reserved on the state root's filesystem first
    // (disk_space.h), so a refused create changes nothing.
    l.limit_disk = spec.disk_mb > 0 && cfg_.disk_limits != runtime::DiskLimits::kOff &&
                   (disk_ || cfg_.disk_limits == runtime::DiskLimits::kOn);
    if (l.limit_disk && !disk_) return disk_.error();
    if (l.limit_disk && spec.disk_mb > kMaxWritableDiskMb)
      return invalid_error("disk size " + std::to_string(spec.disk_mb) + " MiB");
    Result<DiskSpace::Reservation> reservation =
        disk_space_->reserve(l.limit_disk ? spec.disk_mb << 20 : 0, writable_disk_image(l.dir));
    if (!reservation) return reservation.error();
    if (os_.mkdir(l.dir.c_str(), 0700) != 0) {
      if (errno == EEXIST) return conflict_error("state directory " + l.dir + " already exists");
      return sys::errno_error("mkdir", l.dir);
    }
    created_dir = true;
    sb.state_dir_ = l.dir;
    sb.disk_reservation_ = std::move(*reservation);
    return Status::Ok();
  }

  // The filesystem's layers: the template (idmapped in a user namespace),
  // the agent, and the writable layer.
  Status make_layers(const runtime::SandboxSpec& spec, ProcessSandbox& sb, Launch& l) {
    // The user namespace: a uid range, and the template through an
    // idmapped mount so its files are owned by the range (userns.h).
    Result<std::optional<SandboxUserns>> userns = user_namespace_for(sb, l.rootfs);
    if (!userns) return userns.error();
    l.userns = std::move(*userns);
    if (l.userns) l.slot = l.userns->slot;
    l.layer_owner = l.slot ? static_cast<int>(l.slot->uid_base) : -1;
    l.lower_dir = l.dir + "/lower";
    if (os_.mkdir(l.lower_dir.c_str(), 0755) != 0) return sys::errno_error("mkdir", l.lower_dir);
    // The child attaches the template on lower_dir, so the overlay's
    // options name "lower", not the template's host path.
    if (!l.slot) {
      UniqueFd t(os_.open_tree(AT_FDCWD, l.rootfs.c_str(), OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC));
      if (!t) return sys::errno_error("open_tree", l.rootfs);
      Result<UniqueFd> hi = high_fd(os_, std::move(t), "template tree");
      if (!hi) return hi.error();
      l.plain_lower = std::move(*hi);
    }
    if (Status s = attach_template_layers(spec, l); !s) return s;
    Result<UniqueFd> agent_tree = agent_clone();
    if (!agent_tree) return agent_tree.error();
    l.agent_tree = std::move(*agent_tree);

    l.merged = l.dir + "/merged";
    l.disk_dir = l.dir + "/disk";
    l.upper = (l.limit_disk ? l.disk_dir : l.dir) + "/upper";
    l.work = (l.limit_disk ? l.disk_dir : l.dir) + "/work";
    if (l.limit_disk) {
      Result<WritableDisk> d = make_writable_disk(l.dir, l.real_state + "/.disk-images", spec.disk_mb, os_);
      if (!d) return d.error();
      l.disk = std::move(*d);
      sb.disk_image_ = l.disk->image;
      for (const std::string& d : {l.disk_dir, l.merged})
        if (os_.mkdir(d.c_str(), 0755) != 0) return sys::errno_error("mkdir", d);
    } else {
      for (const std::string& d : {l.upper, l.work, l.merged})
        if (os_.mkdir(d.c_str(), 0755) != 0) return sys::errno_error("mkdir", d);
      // The overlay's root takes the upper directory's owner.
      if (l.layer_owner >= 0 && os_.chown(l.upper.c_str(), l.layer_owner, l.layer_owner) != 0)
        return sys::errno_error("chown", l.upper);
    }
    return Status::Ok();
  }

  // The built template's layers: a tree of each (idmapped to the sandbox's
  // range in user namespace mode) and its mount point lower<i>.
  Status attach_template_layers(const runtime::SandboxSpec& spec, Launch& l) {
    for (size_t i = 0; i < spec.layers.size(); ++i) {
      const std::string& layer = spec.layers[i];
      UniqueFd t;
      if (l.slot) {
        Result<UniqueFd> idm = idmapped_tree(layer, l.slot->userns_fd, os_);
        if (!idm) return idm.error().with_context("template layer " + std::to_string(i + 1));
        t = std::move(*idm);
      } else {
        t.reset(os_.open_tree(AT_FDCWD, layer.c_str(), OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC));
        if (!t) return sys::errno_error("open_tree", layer);
      }
      Result<UniqueFd> hi = high_fd(os_, std::move(t), "template layer");
      if (!hi) return hi.error();
      l.layer_trees.push_back(std::move(*hi));
      l.layer_dirs.push_back(l.dir + "/lower" + std::to_string(i + 1));
      if (os_.mkdir(l.layer_dirs.back().c_str(), 0755) != 0) return sys::errno_error("mkdir", l.layer_dirs.back());
    }
    return Status::Ok();
  }

  Status make_descriptors(Launch& l) {
    int sv[2];
    if (os_.socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return sys::errno_error("socketpair", "channel");
    l.host_chan.reset(sv[0]);
    auto child_chan = high_fd(os_, UniqueFd(sv[1]), "channel");
    int sp[2], ep[2];
    // A socket, not a pipe, so writing to a child that already died is an
    // EPIPE error rather than a SIGPIPE (MSG_NOSIGNAL).
    if (os_.socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sp) != 0) return sys::errno_error("socketpair", "sync");
    UniqueFd sync_rd(sp[0]);
    l.sync_wr.reset(sp[1]);
    if (os_.pipe2(ep, O_CLOEXEC) != 0) return sys::errno_error("pipe2", "error pipe");
    l.err_rd.reset(ep[0]);
    auto err_wr = high_fd(os_, UniqueFd(ep[1]), "error pipe");
    auto sync_rd_hi = high_fd(os_, std::move(sync_rd), "sync pipe");
    UniqueFd null_fd(os_.open("/dev/null", O_RDWR | O_CLOEXEC, 0));
    if (!null_fd) return sys::errno_error("open", "/dev/null");
    auto null_hi = high_fd(os_, std::move(null_fd), "/dev/null");
    l.log_path = l.dir + "/agent.log";
    UniqueFd log_fd(os_.open(l.log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600));
    if (!log_fd) return sys::errno_error("open", l.log_path);
    auto log_hi = high_fd(os_, std::move(log_fd), "agent log");
    for (auto* r : {&child_chan, &err_wr, &sync_rd_hi, &null_hi, &log_hi})
      if (!*r) return r->error();
    l.child_chan = std::move(*child_chan);
    l.err_wr = std::move(*err_wr);
    l.sync_rd = std::move(*sync_rd_hi);
    l.null_fd = std::move(*null_hi);
    l.log_fd = std::move(*log_hi);
    return Status::Ok();
  }

  // The paths the child mounts and makes under the state directory, with
  // its /dev's device nodes and links.
  void child_paths(Launch& l) {
    // Relative to dir, the child's working directory (child.h, state_dir).
    // The highest layer first: lowerdir=lowerN:...:lower1:lower.
    std::string lower;
    for (size_t i = l.layer_dirs.size(); i > 0; --i) lower += "lower" + std::to_string(i) + ":";
    lower += "lower";
    l.overlay_opts = l.limit_disk ? "lowerdir=" + lower + ",upperdir=disk/upper,workdir=disk/work"
                                  : "lowerdir=" + lower + ",upperdir=upper,workdir=work";
    l.devpts_opts =
        "newinstance,ptmxmode=0666,mode=0620,gid=" + std::to_string(l.slot ? l.slot->uid_base + 5 : 5);
    l.sandgate_dir = l.merged + "/.sandgate";
    l.agent_dst = l.sandgate_dir + "/sandgate-agent";
    l.proc_dir = l.merged + "/proc";
    l.dev_dir = l.merged + "/dev";
    l.sys_dir = l.merged + "/sys";
    l.devpts = l.dev_dir + "/pts";
    l.shm = l.dev_dir + "/shm";
    struct Node {
      const char* name;
      unsigned major, minor;
    };
    static const Node kNodes[kChildDevices] = {{"null", 1, 3},   {"zero", 1, 5},    {"full", 1, 7},
                                               {"random", 1, 8}, {"urandom", 1, 9}, {"tty", 5, 0}};
    static const std::pair<const char*, const char*> kLinks[kChildSymlinks] = {
        {"pts/ptmx", "ptmx"}, {"/proc/self/fd", "fd"}, {"/proc/self/fd/0", "stdin"},
        {"/proc/self/fd/1", "stdout"}, {"/proc/self/fd/2", "stderr"}};
    for (int i = 0; i < kChildDevices; ++i) {
      l.node_paths[i] = l.dev_dir + "/" + kNodes[i].name;
      l.a.devices[i] = {l.node_paths[i].c_str(), static_cast<mode_t>(S_IFCHR | 0666),
                        makedev(kNodes[i].major, kNodes[i].minor)};
    }
    for (int i = 0; i < kChildSymlinks; ++i) {
      l.link_paths[i] = l.dev_dir + "/" + kLinks[i].second;
      l.a.symlinks[i] = {kLinks[i].first, l.link_paths[i].c_str()};
    }
  }

  // The agent's environment: the sandbox's, with SANDGATE_* its own.
  void child_env(const runtime::SandboxSpec& spec, Launch& l) {
    bool has_path = false;
    for (const auto& [k, v] : spec.env) {
      if (k.rfind("SANDGATE_", 0) == 0) continue;  // reserved for the agent
      if (k == "PATH") has_path = true;
      l.env_strings.push_back(k + "=" + v);
    }
    if (!has_path) l.env_strings.push_back("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin");
    l.env_strings.push_back("SANDGATE_SANDBOX_ID=" + spec.id);
    if (!spec.envd_access_token.empty()) l.env_strings.push_back("SANDGATE_ENVD_TOKEN=" + spec.envd_access_token);
    if (l.slot) l.env_strings.push_back("SANDGATE_USERNS_FD=5");  // child.cpp puts it there
    if (cfg_.sandboxes_outlive_host) l.env_strings.push_back("SANDGATE_REATTACH=1");
    if (!l.nameserver.empty()) l.env_strings.push_back("SANDGATE_NAMESERVER=" + l.nameserver);
    for (std::string& e : l.env_strings) l.envp.push_back(e.data());
    l.envp.push_back(nullptr);
    l.argv[0] = l.argv0.data();
  }

  // What the child (child.cpp) reads: descriptors, limits, paths, argv,
  // envp; every string in l.
  Status child_args(const runtime::SandboxSpec& spec, Launch& l) {
    child_paths(l);
    child_env(spec, l);
    ChildArgs& a = l.a;
    a.sync_fd = l.sync_rd.get();
    a.sync_wr_fd = l.sync_wr.get();
    a.err_fd = l.err_wr.get();
    a.err_rd_fd = l.err_rd.get();
    a.channel_fd = l.child_chan.get();
    a.host_channel_fd = l.host_chan.get();
    a.null_fd = l.null_fd.get();
    a.log_fd = l.log_fd.get();
    a.die_with_parent = !cfg_.sandboxes_outlive_host;
    // Open files: 1024 soft, 65536 hard, or less where sandgate's own hard
    // limit is lower (raising it would need CAP_SYS_RESOURCE).
    struct rlimit own {};
    if (::getrlimit(RLIMIT_NOFILE, &own) != 0) return sys::errno_error("getrlimit", "RLIMIT_NOFILE");
    a.nofile_hard = std::min<uint64_t>(kSandboxNofileHard, own.rlim_max);
    a.nofile_soft = std::min<uint64_t>(kSandboxNofileSoft, a.nofile_hard);
    a.hostname = spec.id.c_str();
    a.hostname_len = spec.id.size();
    a.merged = l.merged.c_str();
    a.state_dir = l.dir.c_str();
    if (l.disk) {
      l.disk_node = l.disk->node.substr(l.dir.size() + 1);
      a.disk_node = l.disk_node.c_str();
      a.disk_dir = l.disk_dir.c_str();
      a.disk_upper = l.upper.c_str();
      a.disk_work = l.work.c_str();
    }
    a.overlay_opts = l.overlay_opts.c_str();
    a.sandgate_dir = l.sandgate_dir.c_str();
    a.agent_tree_fd = l.agent_tree.get();
    a.agent_src = cfg_.agent_path.c_str();
    a.agent_dst = l.agent_dst.c_str();
    a.proc_dir = l.proc_dir.c_str();
    a.dev_dir = l.dev_dir.c_str();
    a.devpts_dir = l.devpts.c_str();
    a.devpts_opts = l.devpts_opts.c_str();
    a.lower_tree_fd = l.slot ? l.userns->tree.get() : l.plain_lower.get();
    a.lower_dir = l.lower_dir.c_str();
    a.layers = static_cast<int>(l.layer_trees.size());
    for (size_t i = 0; i < l.layer_trees.size(); ++i) {
      a.layer_tree_fds[i] = l.layer_trees[i].get();
      a.layer_dirs[i] = l.layer_dirs[i].c_str();
    }
    if (l.slot) {
      a.layer_owner = l.layer_owner;
      a.userns_fd = l.userns->ns.get();
    }
    a.shm_dir = l.shm.c_str();
    a.sys_dir = l.sys_dir.c_str();
    a.agent_exec = l.argv0.c_str();
    a.argv = l.argv;
    a.envp = l.envp.data();
    return Status::Ok();
  }

  // clone() on the spawner thread, the child into its cgroups, then its
  // namespace setup's verdict (the error pipe) and the agent's ready frame.
  Status spawn(const runtime::SandboxSpec& spec, ProcessSandbox& sb, Launch& l, uint64_t t0) {
    std::unique_ptr<char[]> stack(new char[kChildStackSize]);
    int pidfd = -1;
    pid_t pid = -1;
    int clone_errno = 0;
    const int flags = CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWNET | CLONE_PIDFD | SIGCHLD;
    spawner_.run([&] {
      // SAFETY: the stack grows down from the end of a live 256 KiB buffer,
      // 16-byte aligned; without CLONE_VM the child gets its own copy of it.
      char* top = stack.get() + kChildStackSize;
      top = reinterpret_cast<char*>(reinterpret_cast<uintptr_t>(top) & ~uintptr_t{15});
      pid = os_.clone(child_main, top, flags, &l.a, &pidfd);
      clone_errno = errno;
    });
    if (pid < 0) return sys::errno_error("clone", "sandbox init", clone_errno);
    sb.pid_ = pid;
    sb.pidfd_.reset(pidfd);
    for (UniqueFd* f : {&l.child_chan, &l.err_wr, &l.sync_rd, &l.null_fd, &l.log_fd}) f->reset();

    if (Status s = sb.cgroup_.add_process(pid); !s) return s;
    if (sb.networks_) {
      // The child waits for "go": its link and policy are in place before
      // anything of the sandbox runs.
      std::string ns_path = "/proc/" + std::to_string(pid) + "/ns/net";
      UniqueFd ns(::open(ns_path.c_str(), O_RDONLY | O_CLOEXEC));
      if (!ns) return sys::errno_error("open", ns_path);
      if (Status s = sb.networks_->attach(spec.id, ns.get()); !s) return s.error().with_context("sandbox network");
    }
    char go = 1;
    if (os_.send(l.sync_wr.get(), &go, 1, MSG_NOSIGNAL) != 1) return sys::errno_error("write", "sync socket");
    l.sync_wr.reset();

    uint64_t deadline = t0 + static_cast<uint64_t>(spec.ready_timeout.count()) * 1000000ull;
    ChildError ce;
    size_t got = 0;
    while (got < sizeof ce) {
      uint64_t now = sys::monotonic_ns();
      if (now >= deadline) return Error(ErrorKind::kTimeout, "timed out setting up the sandbox namespaces");
      struct pollfd p = {l.err_rd.get(), POLLIN, 0};
      int r = ::poll(&p, 1, static_cast<int>((deadline - now) / 1000000 + 1));
      if (r < 0 && errno != EINTR) return sys::errno_error("poll", "error pipe");
      if (r <= 0) continue;
      ssize_t n = ::read(l.err_rd.get(), reinterpret_cast<char*>(&ce) + got, sizeof ce - got);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;  // EOF: execve succeeded
      got += static_cast<size_t>(n);
    }
    if (got == sizeof ce) return sys::errno_error(describe_step(static_cast<ChildStep>(ce.step), l.a), "", ce.err);
    if (got != 0) return internal_error("sandbox init reported a truncated error");

    if (Status rs = read_ready_frame(l.host_chan.get(), sb.pidfd_.get(), deadline); !rs) {
      std::string log = sys::read_tail(l.log_path, 2000);
      if (!log.empty()) return Error(rs.error().kind(), rs.error().message() + "; agent log: " + log);
      return rs;
    }
    if (cfg_.sandboxes_outlive_host)
      if (Status w = write_record(sb, spec.disk_mb); !w) return w;
    sb.channel_ = std::move(l.host_chan);
    // The channel now belongs to the host Mux; nothing after ready is buffered.
    std::lock_guard<std::mutex> cl(sb.chan_mu_);
    sb.host_channel_ = std::make_shared<HostChannel>(spec.id, sb.channel_.get(), cfg_.open_service);
    return Status::Ok();
  }

  // A sandbox's user namespace, or nullopt: the sandbox runs without one (off, or auto where this host or
  // the template's filesystem cannot have one). The slot, once taken, is
  // the sandbox's (released by kill_locked).
  Result<std::optional<SandboxUserns>> user_namespace_for(ProcessSandbox& sb, const std::string& rootfs) {
    using runtime::UserNamespaces;
    if (cfg_.user_namespaces == UserNamespaces::kOff) return std::optional<SandboxUserns>();
    if (!userns_) {
      if (cfg_.user_namespaces == UserNamespaces::kOn) return userns_.error();
      return std::optional<SandboxUserns>();
    }
    Result<UidSlots::Slot> got = uid_slots_->acquire();
    if (!got) return got.error();
    Result<UniqueFd> tree = idmapped_tree(rootfs, got->userns_fd, os_);
    if (!tree) {
      uid_slots_->release(got->index);
      if (cfg_.user_namespaces == UserNamespaces::kOn || tree.error().kind() != ErrorKind::kUnavailable)
        return tree.error();
      if (!idmap_warned_.exchange(true))
        LOG_WARN("sandbox root is host root (no user namespace): " << tree.error().message());
      return std::optional<SandboxUserns>();
    }
    sb.uid_slots_ = uid_slots_;
    sb.uid_slot_ = got->index;
    sb.uid_base_ = got->uid_base;
    SandboxUserns u;
    u.slot = *got;
    Result<UniqueFd> tree_hi = high_fd(os_, std::move(*tree), "idmapped template");
    if (!tree_hi) return tree_hi.error();
    u.tree = std::move(*tree_hi);
    u.ns.reset(os_.dup_high(got->userns_fd, 10));
    if (!u.ns) return sys::errno_error("fcntl F_DUPFD_CLOEXEC", "user namespace");
    return std::optional<SandboxUserns>(std::move(u));
  }

  // A clone of the agent's private copy for one sandbox (agent_tree.h),
  // the copy made at the first create (an agent binary replaced on disk
  // later reaches new sandboxes after a restart); an empty descriptor
  // where the kernel cannot make one, and the child binds the host file.
  Result<UniqueFd> agent_clone() {
    std::lock_guard<std::mutex> l(agent_mu_);
    if (!agent_tree_tried_) {
      Result<UniqueFd> t = make_agent_tree(cfg_.agent_path);
      if (!t && t.error().kind() != ErrorKind::kUnavailable) return t.error();
      if (t) {
        agent_tree_ = std::move(*t);
      } else {
        LOG_WARN("sandboxes' /proc/self/mountinfo will show the agent's host path (" << cfg_.agent_path
                                                                                      << "): " << t.error().message());
      }
      agent_tree_tried_ = true;
    }
    if (!agent_tree_) return UniqueFd();
    return clone_agent(agent_tree_.get(), os_);
  }

  runtime::RuntimeConfig cfg_;
  sys::Os& os_;
  Result<CgroupLayout> layout_;
  Status disk_;  // whether size-limited writable layers can be made here
  Status userns_;  // whether sandboxes can have user namespaces here
  std::shared_ptr<UidSlots> uid_slots_;
  std::atomic<bool> idmap_warned_{false};
  std::shared_ptr<DiskSpace> disk_space_;
  std::mutex agent_mu_;
  bool agent_tree_tried_ = false;  // GUARDED_BY(agent_mu_)
  UniqueFd agent_tree_;            // GUARDED_BY(agent_mu_)
  Spawner spawner_;
};

}  // namespace

bool valid_sandbox_id(std::string_view id) {
  if (id.empty() || id.size() > 64) return false;
  for (char c : id)
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9'))) return false;
  return true;
}

std::unique_ptr<runtime::Runtime> make_process_runtime(const runtime::RuntimeConfig& cfg) {
  return std::make_unique<ProcessRuntime>(cfg);
}

}  // namespace sg::process
