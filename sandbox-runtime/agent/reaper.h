// Reaper: the agent is PID 1 and reaps every child, but envd also needs the
// exit status of the processes it starts. Processes are started through
// spawn(), which registers the pid before the main loop can reap it; the
// main loop calls reap_all() on SIGCHLD, which records registered statuses
// and discards orphans. Thread-safe.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <optional>

namespace sg::agent {

class Reaper {
 public:
  // Runs start() (which forks and returns the child pid, or -1) with the
  // table locked, and registers the pid. Returns the pid.
  pid_t spawn(const std::function<pid_t()>& start);
  // waitpid(-1, WNOHANG) until no child is left to reap.
  void reap_all();
  // The wait status of a registered pid once it exited; nullopt on timeout.
  // The entry is forgotten once returned.
  std::optional<int> wait(pid_t pid, std::chrono::milliseconds timeout);
  // Non-blocking: the status if it already exited.
  std::optional<int> poll(pid_t pid);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<pid_t, std::optional<int>> table_;  // GUARDED_BY(mu_)
};

}  // namespace sg::agent
