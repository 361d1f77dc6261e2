// ServiceForwarder: a loopback listener inside the sandbox whose every
// accepted connection becomes a channel stream the agent opens with
// {"service":"<name>"} (docs/channel.md, "Data streams"). This is how
// sandbox processes, which have a network namespace with loopback only,
// reach a gateway service: the model API proxy at 127.0.0.1:49982.
//
// Thread model: everything runs on the agent's Mux thread. Register the
// listener with mux.watch_fd(fwd.fd(), [&] { fwd.on_readable(); }) before
// Mux::run(); Mux::open_stream() is safe to call from a watch_fd handler
// (it only queues the stream for the loop's next round).
//
// Sandbox processes are hostile. A connection is closed at once (its client
// sees EOF or a reset) when the forwarder's stream budget is spent or the
// Mux cannot take it; running out of file descriptors never spins the loop
// (a spare fd is given up to accept and drop the connection); each call
// accepts a bounded number of connections, so a connect flood cannot starve
// the channel.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "sandbox-runtime/channel/mux.h"
#include "base/fd.h"
#include "base/status.h"

namespace sg::agent {

class ServiceForwarder {
 public:
  // Accepted connections per on_readable() call; the rest wait for the
  // loop's next round (the listener is level-triggered).
  static constexpr int kAcceptsPerRound = 64;
  static constexpr int kBacklog = 128;

  struct Stats {
    uint64_t forwarded = 0;  // streams handed to the Mux
    uint64_t refused = 0;    // connections closed at once (budget, quota, no fds)
  };

  // mux is borrowed and must outlive this object. max_open: the forwarder
  // opens a stream only while the Mux has fewer streams than this open in
  // all, so a sandbox's own connections cannot take every stream from the
  // host (envd is reached through host-opened streams).
  ServiceForwarder(channel::Mux& mux, std::string service, size_t max_open);

  // Listens on 127.0.0.1:port (0: a free port, for tests): non-blocking,
  // close-on-exec, SO_REUSEADDR, backlog kBacklog. Errors name the port
  // (EADDRINUSE where the agent shares a network namespace with another).
  Status listen(uint16_t port);
  int fd() const { return listener_.get(); }
  uint16_t port() const { return port_; }

  // Accepts pending connections and opens a stream for each. Mux thread.
  void on_readable();
  Stats stats() const { return stats_; }

 private:
  void refuse(UniqueFd conn, const std::string& why);
  // accept4 failed with EMFILE/ENFILE: resets one pending connection,
  // accepted into the spare fd's slot. False if none was pending.
  bool drop_one_without_fds();

  channel::Mux& mux_;
  std::string service_;
  std::string open_payload_;
  size_t max_open_;
  UniqueFd listener_;
  UniqueFd spare_;  // given up to accept a connection when the agent is out of fds
  uint16_t port_ = 0;
  bool warned_no_fds_ = false;
  Stats stats_;
};

}  // namespace sg::agent
