// The host's client of a sandbox's envd (the agent's E2B-compatible API on
// port 49983, reached through runtime::Sandbox::open_port): runs one
// command with process.Process/Start (Connect protocol, server-streaming
// JSON, docs/envd.md) and streams its output. Template builds run their
// steps with it, and a template's start and ready commands.
//
// The sandbox is untrusted: every read has a deadline, every envelope and
// header is bounded, and a malformed answer is an error, never a crash.
//
// Thread safety: run_command() holds no state; calls may run in parallel,
// each on its own stream.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/status.h"
#include "sandbox-runtime/runtime.h"

namespace sg::host {

inline constexpr uint16_t kEnvdPort = 49983;
// One envelope of the reply stream (a chunk of output is 32 KiB at most).
inline constexpr size_t kMaxEnvelope = 4 << 20;

struct Command {
  std::string script;  // run as /bin/bash -l -c script
  std::string user = "root";
  std::string cwd;  // "": the user's home
  std::vector<std::pair<std::string, std::string>> env;
  // The process's lifetime (envd kills it after this) and the stream's
  // deadline (a little longer). Must be positive.
  std::chrono::milliseconds timeout{60000};
  // true: returns once the process has started (it runs on; its output is
  // not read).
  bool background = false;
};

struct CommandResult {
  int exit_code = 0;   // -1 when killed by a signal (status says which)
  std::string status;  // "exit status 3", "signal: killed"
  int pid = 0;
};

// Output as it comes: stream 1 stdout, 2 stderr.
using OutputFn = std::function<void(int stream, std::string_view data)>;

// kTimeout when the process outlived command.timeout (envd killed it) or
// the stream went silent past its deadline; kUnavailable when the sandbox
// is gone; kInternal for a malformed reply.
Result<CommandResult> run_command(runtime::Sandbox& sandbox, const std::string& access_token, const Command& command,
                                  const OutputFn& output);

// A built template's start command from its config JSON (startCmd,
// readyCmd, user, workdir, env: what the build service writes); nullopt
// when it has none or the config is not an object.
std::optional<runtime::StartCommand> start_command_of(const std::string& config_json,
                                                      std::chrono::milliseconds ready_timeout);

// Starts start.script in the background, then runs start.ready until it
// exits 0 (every 50 ms, then 250 ms), at most start.ready_timeout from
// the start: kTimeout naming the last result after that.
Status start_and_wait_ready(runtime::Sandbox& sandbox, const std::string& access_token,
                            const runtime::StartCommand& start);

}  // namespace sg::host
