// Directory watchers of one envd (filesystem.Filesystem WatchDir streams and
// CreateWatcher/GetWatcherEvents/RemoveWatcher) on ONE inotify instance.
//
// Why one: a sandbox's user namespace is created by host root, so its
// inotify instances and watches are charged to host root, whose quotas
// (fs.inotify.max_user_instances, 128 by default, and max_user_watches) are
// shared by every sandbox and by the host itself. An instance per watcher let
// one sandbox take them all (issue 17 item 4). Here a sandbox holds at most
// one instance (opened with its first watcher, closed after its last), at
// most WatchLimits::max_watchers watchers and max_watches watched
// directories, and a watcher's end releases its watches at once.
//
// One dispatcher thread, started with the hub, reads the instance and
// demultiplexes the events by watch descriptor to every watcher of that
// directory: it queues them (bounded) and wakes the watcher's eventfd. The
// kernel gives one descriptor per directory per instance, so a descriptor
// may be shared by watchers; it is removed from the instance when its last
// watcher goes.
//
// Thread safety: every method may be called from any thread; take() of one
// Watcher by one thread at a time. Watchers must not outlive their hub.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "sandbox-runtime/agent/envd/rpc.h"
#include "sandbox-runtime/agent/envd/users.h"
#include "base/fd.h"
#include "base/status.h"

namespace sg::envd {

struct WatchLimits {
  size_t max_watchers = 64;   // streams and polled watchers together
  size_t max_watches = 4096;  // watched directories (recursive watches take one per subdirectory)
  size_t max_queued = 16384;  // events queued per watcher (the kernel's default queue)
};

struct WatchStats {
  size_t watchers = 0;
  size_t watches = 0;          // watch descriptors on the instance
  bool instance_open = false;  // whether the inotify instance exists
  uint64_t refused = 0;        // watchers refused at a limit
};

class WatchHub;

class Watcher {
 public:
  ~Watcher();  // releases its watches
  Watcher(const Watcher&) = delete;
  Watcher& operator=(const Watcher&) = delete;
  // Readable (an eventfd) while events or an error are queued.
  int event_fd() const { return wake_.get(); }
  // Appends the queued events as FilesystemEvent JSON (at most max), the
  // kernel's pending ones read first: a change made before the call is in
  // its answer, whether or not the dispatcher has run since. Once
  // they are taken: the error that ended the watcher, if any (events lost
  // to a full queue, or the watch limit reached by a new subdirectory).
  RpcStatus take(std::vector<json>* out, size_t max);

 private:
  friend class WatchHub;
  Watcher() = default;
  void signal();
  struct Raw {
    std::string full;  // path of the entry the event is about
    const char* type;  // EVENT_TYPE_*
  };
  WatchHub* hub_ = nullptr;
  std::string root_;
  bool recursive_ = false, include_entry_ = false;
  UniqueFd wake_;
  // All GUARDED_BY(hub_->mu_):
  std::map<int, std::string> dirs_;  // watch descriptor -> directory
  std::deque<Raw> queue_;
  std::optional<RpcError> error_;
};

class WatchHub {
 public:
  WatchHub(WatchLimits limits, const UserDb* users) : limits_(limits), users_(users) {}
  ~WatchHub();  // stop()s
  WatchHub(const WatchHub&) = delete;
  WatchHub& operator=(const WatchHub&) = delete;

  // Starts the dispatcher thread (at envd start-up, so no sandbox user can
  // have exhausted threads yet). On an error watch() refuses (unavailable).
  Status start();
  // Joins the dispatcher. Existing watchers stay valid (their event fds no
  // longer wake for new events; take() still reads them) and may still be
  // destroyed.
  void stop();
  // A watcher of root (a directory), and with recursive of every directory
  // below it (and those created later). resource_exhausted at a limit.
  RpcResult<std::shared_ptr<Watcher>> watch(const std::string& root, bool recursive, bool include_entry);
  WatchStats stats();

 private:
  friend class Watcher;
  void run();
  void release(Watcher* w);
  void release_locked(Watcher* w);
  RpcStatus add_watch_locked(Watcher& w, const std::string& dir);
  RpcStatus add_tree_locked(Watcher& w, const std::string& dir, int depth);
  void drain_locked();
  void poke();

  const WatchLimits limits_;
  const UserDb* users_;
  UniqueFd wake_;  // the dispatcher's eventfd
  std::thread thread_;
  std::mutex mu_;
  bool running_ = false;    // GUARDED_BY(mu_)
  bool stopping_ = false;   // GUARDED_BY(mu_)
  // The instance: opened by watch(), closed only by the dispatcher thread
  // (after the last watcher), so the descriptor it polls stays valid.
  UniqueFd ino_;                             // GUARDED_BY(mu_)
  std::map<int, std::set<Watcher*>> wds_;    // GUARDED_BY(mu_): descriptor -> its watchers
  std::set<Watcher*> watchers_;              // GUARDED_BY(mu_)
  uint64_t refused_ = 0;                     // GUARDED_BY(mu_)
};

}  // namespace sg::envd
