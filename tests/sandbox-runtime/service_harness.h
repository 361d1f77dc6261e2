// Test harness for gateway-service streams: a fake gateway (a ServiceOpener
// that hands the test the far end of every socketpair it returns) and the
// agent side (a channel Mux on its own thread with a ServiceForwarder
// listening on 127.0.0.1:0). Every wait is bounded: condition variables
// with a timeout, sockets with receive timeouts (mux_harness.h).
#pragma once

#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "sandbox-runtime/agent/service_forwarder.h"
#include "sandbox-runtime/channel/mux.h"
#include "tests/sandbox-runtime/mux_harness.h"
#include "sandbox-runtime/runtime.h"

namespace sg::servicetest {

// The gateway's side of runtime::ServiceOpener: serves "llm" only.
struct FakeGateway {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<UniqueFd> ends;                               // GUARDED_BY(mu): the gateway's ends, in open order
  std::vector<std::pair<std::string, std::string>> calls;  // GUARDED_BY(mu): (sandbox id, service)

  runtime::ServiceOpener opener() {
    return [this](const std::string& sandbox_id, const std::string& service) -> Result<UniqueFd> {
      std::lock_guard<std::mutex> l(mu);
      calls.emplace_back(sandbox_id, service);
      if (service != "llm") return not_found_error("no service " + service + " on this host");
      int sv[2];
      if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return internal_error("socketpair");
      muxtest::set_timeouts(sv[0]);
      ends.emplace_back(sv[0]);
      cv.notify_all();
      return UniqueFd(sv[1]);
    };
  }
  // The gateway's end of the next stream, or an invalid fd after timeout.
  UniqueFd next(std::chrono::milliseconds timeout = std::chrono::milliseconds(10000)) {
    std::unique_lock<std::mutex> l(mu);
    if (!cv.wait_for(l, timeout, [&] { return !ends.empty(); })) return UniqueFd();
    UniqueFd fd = std::move(ends.front());
    ends.pop_front();
    return fd;
  }
  std::vector<std::pair<std::string, std::string>> seen() {
    std::lock_guard<std::mutex> l(mu);
    return calls;
  }
};

// The sandbox side: an agent-side Mux (even ids) on agent_fd, running on its
// own thread, with a ServiceForwarder for "llm" on 127.0.0.1:0.
struct AgentSide {
  std::unique_ptr<channel::Mux> mux;
  std::unique_ptr<agent::ServiceForwarder> fwd;
  std::thread t;
  Status result;

  AgentSide(int agent_fd, size_t max_open) {
    channel::MuxConfig c;
    c.channel_fd = agent_fd;
    c.odd_ids = false;
    mux = std::make_unique<channel::Mux>(c, nullptr, nullptr);
    fwd = std::make_unique<agent::ServiceForwarder>(*mux, "llm", max_open);
    Status s = fwd->listen(0);
    REQUIRE_MESSAGE(s, (s ? "" : s.error().message()));
    mux->watch_fd(fwd->fd(), [this] { fwd->on_readable(); });
    t = std::thread([this] { result = mux->run(); });
  }
  ~AgentSide() { stop(); }
  void stop() {
    if (!t.joinable()) return;
    mux->stop();
    t.join();
  }
  // A sandbox process's connection to the forwarder.
  UniqueFd connect() const { return connect_loopback(fwd->port()); }

  // A connection to 127.0.0.1:port in *out; the connect's errno (0: connected).
  static int try_connect_loopback(uint16_t port, UniqueFd* out) {
    UniqueFd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    REQUIRE(s);
    struct sockaddr_in a {};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(port);
    int err = ::connect(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 ? 0 : errno;
    if (err == 0) muxtest::set_timeouts(s.get());
    *out = std::move(s);
    return err;
  }
  static UniqueFd connect_loopback(uint16_t port) {
    UniqueFd s;
    int err = try_connect_loopback(port, &s);
    REQUIRE_MESSAGE(err == 0, "connect to 127.0.0.1:" << port << ": " << std::string(std::strerror(err)));
    return s;
  }
};

}  // namespace sg::servicetest
