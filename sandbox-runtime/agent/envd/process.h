// The processes envd starts for process.Process (docs/envd.md).
//
// Each process has one pump thread that polls its output descriptors
// (stdout/stderr pipes or the PTY master), a pidfd (exit) and an eventfd
// (flow-control wake-ups), and fans every chunk out to the subscriptions
// watching it (the Start stream, any Connect streams). Flow control: while
// any subscription holds kPendingLimit bytes or more that its stream has not
// written yet, the pump stops reading, so the pipe fills and the process
// blocks in write(); memory per stream stays below the limit plus one chunk.
// Output with no subscriber is read and dropped (a background process never
// blocks on a stream that went away).
//
// Exit: the pidfd becomes readable, the pump drains what is left in the
// pipes (without waiting for a grandchild that still holds them), takes the
// wait status from the Reaper (the agent's main loop reaps), publishes the
// end event and moves the process to a bounded exit cache so a later Connect
// still gets start + end.
//
// Thread safety: every public method may be called from any thread.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "sandbox-runtime/agent/envd/rpc.h"
#include "sandbox-runtime/agent/envd/spawn.h"
#include "sandbox-runtime/agent/envd/users.h"
#include "sandbox-runtime/agent/reaper.h"

namespace sg::envd {

inline constexpr size_t kPendingLimit = 1 << 20;
inline constexpr size_t kPipeChunk = 32 << 10;
inline constexpr size_t kPtyChunk = 16 << 10;
inline constexpr size_t kExitCacheSize = 256;

struct StartSpec {
  json config;                       // ProcessConfig as received (for List)
  std::optional<std::string> tag;
  std::string exe;                   // resolved executable path
  std::vector<std::string> argv;     // argv[0] = cmd
  std::vector<std::string> env;      // "K=V", final
  std::string cwd;                   // absolute, exists
  User user;
  bool stdin_pipe = false;
  bool pty = false;
  uint16_t cols = 80, rows = 24;
  std::chrono::milliseconds timeout{0};  // process lifetime; 0 = none
};

struct ProcEvent {
  enum Kind { kStdout, kStderr, kPty, kEnd } kind;
  std::string data;        // output bytes
  int wait_status = 0;     // kEnd
  bool timed_out = false;  // kEnd: killed at the Start deadline
};

// proto3 JSON of an end event from a wait status.
json end_event_json(int wait_status);
// Go's os.ProcessState string: "exit status 3", "signal: killed".
std::string wait_status_string(int wait_status);

struct Proc;

// One stream's view of a process. Events are queued until next() takes them.
class Subscription {
 public:
  ~Subscription();
  pid_t pid() const { return pid_; }
  // The next event, waiting until deadline; nullopt on timeout or after
  // the end event was taken.
  std::optional<ProcEvent> next(std::chrono::steady_clock::time_point deadline);
  // Bytes queued and not taken yet.
  size_t pending() const;

 private:
  friend class ProcessManager;
  friend struct Proc;
  pid_t pid_ = 0;
  std::shared_ptr<Proc> proc_;            // null for an exited process
  std::deque<ProcEvent> queue_;           // GUARDED_BY(proc_->mu) or own for exited
  size_t pending_ = 0;                    // GUARDED_BY(proc_->mu)
};

struct ProcessStats {
  size_t running = 0;
  size_t pending_bytes = 0;      // queued in all subscriptions
  uint64_t flow_stalls = 0;      // times a pump stopped reading for a slow stream
  uint64_t started = 0;
};

struct ProcessInfo {
  pid_t pid;
  json config;
  std::optional<std::string> tag;
};

class ProcessManager {
 public:
  // spawn starts the pump threads (empty: spawn_detached).
  explicit ProcessManager(agent::Reaper& reaper, SpawnFn spawn = {});
  ~ProcessManager();
  ProcessManager(const ProcessManager&) = delete;
  ProcessManager& operator=(const ProcessManager&) = delete;

  // Spawns the process and returns the subscription of the caller, which
  // sees every byte of output from the first one. resource_exhausted when
  // no pump thread can be started (the process is killed and reaped first).
  RpcResult<std::shared_ptr<Subscription>> start(const StartSpec& spec);
  // Attaches to a running process by pid or tag (pid 0: use tag); an exited
  // one in the cache yields a subscription holding just its end event.
  RpcResult<std::shared_ptr<Subscription>> connect(pid_t pid, const std::string& tag);
  std::vector<ProcessInfo> list();
  // The pid of the running process with that pid or tag; not_found if none.
  RpcResult<pid_t> lookup(pid_t pid, const std::string& tag);
  RpcStatus send_input(pid_t pid, const std::string& tag, bool pty, const std::string& data);
  RpcStatus close_stdin(pid_t pid, const std::string& tag);
  RpcStatus signal(pid_t pid, const std::string& tag, int sig);
  RpcStatus resize(pid_t pid, const std::string& tag, uint16_t cols, uint16_t rows);
  // Kills every running process and joins the pumps.
  void shutdown();
  ProcessStats stats();

 private:
  std::shared_ptr<Proc> find(pid_t pid, const std::string& tag);
  void pump(std::shared_ptr<Proc> p);
  void finish(const std::shared_ptr<Proc>& p, int status, bool timed_out);

  agent::Reaper& reaper_;
  SpawnFn spawn_;
  std::mutex mu_;
  std::map<pid_t, std::shared_ptr<Proc>> running_;   // GUARDED_BY(mu_)
  struct Exited {
    json config;
    std::optional<std::string> tag;
    int status;
  };
  std::map<pid_t, Exited> exited_;                   // GUARDED_BY(mu_)
  std::deque<pid_t> exited_order_;                   // GUARDED_BY(mu_)
  size_t active_pumps_ = 0;                          // GUARDED_BY(mu_)
  std::condition_variable pumps_done_;
  bool shutting_down_ = false;                       // GUARDED_BY(mu_)
  std::atomic<uint64_t> flow_stalls_{0};
  std::atomic<uint64_t> started_{0};
};

}  // namespace sg::envd
