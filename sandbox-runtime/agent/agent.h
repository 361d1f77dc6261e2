// sandgate-agent: PID 1 of every sandbox.
//
// The agent owns the sandbox end of the channel (docs/channel.md) and is the
// init of the sandbox's PID namespace: it reaps every orphan, answers control
// messages on stream 0, and on shutdown (message, SIGTERM, or channel EOF
// unless it waits for a new host: AgentConfig::reattach) kills every other
// process before exiting, so nothing outlives it. It is linked -static and kept free of Boost so it runs on any template rootfs.
//
// Thread model: the main thread runs the channel Mux (channel/mux.h): one
// epoll loop over the channel, the signalfd (SIGCHLD reaps through the
// Reaper, SIGTERM shuts down) and every data stream, each bridged to a TCP
// connection to 127.0.0.1:PORT inside the sandbox (envd on 49983 and user
// servers), and the model API proxy listener on 127.0.0.1:49982, whose
// connections become streams the agent opens {"service":"llm"}
// (service_forwarder.h). envd runs on threads of its own. The host is trusted more than
// sandbox processes but its bytes are still validated: a malformed frame
// closes the channel (framing is lost).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "sandbox-runtime/channel/frame.h"
#include "sandbox-runtime/channel/control_message.h"
#include "sandbox-runtime/channel/services.h"
#include "base/fd.h"
#include "base/status.h"

