// Flow control end to end: `yes` streaming through envd, the channel, the
// gateway's relay and a client that reads slowly, for 30 s. The gateway's
// and the agent's memory must stay flat (the producer is slowed instead),
// and the client gets only what it reads.
#include <doctest/doctest.h>
#include <poll.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "tests/integration/state_of.h"
#include "tests/support/sandgate_process.h"
#include "base/fd.h"
#include "base/sys.h"

using namespace sg;
using namespace sg::test;
using json = nlohmann::json;

namespace {

// Resident set size of a process in KiB (VmRSS), 0 if gone.
long rss_kib(long pid) {
  auto st = sys::read_file("/proc/" + std::to_string(pid) + "/status");
  if (!st.ok()) return 0;
  size_t at = st->find("VmRSS:");
  return at == std::string::npos ? 0 : std::strtol(st->c_str() + at + 6, nullptr, 10);
}

UniqueFd dial(int port) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  // A small receive buffer, so the client's own kernel buffer does not hide
  // the back-pressure being measured.
  int rcv = 16 * 1024;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_RCVBUF, &rcv, sizeof rcv);
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) return UniqueFd();
  return fd;
}

}  // namespace

TEST_CASE("yes with a slow reader for 30 s: gateway and agent memory stay flat") {
  TempDir dir;
  SandgateProcess s(dir.sub("data"));
  REQUIRE(s.started());
  Response c = s.post("/v2/sandboxes", R"({"templateID":"base","timeout":600})");
  REQUIRE(c.status == 201);
  json sb = json::parse(c.body);
  std::string id = sb["sandboxID"], token = sb["envdAccessToken"];
  long agent_pid = static_cast<long>(state_of(s.data_dir(), id).init_pid);

  std::string msg = R"({"process":{"cmd":"/bin/bash","args":["-l","-c","yes"]},"stdin":false})";
  std::string env(5, '\0');
  env[1] = static_cast<char>((msg.size() >> 24) & 0xff);
  env[2] = static_cast<char>((msg.size() >> 16) & 0xff);
  env[3] = static_cast<char>((msg.size() >> 8) & 0xff);
  env[4] = static_cast<char>(msg.size() & 0xff);
  env += msg;
  std::string req = "POST /process.Process/Start HTTP/1.1\r\nHost: x\r\nConnect-Protocol-Version: 1\r\n"
                    "Content-Type: application/connect+json\r\nE2b-Sandbox-Id: " + id +
                    "\r\nE2b-Sandbox-Port: 49983\r\nX-Access-Token: " + token +
                    "\r\nContent-Length: " + std::to_string(env.size()) + "\r\n\r\n" + env;
  UniqueFd fd = dial(s.port());
  REQUIRE(fd.valid());
  REQUIRE(::send(fd.get(), req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size()));

  // Read the response head and the first bytes (the start event and data).
  char buf[4096];
  std::string got;
  uint64_t deadline = sys::monotonic_ns() + 20ull * 1000000000ull;
  while (got.size() < 64 * 1024 && sys::monotonic_ns() < deadline) {
    pollfd p{fd.get(), POLLIN, 0};
    if (::poll(&p, 1, 1000) <= 0) continue;
    ssize_t n = ::recv(fd.get(), buf, sizeof buf, 0);
    REQUIRE(n > 0);
    got.append(buf, static_cast<size_t>(n));
  }
  REQUIRE_MESSAGE(got.rfind("HTTP/1.1 200", 0) == 0, got.substr(0, 300));
  CHECK(got.find("\"start\"") != std::string::npos);

  long gw0 = rss_kib(s.pid()), ag0 = rss_kib(agent_pid);
  REQUIRE(gw0 > 0);
  REQUIRE(ag0 > 0);
  long gw_max = gw0, ag_max = ag0;
  size_t received = 0;
  // 30 s of a slow reader: 4 KiB every 50 ms (80 KiB/s), while `yes` could
  // produce gigabytes in that time.
  uint64_t start = sys::monotonic_ns(), next_sample = start;
  while (sys::monotonic_ns() - start < 30ull * 1000000000ull) {
    ssize_t n = ::recv(fd.get(), buf, sizeof buf, MSG_DONTWAIT);
    if (n > 0) received += static_cast<size_t>(n);
    if (sys::monotonic_ns() >= next_sample) {
      gw_max = std::max(gw_max, rss_kib(s.pid()));
      ag_max = std::max(ag_max, rss_kib(agent_pid));
      next_sample += 1000000000ull;
    }
    struct timespec ts = {0, 50 * 1000 * 1000};  // the slow reader's pace, not synchronisation
    nanosleep(&ts, nullptr);
  }
  MESSAGE("gateway RSS " << gw0 << " -> max " << gw_max << " KiB; agent RSS " << ag0 << " -> max " << ag_max
                         << " KiB; client read " << received / 1024 << " KiB in 30 s");
  CHECK(gw_max - gw0 < 8 * 1024);
  CHECK(ag_max - ag0 < 8 * 1024);
  CHECK(received <= 30 * 100 * 4096);  // no more than the reader asked for
  CHECK(received > 0);                  // and the stream kept moving
  fd.reset();
  CHECK(s.del("/sandboxes/" + id).status == 204);
}
