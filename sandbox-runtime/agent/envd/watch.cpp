// The per-envd inotify hub and its watchers (see watch.h).
#include "sandbox-runtime/agent/envd/watch.h"

#include <dirent.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <system_error>

#include "sandbox-runtime/agent/envd/filesystem.h"
#include "base/log.h"
#include "base/sys.h"

namespace sg::envd {

namespace {

constexpr uint32_t kWatchMask = IN_CREATE | IN_DELETE | IN_MODIFY | IN_MOVED_FROM | IN_MOVED_TO | IN_ATTRIB |
                                IN_DELETE_SELF | IN_MOVE_SELF | IN_DONT_FOLLOW;
constexpr int kMaxDepth = 64;

void bump(int efd) {
  uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(efd, &one, sizeof one);
}

RpcError too_many_watches(size_t limit) {
  return rpc_error(Code::kResourceExhausted,
                   "too many watched directories in this sandbox: the limit is " + std::to_string(limit) +
                       " (a recursive watch takes one per subdirectory); watch a smaller tree or remove other watchers");
}

}  // namespace

// ---- Watcher ----

Watcher::~Watcher() {
  if (hub_) hub_->release(this);
}

void Watcher::signal() { bump(wake_.get()); }

RpcStatus Watcher::take(std::vector<json>* out, size_t max) {
  std::vector<Raw> raws;
  std::optional<RpcError> err;
  {
    std::lock_guard<std::mutex> g(hub_->mu_);
    // What the kernel has queued so far first: a change made before this
    // call is in its answer, whether or not the dispatcher has run since.
    if (hub_->ino_) hub_->drain_locked();
    uint64_t v;
    [[maybe_unused]] ssize_t n = ::read(wake_.get(), &v, sizeof v);
    while (!queue_.empty() && raws.size() < max) {
      raws.push_back(std::move(queue_.front()));
      queue_.pop_front();
    }
    if (raws.empty()) err = error_;
    if (!queue_.empty() || error_) signal();  // more to take: stay readable
  }
  if (err) return *err;
  for (auto& r : raws) {
    std::string name = r.full == root_ ? std::string() : r.full.substr(root_ == "/" ? 1 : root_.size() + 1);
    json e{{"name", name}, {"type", r.type}};
    if (include_entry_ && hub_->users_) {
      auto info = entry_info(r.full, *hub_->users_);
      if (info) e["entry"] = std::move(*info);
    }
    out->push_back(std::move(e));
  }
  return rpc_ok();
}

// ---- WatchHub ----

WatchHub::~WatchHub() { stop(); }

Status WatchHub::start() {
  wake_ = UniqueFd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_) return sys::errno_error("eventfd", "envd watch hub");
  try {
    thread_ = std::thread([this] { run(); });
  } catch (const std::system_error& e) {
    return internal_error(std::string("envd watch hub thread: ") + e.what());
  }
  std::lock_guard<std::mutex> g(mu_);
  running_ = true;
  return Status::Ok();
}

void WatchHub::stop() {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (stopping_) return;
    stopping_ = true;
    running_ = false;
  }
  if (thread_.joinable()) {
    poke();
    thread_.join();
  }
}

void WatchHub::poke() { bump(wake_.get()); }

WatchStats WatchHub::stats() {
  std::lock_guard<std::mutex> g(mu_);
  WatchStats s;
  s.watchers = watchers_.size();
  s.watches = wds_.size();
  s.instance_open = ino_.valid();
  s.refused = refused_;
  return s;
}

