// Test harness for the Mux: two Muxes joined by a socketpair, each on its
// own thread (a "host" with odd ids and an "agent" with even ids), TCP echo
// servers on 127.0.0.1:0, and blocking socket helpers with receive timeouts
// so a broken Mux fails a test instead of hanging it.
#pragma once

#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "sandbox-runtime/channel/frame.h"
#include "sandbox-runtime/channel/mux.h"
#include "base/status.h"

namespace sg::muxtest {

inline void set_timeouts(int fd, int seconds = 20) {
  struct timeval tv = {seconds, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

inline std::pair<UniqueFd, UniqueFd> socket_pair() {
  int sv[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
  set_timeouts(sv[0]);
  set_timeouts(sv[1]);
  return {UniqueFd(sv[0]), UniqueFd(sv[1])};
}

inline bool write_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}
inline bool write_all(int fd, const std::string& s) { return write_all(fd, s.data(), s.size()); }

// Reads until EOF; false on error or timeout.
inline bool read_to_eof(int fd, std::string& out, size_t limit = 1u << 30) {
  char buf[65536];
  for (;;) {
    ssize_t k = ::recv(fd, buf, sizeof buf, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) return false;
    if (k == 0) return true;
    out.append(buf, static_cast<size_t>(k));
    if (out.size() > limit) return false;
  }
}

inline bool read_exact(int fd, std::string& out, size_t n) {
  char buf[65536];
  while (out.size() < n) {
    ssize_t k = ::recv(fd, buf, std::min(sizeof buf, n - out.size()), 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    out.append(buf, static_cast<size_t>(k));
  }
  return true;
}

inline uint64_t fnv1a(std::string_view s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

inline std::string random_bytes(size_t n, uint32_t seed) {
  std::string s(n, '\0');
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    s[i] = static_cast<char>(x);
  }
  return s;
}

// A TCP listener on 127.0.0.1:0 whose connections run serve(fd) on their
// own thread. The destructor stops accepting and joins everything.
class Server {
 public:
  explicit Server(std::function<void(int)> serve) : serve_(std::move(serve)) {
    listener_.reset(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    REQUIRE(listener_);
    struct sockaddr_in a {};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(listener_.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    REQUIRE(::listen(listener_.get(), 256) == 0);
    socklen_t len = sizeof a;
    REQUIRE(::getsockname(listener_.get(), reinterpret_cast<sockaddr*>(&a), &len) == 0);
    port_ = ntohs(a.sin_port);
    acceptor_ = std::thread([this] {
      for (;;) {
        int c = ::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC);
        if (c < 0) {
          if (errno == EINTR || errno == ECONNABORTED) continue;
          return;
        }
        set_timeouts(c);
        std::lock_guard<std::mutex> l(mu_);
        conns_.emplace_back([this, c] {
          serve_(c);
          ::close(c);
        });
      }
    });
  }
  ~Server() {
    ::shutdown(listener_.get(), SHUT_RDWR);
    acceptor_.join();
    std::lock_guard<std::mutex> l(mu_);
    for (auto& t : conns_) t.join();
  }
  uint16_t port() const { return port_; }

 private:
  std::function<void(int)> serve_;
  UniqueFd listener_;
  uint16_t port_ = 0;
  std::thread acceptor_;
  std::mutex mu_;
  std::vector<std::thread> conns_;
};

// Echoes until EOF, then half-closes.
inline void echo(int fd) {
  char buf[65536];
  for (;;) {
    ssize_t k = ::recv(fd, buf, sizeof buf, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) break;
    if (!write_all(fd, buf, static_cast<size_t>(k))) return;
  }
  ::shutdown(fd, SHUT_WR);
}

inline std::string port_payload(uint16_t port) { return "{\"port\":" + std::to_string(port) + "}"; }

// The agent side's on_open: {"port":N} -> blocking connect to 127.0.0.1:N.
inline Result<UniqueFd> connect_port(std::string_view payload) {
  size_t p = payload.find(':');
  if (p == std::string_view::npos) return invalid_error("bad OPEN payload");
  int port = std::atoi(std::string(payload.substr(p + 1)).c_str());
  UniqueFd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  struct sockaddr_in a {};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  if (::connect(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0)
    return not_found_error("connection refused on port " + std::to_string(port));
  return s;
}

// Host Mux (odd ids) and agent Mux (even ids) on one socketpair.
struct MuxPair {
  std::pair<UniqueFd, UniqueFd> chan = socket_pair();
  std::unique_ptr<channel::Mux> host, agent;
  std::thread th, ta;
  Status host_result, agent_result;
  bool joined = false;

  explicit MuxPair(channel::Mux::OpenHandler agent_open, channel::Mux::ControlHandler agent_ctl = {},
                   channel::Mux::ControlHandler host_ctl = {}, size_t max_streams = 1024) {
    channel::MuxConfig hc;
    hc.channel_fd = chan.first.get();
    hc.odd_ids = true;
    hc.max_streams = max_streams;
    channel::MuxConfig ac = hc;
    ac.channel_fd = chan.second.get();
    ac.odd_ids = false;
    host = std::make_unique<channel::Mux>(hc, nullptr, std::move(host_ctl));
    agent = std::make_unique<channel::Mux>(ac, std::move(agent_open), std::move(agent_ctl));
    th = std::thread([this] { host_result = host->run(); });
    ta = std::thread([this] { agent_result = agent->run(); });
  }
  void join() {
    if (joined) return;
    host->stop();
    agent->stop();
    th.join();
    ta.join();
    joined = true;
    CHECK_MESSAGE(host_result.ok(), (host_result.ok() ? "" : host_result.error().message()));
    CHECK_MESSAGE(agent_result.ok(), (agent_result.ok() ? "" : agent_result.error().message()));
  }
  ~MuxPair() { join(); }

  // Opens a stream from the host side; returns the test's end.
  UniqueFd open(const std::string& payload) {
    auto [mine, theirs] = socket_pair();
    auto id = host->open_stream(std::move(theirs), payload);
    REQUIRE_MESSAGE(id, (id ? "" : id.error().message()));
    return std::move(mine);
  }
};

}  // namespace sg::muxtest
