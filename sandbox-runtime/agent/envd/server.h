// envd: the E2B per-sandbox API (process.Process, filesystem.Filesystem over
// Connect JSON, plus /health, /envs and /files), served by sandgate-agent on
// 127.0.0.1:49983 inside every sandbox so unmodified E2B SDKs can run
// commands and move files. Wire contract: /work/shared/e2b-protocol.md
// sections 3.1-3.5; what is and is not implemented: docs/envd.md.
//
// Thread model: one accept thread; one worker thread per connection
// (bounded by max_connections), which parses requests and, for streams,
// waits on the process's output or its watcher's eventfd; one watch
// dispatcher thread (agent/envd/watch.h); one pump thread per running
// process (agent/envd/process.h). The agent's main thread keeps reaping
// children via the shared Reaper, which the process pumps read exit
// statuses from. Everything hangs off the Server object; several can live
// in one process.
//
// The sandbox user can exhaust threads (a fork bomb under the pids limit
// the agent shares), so no thread creation after start() may end the agent
// (issue 17 item 6): start() pre-creates kReserveWorkers connection
// workers, a worker that finishes a connection waits for the next one
// (up to kMaxIdleWorkers stay), and a refused thread costs one request: the
// connection is answered 503 and closed, a Start gets resource_exhausted.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "sandbox-runtime/agent/envd/process.h"
#include "sandbox-runtime/agent/envd/spawn.h"
#include "sandbox-runtime/agent/envd/watch.h"
#include "sandbox-runtime/agent/reaper.h"
#include "base/status.h"

namespace sg::envd {

struct EnvdConfig {
  std::string access_token;              // empty: no token checks
  std::vector<std::string> default_env;  // "K=V" base environment (sandbox envVars included)
  std::string default_user = "user";
  std::string version = "0.6.13";
  std::string passwd_path = "/etc/passwd", group_path = "/etc/group";  // tests point these at temp files
  size_t max_connections = 256;
  WatchLimits watch;  // per sandbox: watchers, watched directories
  SpawnFn spawn;      // thread creation after start(); empty: spawn_detached (tests inject refusals)
};

inline constexpr size_t kReserveWorkers = 2;
inline constexpr size_t kMaxIdleWorkers = 4;

struct ServerStats {
  size_t connections = 0;   // open now
  uint64_t rejected_connections = 0;  // over max_connections
  ProcessStats processes;
  WatchStats watch;
  size_t workers = 0;       // connection worker threads alive
  size_t idle_workers = 0;  // of which waiting for a connection
  uint64_t refused_threads = 0;  // connections answered 503 for want of a thread
};

class Server {
 public:
  Server(EnvdConfig cfg, agent::Reaper& reaper);
  ~Server();  // stop()s
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds and listens (port 0: any free port, see port()).
  Status listen(const std::string& address, uint16_t port);
  uint16_t port() const;
  // Starts the accept loop, the watch dispatcher and the reserve workers on
  // threads of their own. An error: the accept thread could not be started
  // (a failed reserve worker or watch thread is logged and degrades only).
  Status start();
  // Closes the listener and every connection, SIGKILLs the processes this
  // server started and joins all its threads. Idempotent. The Reaper must
  // keep being driven meanwhile (the processes' statuses are waited for).
  void stop();
  ServerStats stats();
  // Replaces the access token and the base environment for every request
  // from now on (requests in flight keep what they began with); processes
  // already running keep theirs. A microVM cloned from a snapshot taken
  // with envd running (a template's warm start command) is re-keyed so.
  void reconfigure(std::string access_token, std::vector<std::string> default_env);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace sg::envd