RpcResult<std::shared_ptr<Watcher>> WatchHub::watch(const std::string& root, bool recursive, bool include_entry) {
  struct stat st;
  if (::stat(root.c_str(), &st) < 0) {
    if (errno == ENOENT) return rpc_error(Code::kNotFound, "directory not found: " + root);
    return rpc_errno("stat", root, errno);
  }
  if (!S_ISDIR(st.st_mode)) return rpc_error(Code::kInvalidArgument, "path is not a directory: " + root);
  std::shared_ptr<Watcher> w(new Watcher());
  w->root_ = root;
  w->recursive_ = recursive;
  w->include_entry_ = include_entry;
  w->wake_ = UniqueFd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!w->wake_) return rpc_errno("eventfd", "for a watcher of " + root, errno);
  std::lock_guard<std::mutex> g(mu_);
  if (!running_) return rpc_error(Code::kUnavailable, "envd cannot watch directories now (shutting down or no watch thread)");
  if (watchers_.size() >= limits_.max_watchers) {
    ++refused_;
    return rpc_error(Code::kResourceExhausted,
                     "too many directory watchers in this sandbox: the limit is " +
                         std::to_string(limits_.max_watchers) +
                         " (WatchDir streams and CreateWatcher watchers together); close a stream or RemoveWatcher first");
  }
  if (!ino_) {
    ino_ = UniqueFd(::inotify_init1(IN_NONBLOCK | IN_CLOEXEC));
    if (!ino_) {
      int e = errno;
      RpcError err = rpc_errno("inotify_init", "for a watcher of " + root, e);
      if (e == EMFILE || e == ENFILE || e == ENOMEM) err.code = Code::kResourceExhausted;
      return err;
    }
    poke();  // the dispatcher polls the new instance
  }
  // Registered from here on; an error releases what was added, under this
  // lock, and detaches w so its destructor has nothing left to do.
  w->hub_ = this;
  watchers_.insert(w.get());
  RpcStatus s = add_watch_locked(*w, root);
  if (s && recursive) s = add_tree_locked(*w, root, 0);
  if (!s) {
    if (s.error().code == Code::kResourceExhausted) ++refused_;
    release_locked(w.get());
    w->hub_ = nullptr;
    return s.error();
  }
  return w;
}

RpcStatus WatchHub::add_watch_locked(Watcher& w, const std::string& dir) {
  int wd = ::inotify_add_watch(ino_.get(), dir.c_str(), kWatchMask);
  if (wd < 0) {
    int e = errno;
    if (e == ENOSPC) return too_many_watches(limits_.max_watches);  // the host's max_user_watches
    return rpc_errno("inotify_add_watch", dir, e);
  }
  auto it = wds_.find(wd);
  if (it == wds_.end()) {
    if (wds_.size() >= limits_.max_watches) {
      ::inotify_rm_watch(ino_.get(), wd);
      return too_many_watches(limits_.max_watches);
    }
    it = wds_.emplace(wd, std::set<Watcher*>{}).first;
  }
  it->second.insert(&w);
  w.dirs_[wd] = dir;
  return rpc_ok();
}

// Watches every directory below dir; the first limit reached ends it with
// that error. Directories that vanish meanwhile are skipped.
RpcStatus WatchHub::add_tree_locked(Watcher& w, const std::string& dir, int depth) {
  if (depth > kMaxDepth) return rpc_ok();
  DIR* d = ::opendir(dir.c_str());
  if (!d) return rpc_ok();
  std::vector<std::string> subs;
  while (struct dirent* de = ::readdir(d)) {
    std::string n = de->d_name;
    if (n == "." || n == "..") continue;
    if (de->d_type == DT_DIR) subs.push_back(dir == "/" ? "/" + n : dir + "/" + n);
  }
  ::closedir(d);
  for (auto& s : subs) {
    RpcStatus st = add_watch_locked(w, s);
    if (!st) {
      if (st.error().code == Code::kResourceExhausted) return st;
      continue;  // removed meanwhile, or not readable
    }
    st = add_tree_locked(w, s, depth + 1);
    if (!st) return st;
  }
  return rpc_ok();
}

void WatchHub::release(Watcher* w) {
  std::lock_guard<std::mutex> g(mu_);
  release_locked(w);
}

void WatchHub::release_locked(Watcher* w) {
  for (auto& [wd, dir] : w->dirs_) {
    auto it = wds_.find(wd);
    if (it == wds_.end()) continue;
    it->second.erase(w);
    if (it->second.empty()) {
      // The kernel answers with IN_IGNORED for wd, which the dispatcher
      // drops (no watcher has it); descriptors are allocated cyclically,
      // so wd is not handed out again before that.
      ::inotify_rm_watch(ino_.get(), wd);
      wds_.erase(it);
    }
  }
  w->dirs_.clear();
  watchers_.erase(w);
  if (watchers_.empty()) poke();  // the dispatcher closes the instance
}

