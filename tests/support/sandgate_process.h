// SandgateProcess: the real sandgate binary, started for a test on port 0
// with its own data dir and cgroup parent, stopped at the end.
//
// Start-up is synchronised on the banner line the server prints once it
// listens (read from its stdout with a deadline), never on sleeps.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tests/support/http_client.h"
#include "tests/support/temp_dir.h"

namespace sg::test {

// Path of the sandgate binary under test (compile definition SANDGATE_BIN,
// or $SANDGATE_TEST_BIN where set).
std::string sandgate_bin();

// A templates dir whose base/ is the test rootfs (built once if needed).
std::string test_templates_dir();

struct CliResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};
// Runs `sandgate ARGS...` to completion, or until timeout (0: none), when
// it is killed and exit_code is kTimedOut.
inline constexpr int kTimedOut = -2;
CliResult run_sandgate(const std::vector<std::string>& args,
                       std::chrono::milliseconds timeout = std::chrono::milliseconds(0));

// Reads a sandbox's state and host pid straight from a server's SQLite file
// (what the API deliberately does not expose); nullopt if there is none.
struct SandboxState {
  std::string state;
  int64_t init_pid = 0;
  std::string end_reason;
};
std::optional<SandboxState> sandbox_state(const std::string& data_dir, const std::string& id);

class SandgateProcess {
 public:
  // data_dir: persistent across restarts when the same path is given.
  // cgroup_parent: empty for a fresh random one; pass another instance's to
  // restart "the same" sandgate.
  SandgateProcess(std::string data_dir, std::vector<std::string> extra_args = {}, std::string cgroup_parent = "");
  ~SandgateProcess();
  SandgateProcess(const SandgateProcess&) = delete;
  SandgateProcess& operator=(const SandgateProcess&) = delete;

  // True once the server printed its banner within the deadline.
  bool started() const { return port_ > 0; }
  int port() const { return port_; }
  const std::string& key() const { return key_; }  // tenant "local"
  const std::string& cgroup_parent() const { return cgroup_parent_; }
  const std::string& data_dir() const { return data_dir_; }
  pid_t pid() const { return pid_; }
  HttpClient client() const { return HttpClient("127.0.0.1", port_); }
  std::string log() const;  // the server's stderr so far

  // SIGTERM and wait: returns the exit status.
  int stop();
  // SIGKILL and wait (a crash).
  void kill9();

  // Convenience requests with this server's key.
  Response get(const std::string& target, const std::string& key = "") const;
  Response post(const std::string& target, const std::string& body, const std::string& key = "") const;
  Response del(const std::string& target, const std::string& key = "") const;

 private:
  std::string data_dir_;
  std::string cgroup_parent_;
  pid_t pid_ = -1;
  int port_ = 0;
  std::string key_;
};

}  // namespace sg::test
