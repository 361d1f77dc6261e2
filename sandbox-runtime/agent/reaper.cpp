// Reaper implementation.
#include "sandbox-runtime/agent/reaper.h"

#include <sys/wait.h>

#include <cerrno>

namespace sg::agent {

pid_t Reaper::spawn(const std::function<pid_t()>& start) {
  std::lock_guard<std::mutex> g(mu_);
  pid_t pid = start();
  if (pid > 0) table_[pid] = std::nullopt;
  return pid;
}

void Reaper::reap_all() {
  for (;;) {
    int st = 0;
    pid_t pid;
    {
      // Holding the lock across waitpid keeps spawn()'s fork and
      // registration atomic with respect to reaping.
      std::lock_guard<std::mutex> g(mu_);
      pid = ::waitpid(-1, &st, WNOHANG);
      if (pid > 0) {
        auto it = table_.find(pid);
        if (it != table_.end()) it->second = st;
      }
    }
    if (pid > 0) {
      cv_.notify_all();
      continue;
    }
    if (pid < 0 && errno == EINTR) continue;
    return;
  }
}

std::optional<int> Reaper::wait(pid_t pid, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> l(mu_);
  auto ready = [&] {
    auto it = table_.find(pid);
    return it == table_.end() || it->second.has_value();
  };
  if (!cv_.wait_for(l, timeout, ready)) return std::nullopt;
  auto it = table_.find(pid);
  if (it == table_.end()) return std::nullopt;
  std::optional<int> st = it->second;
  table_.erase(it);
  return st;
}

std::optional<int> Reaper::poll(pid_t pid) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = table_.find(pid);
  if (it == table_.end() || !it->second) return std::nullopt;
  std::optional<int> st = it->second;
  table_.erase(it);
  return st;
}

}  // namespace sg::agent