namespace sg::agent {

inline constexpr const char* kAgentName = "sandgate-agent";
using channel::kEnvdVersion;
// Output the host has not read yet. Replies are never dropped; past this
// bound the host is not reading and the channel is closed instead.
inline constexpr size_t kMaxOutputBuffer = 1 << 20;
// A host OPEN {"port":N} connects to 127.0.0.1:N inside; loopback answers at
// once, so this bound only matters for a listener whose backlog is full.
inline constexpr std::chrono::milliseconds kConnectTimeout{2000};
// envd listens on 127.0.0.1:kEnvdPort inside the sandbox (E2B's port).
inline constexpr uint16_t kEnvdPort = 49983;
// Environment variables addressed to the agent itself. They are removed from
// the environment that processes started by the agent inherit.
inline constexpr std::string_view kAgentEnvPrefix = "SANDGATE_";
// Streams the agent opens for sandbox connections to gateway services stop
// at this many open streams in all, keeping the rest of the Mux's 1024 for
// host opens (envd, user ports).
inline constexpr size_t kMaxServiceStreams = 768;
// Bounds of one runnable scan for "status" (count_runnable).
inline constexpr size_t kMaxScanProcesses = 4096;
inline constexpr size_t kMaxScanThreads = 64;

struct AgentConfig {
  int channel_fd = 3;
  bool bring_up_loopback = true;    // off only where there is no net namespace of our own
  // --vm: PID 1 of a microVM (sandbox-runtime/vmm). The channel is the
  // virtio console /dev/hvc0 (made raw here), kernel threads are not
  // counted as sandbox processes, and envd starts only when the host sends
  // "configure" (the sandbox id, token and environment), because a microVM
  // cloned from a template snapshot learns them only after it resumes.
  bool vm = false;
  // 127.0.0.1:PORT inside the sandbox forwarded to the host's model API
  // proxy ({"service":"llm"} streams); 0: no listener (--model-proxy-port).
  uint16_t model_proxy_port = channel::kModelProxyPort;
  // The same for the host's egress proxy ({"service":"egress"}), which
  // refuses the stream where the server has no egress (--egress-proxy-port).
  uint16_t egress_proxy_port = channel::kEgressProxyPort;
  std::string envd_access_token;    // SANDGATE_ENVD_TOKEN
  std::string sandbox_id;           // SANDGATE_SANDBOX_ID
  // SANDGATE_USERNS_FD: a user namespace to join once the steps that need
  // host root are done (process/userns.h); -1: none.
  int userns_fd = -1;
  // SANDGATE_REATTACH=1: the sandbox outlives its host. On channel EOF the
  // agent keeps every process and waits for a new host on
  // channel::kReattachFd instead of shutting down (docs/channel.md).
  bool reattach = false;
  // SANDGATE_NAMESERVER: the sandbox has a network of its own and this
  // (IPv4) DNS server, written to /etc/resolv.conf at start; "": untouched.
  std::string nameserver;
  // Environment for processes the agent starts: the agent's own
  // environment minus every SANDGATE_* variable.
  std::vector<std::string> child_env;
};

// Parses argv ("--channel-fd N", "--no-loopback", "--vm",
// "--model-proxy-port N") and the environment.
// envp's SANDGATE_* strings are overwritten in place with zeros afterwards,
// so /proc/1/environ no longer shows the token either.
Result<AgentConfig> parse_config(int argc, char** argv, char** envp);

// Number of processes in proc_dir (a procfs mount) other than self_pid.
// Zombies not yet reaped are counted: they are still processes. With
// skip_kernel_threads (a microVM's own kernel), kthreadd (pid 2) and its
// children are not counted.
size_t count_processes(const std::string& proc_dir, int self_pid, bool skip_kernel_threads = false);

// Processes in proc_dir other than self_pid (and, with skip_kernel_threads,
// other than kernel threads, as count_processes) that have at least one
// thread running or runnable (state R) or in uninterruptible sleep (D),
// read from /proc/PID/task/TID/stat. This is the wait coordinator's idle
// evidence: a sandbox is idle when none is. The scan is bounded: at most
// max_processes processes and max_threads threads of each; truncated says a
// bound was hit, so runnable may be short of the truth. Unreadable or
// malformed stat files (a process that just exited) count as not runnable.
struct RunnableCount {
  size_t runnable = 0;
  bool truncated = false;
};
RunnableCount count_runnable(const std::string& proc_dir, int self_pid, bool skip_kernel_threads = false,
                             size_t max_processes = kMaxScanProcesses, size_t max_threads = kMaxScanThreads);

// What "status" reports: count_processes and count_runnable of one moment.
struct ProcessCounts {
  size_t processes = 0;
  size_t runnable = 0;
  bool truncated = false;
};

// The "configure" control message of --vm mode, parsed.
struct VmConfigure {
  std::string sandbox_id;
  std::string envd_access_token;
  std::vector<std::string> env;  // "K=V"
  int64_t unix_time_ns = 0;      // host wall clock when sent; 0: leave the clock
  std::string entropy;           // raw bytes to mix into the guest's RNG
  // "network": {"address", "gateway" (dotted IPv4), "prefix"}: eth0's
  // address (replacing every other it has: a clone keeps its template's
  // or its parent's), the default route and /etc/resolv.conf (the
  // gateway is the DNS server). Absent: eth0 is left as it is.
  struct Network {
    uint32_t address = 0, gateway = 0;  // host byte order
    int prefix = 0;
  };
  std::optional<Network> network;
};
// Parses and validates one (bounded: 64 KiB of env, 512 bytes of entropy).
Result<VmConfigure> parse_vm_configure(std::string_view payload);

// What the agent does with one control message from the host.
struct ControlAction {
  std::string reply;      // JSON to send back on stream 0, empty for none
  bool shutdown = false;  // the host asked the agent to exit
  // A valid "configure" for the caller to apply (it answers "configured").
  // In vm mode it sets the clock and entropy and starts envd, and a second
  // one re-keys the running envd (Server::reconfigure); in process mode,
  // where envd runs from the start, it only re-keys it (a sandbox of the
  // warm pool handed to its creator).
  std::optional<VmConfigure> configure;
  std::string error;      // non-empty: malformed message; close the channel
};

// Pure handler of one stream-0 payload; count_procs answers "status"
// ({"type":"status","processes":N,"runnable":R}, plus "truncated":true when
// the runnable scan hit a bound). A malformed "configure" gets an error
// reply.
ControlAction handle_control(std::string_view payload, const std::function<ProcessCounts()>& count_procs,
                             bool vm = false);

// Non-blocking connect to 127.0.0.1:port, waiting at most timeout.
// ECONNREFUSED becomes kNotFound "connection refused on port N" (the RESET
// reason the host sees); a timeout kTimeout.
Result<UniqueFd> connect_loopback(uint16_t port, std::chrono::milliseconds timeout);

// The agent's answer to a host OPEN: {"port":N} -> connect_loopback(N);
// anything else is refused with an error whose message is the RESET reason.
Result<UniqueFd> open_stream_target(std::string_view open_payload, std::chrono::milliseconds timeout);

// The "ready" message sent once at start.
std::string ready_message(int pid);

// Runs the agent until shutdown. Returns the process exit code. Must be
// called in the sandbox's init process (it blocks SIGCHLD and SIGTERM and
// reaps every child).
int run(const AgentConfig& cfg);

}  // namespace sg::agent
