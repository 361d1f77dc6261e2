// The agent's ServiceForwarder: connections to its loopback listener become
// agent-opened streams; past its stream budget, or with no file descriptor
// to accept into, a connection is reset at once and the loop never spins;
// a port in use fails listen() with a message naming it.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>

#include <cerrno>
#include <cstring>

#include "sandbox-runtime/host/host_channel.h"
#include "tests/sandbox-runtime/service_harness.h"

using namespace sg;
using namespace sg::muxtest;
using namespace sg::servicetest;

namespace {

// One byte there and back through a forwarded stream; returns the gateway end.
UniqueFd round_trip(FakeGateway& gw, int client, char c) {
  REQUIRE(write_all(client, std::string(1, c)));
  UniqueFd g = gw.next();
  REQUIRE_MESSAGE(g, "the opener was not called");
  std::string got;
  REQUIRE(read_exact(g.get(), got, 1));
  CHECK(got == std::string(1, c));
  REQUIRE(write_all(g.get(), std::string(1, c)));
  std::string back;
  REQUIRE(read_exact(client, back, 1));
  CHECK(back == std::string(1, c));
  return g;
}

// recv() on a connection the forwarder refused: a reset, not a timeout.
void expect_reset(int fd) {
  char b;
  ssize_t n = ::recv(fd, &b, 1, 0);
  int err = errno;
  CHECK(n < 0);
  CHECK_MESSAGE(err == ECONNRESET, "recv: " << std::strerror(err));
}

// A connection the forwarder refuses at once: the reset shows at the first
// recv(), or already at connect() when it comes before connect() returns.
void expect_refused(uint16_t port) {
  UniqueFd s;
  int err = AgentSide::try_connect_loopback(port, &s);
  if (err != 0) {
    CHECK_MESSAGE(err == ECONNRESET, "connect: " << std::strerror(err));
    return;
  }
  expect_reset(s.get());
}

}  // namespace

TEST_CASE("service forwarder: connections past the stream budget are reset; a freed slot is reused") {
  FakeGateway gw;
  auto [host_end, agent_end] = socket_pair();
  process::HostChannel hc("sbtest04", host_end.get(), gw.opener());
  AgentSide agent(agent_end.get(), /*max_open=*/2);
  UniqueFd c1 = agent.connect();
  UniqueFd g1 = round_trip(gw, c1.get(), 'a');
  UniqueFd c2 = agent.connect();
  UniqueFd g2 = round_trip(gw, c2.get(), 'b');
  expect_refused(agent.fwd->port());
  CHECK(agent.fwd->stats().forwarded == 2);
  CHECK(agent.fwd->stats().refused == 1);

  // Close stream 1 both ways. The client's EOF comes from the agent's
  // shutdown of its end, done as the stream is removed, so the next accept
  // finds the slot free.
  REQUIRE(::shutdown(c1.get(), SHUT_WR) == 0);
  std::string rest;
  REQUIRE(read_to_eof(g1.get(), rest));
  g1.reset();
  REQUIRE(read_to_eof(c1.get(), rest));
  CHECK(rest.empty());
  UniqueFd c4 = agent.connect();
  UniqueFd g4 = round_trip(gw, c4.get(), 'd');
  CHECK(agent.fwd->stats().forwarded == 3);
  CHECK(agent.fwd->stats().refused == 1);
  CHECK(gw.seen().size() == 3);
  agent.stop();
  CHECK(agent.result.ok());
  hc.stop();
}

TEST_CASE("service forwarder: out of file descriptors, pending connections are reset and the loop goes on") {
  // The Mux is not running: on_readable() is called here, on the test's
  // thread, and open_stream() only queues.
  auto [chan_a, chan_b] = socket_pair();
  channel::MuxConfig mc;
  mc.channel_fd = chan_b.get();
  mc.odd_ids = false;
  channel::Mux mux(mc, nullptr, nullptr);
  agent::ServiceForwarder fwd(mux, "llm", 768);
  REQUIRE(fwd.listen(0));
  UniqueFd c1 = AgentSide::connect_loopback(fwd.port());
  UniqueFd c2 = AgentSide::connect_loopback(fwd.port());
  struct pollfd p = {fwd.fd(), POLLIN, 0};
  REQUIRE(::poll(&p, 1, 10000) == 1);

  // Fill every free descriptor below the highest open one, then make that
  // the limit: the next descriptor the process needs is EMFILE.
  int highest = 0;
  for (int fd = 0; fd < 65536; ++fd)
    if (::fcntl(fd, F_GETFD) != -1) highest = fd;
  std::vector<UniqueFd> fillers;
  for (int fd = 0; fd < highest; ++fd)
    if (::fcntl(fd, F_GETFD) == -1) fillers.emplace_back(::fcntl(chan_a.get(), F_DUPFD_CLOEXEC, fd));
  struct rlimit old;
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &old) == 0);
  struct rlimit low = old;
  low.rlim_cur = static_cast<rlim_t>(highest + 1);
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &low) == 0);
  int probe = ::dup(0);
  int probe_err = errno;
  // Both pending connections are dropped in one call: the spare fd, given
  // up for the first, was taken back in time for the second.
  fwd.on_readable();
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &old) == 0);
  if (probe >= 0) ::close(probe);
  CHECK_MESSAGE(probe < 0, "the descriptor table was not full");
  CHECK(probe_err == EMFILE);
  fillers.clear();
  CHECK(fwd.stats().refused == 2);
  CHECK(fwd.stats().forwarded == 0);
  expect_reset(c1.get());
  expect_reset(c2.get());

  // With descriptors again, a connection is forwarded (queued on the Mux).
  UniqueFd c3 = AgentSide::connect_loopback(fwd.port());
  REQUIRE(::poll(&p, 1, 10000) == 1);
  fwd.on_readable();
  CHECK(fwd.stats().forwarded == 1);
  // Nothing else was pending: accept4's EAGAIN ended the call.
  CHECK(fwd.stats().refused == 2);
}

TEST_CASE("service forwarder: a port in use fails listen() naming the port") {
  UniqueFd taken(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  REQUIRE(taken);
  struct sockaddr_in a {};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(taken.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::listen(taken.get(), 4) == 0);
  socklen_t len = sizeof a;
  REQUIRE(::getsockname(taken.get(), reinterpret_cast<sockaddr*>(&a), &len) == 0);
  uint16_t port = ntohs(a.sin_port);

  auto [x, y] = socket_pair();
  channel::MuxConfig mc;
  mc.channel_fd = y.get();
  mc.odd_ids = false;
  channel::Mux mux(mc, nullptr, nullptr);
  agent::ServiceForwarder fwd(mux, "llm", 768);
  Status s = fwd.listen(port);
  REQUIRE_FALSE(s);
  CAPTURE(s.error().message());
  CHECK(s.error().message().find("127.0.0.1:" + std::to_string(port)) != std::string::npos);
  CHECK(s.error().message().find("Address already in use") != std::string::npos);
  CHECK(fwd.fd() < 0);
}