void WatchHub::run() {
  for (;;) {
    int fd = -1;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (stopping_) return;
      if (watchers_.empty() && ino_) {
        ino_.reset();  // hands the instance back to host root's quota
        wds_.clear();
      }
      fd = ino_ ? ino_.get() : -1;
    }
    struct pollfd pf[2] = {{wake_.get(), POLLIN, 0}, {fd, POLLIN, 0}};
    int r = ::poll(pf, fd >= 0 ? 2 : 1, -1);
    if (r < 0 && errno != EINTR) {
      LOG_ERROR("envd: poll for the watch hub: " << std::strerror(errno));
      return;
    }
    if (pf[0].revents & POLLIN) {
      uint64_t v;
      [[maybe_unused]] ssize_t n = ::read(wake_.get(), &v, sizeof v);
    }
    if (fd >= 0 && (pf[1].revents & POLLIN)) {
      std::lock_guard<std::mutex> g(mu_);
      if (ino_.get() == fd) drain_locked();
    }
  }
}

void WatchHub::drain_locked() {
  alignas(struct inotify_event) char buf[16 << 10];
  for (;;) {
    ssize_t n = ::read(ino_.get(), buf, sizeof buf);
    if (n <= 0) {
      if (n < 0 && errno != EAGAIN && errno != EINTR) LOG_ERROR("envd: read inotify: " << std::strerror(errno));
      return;
    }
    for (ssize_t i = 0; i < n;) {
      // SAFETY: the kernel writes whole, aligned inotify_event records.
      auto* ev = reinterpret_cast<struct inotify_event*>(buf + i);
      i += static_cast<ssize_t>(sizeof(struct inotify_event) + ev->len);
      if (ev->mask & IN_Q_OVERFLOW) {
        for (Watcher* w : watchers_) {
          if (!w->error_)
            w->error_ = rpc_error(Code::kResourceExhausted, "watcher of " + w->root_ +
                                                                ": events lost, the sandbox's inotify queue overflowed");
          w->signal();
        }
        continue;
      }
      auto it = wds_.find(ev->wd);
      if (it == wds_.end()) continue;
      if (ev->mask & IN_IGNORED) {  // the directory is gone
        for (Watcher* w : it->second) w->dirs_.erase(ev->wd);
        wds_.erase(it);
        continue;
      }
      const char* type = nullptr;
      if (ev->mask & (IN_CREATE | IN_MOVED_TO)) type = "EVENT_TYPE_CREATE";
      else if (ev->mask & IN_MODIFY) type = "EVENT_TYPE_WRITE";
      else if (ev->mask & (IN_DELETE | IN_DELETE_SELF)) type = "EVENT_TYPE_REMOVE";
      else if (ev->mask & (IN_MOVED_FROM | IN_MOVE_SELF)) type = "EVENT_TYPE_RENAME";
      else if (ev->mask & IN_ATTRIB) type = "EVENT_TYPE_CHMOD";
      if (!type) continue;
      // A copy: adding watches below may touch wds_ (never this entry's set
      // of watchers, but the map it lives in).
      std::vector<Watcher*> ws(it->second.begin(), it->second.end());
      int wd = ev->wd;
      for (Watcher* w : ws) {
        auto d = w->dirs_.find(wd);
        if (d == w->dirs_.end()) continue;
        const std::string& dir = d->second;
        std::string full = ev->len ? (dir == "/" ? "/" : dir + "/") + std::string(ev->name) : dir;
        if ((ev->mask & (IN_DELETE_SELF | IN_MOVE_SELF)) && dir != w->root_) continue;  // seen from the parent
        if (w->error_) continue;
        if (w->recursive_ && (ev->mask & (IN_CREATE | IN_MOVED_TO)) && (ev->mask & IN_ISDIR)) {
          RpcStatus s = add_watch_locked(*w, full);
          if (s) s = add_tree_locked(*w, full, 1);
          if (!s && s.error().code == Code::kResourceExhausted) w->error_ = s.error();
        }
        if (w->queue_.size() >= limits_.max_queued) {
          w->error_ = rpc_error(Code::kResourceExhausted,
                                "watcher of " + w->root_ + ": events lost, more than " +
                                    std::to_string(limits_.max_queued) + " were queued unread; read them sooner");
        } else {
          w->queue_.push_back({std::move(full), type});
        }
        w->signal();
      }
    }
  }
}

}  // namespace sg::envd
