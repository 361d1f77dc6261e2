// HostChannel: the host end of one sandbox's channel once the agent is
// ready. It runs a channel::Mux (odd stream ids) on a thread it owns and
// offers what runtime::Sandbox exposes on top of it: open_port() (a
// socketpair end bridged to 127.0.0.1:PORT inside) and control() (one
// request, its reply). Streams the agent opens ({"service":"name"}: a
// sandbox process connecting to a gateway service) go to the ServiceOpener
// the backend passes in (runtime.h). Backend-neutral: the process and
// microVM backends both use it.
//
// Thread safety: every method may be called from any thread. stop() joins
// the Mux thread; callbacks on that thread take only this object's own
// locks (and whatever the ServiceOpener takes, which must not be held around
// stop()), so stop() may be called with a sandbox lock held. When the agent
// dies (channel EOF) or breaks the protocol, the Mux thread ends by itself;
// on a protocol error it also shuts the channel down so the agent, seeing
// EOF, kills the sandbox's processes. Afterwards open_port() and control()
// return kUnavailable.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "sandbox-runtime/channel/mux.h"
#include "sandbox-runtime/runtime.h"
#include "base/fd.h"
#include "base/status.h"

namespace sg::process {

// Reads exactly the agent's first frame from channel_fd before deadline_ns
// (monotonic) and checks it is the "ready" control message. exit_fd is a
// pidfd of the process whose death means no ready will come (the agent, or
// the VMM running it). Never reads past the frame, so nothing after it is
// taken from the socket the host Mux then owns. Both backends use it.
Status read_ready_frame(int channel_fd, int exit_fd, uint64_t deadline_ns);

class HostChannel {
 public:
  // channel_fd is borrowed and must stay open until stop() returns.
  // open_service serves agent OPENs, called on the Mux thread (it must not
  // block); a payload that is not {"service":"name"} is RESET with the parse
  // error, and so is every agent OPEN when open_service is empty ("no
  // gateway services on this host").
  HostChannel(std::string sandbox_id, int channel_fd, runtime::ServiceOpener open_service = {});
  ~HostChannel();  // stop()s
  HostChannel(const HostChannel&) = delete;
  HostChannel& operator=(const HostChannel&) = delete;

  Result<UniqueFd> open_port(uint16_t port);
  Result<std::string> control(std::string request, std::chrono::milliseconds timeout);
  // A cut of the channel for a microVM snapshot (channel::Mux::hold):
  // returns once the agent answered HELD; nothing is in flight either way
  // and neither side sends until release().
  Status hold(std::chrono::milliseconds timeout) { return mux_.hold(timeout); }
  // reset: the agent is to drop every stream and what it queued since HELD
  // (a clone or a resumed snapshot talking to this new host).
  void release(bool reset) { mux_.release(reset); }
  // After release(true) to a running agent (a restart of sandgate): what
  // the agent sent the previous host is dropped, what is sent here waits
  // until the agent has answered (channel::Mux::settle).
  Status settle(std::chrono::milliseconds wait) { return mux_.settle(wait); }
  // Ends the Mux (closing every stream fd) and joins its thread. Idempotent.
  void stop();
  // False once the Mux loop has ended.
  bool running();
  channel::Mux::Stats stats() const { return mux_.stats(); }

 private:
  struct Waiter {
    bool done = false;
    bool abandoned = false;
    std::optional<std::string> reply;
  };
  void on_control(std::string_view payload);
  Result<UniqueFd> on_agent_open(std::string_view payload);
  void loop();

  std::string id_;
  int channel_fd_;
  runtime::ServiceOpener open_service_;  // fixed at construction, used on the Mux thread
  channel::Mux mux_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Waiter>> waiters_;  // GUARDED_BY(mu_): in request order
  bool ended_ = false;                            // GUARDED_BY(mu_)
  std::string end_reason_;                        // GUARDED_BY(mu_)
  std::mutex join_mu_;                            // serialises stop()
  std::atomic<bool> stopping_{false};            // stop() was called: the end is ours
  std::thread thread_;
};

}  // namespace sg::process
