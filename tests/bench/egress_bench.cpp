// The egress proxy's own cost (gateway/egress_proxy.h), in process: what a
// CONNECT through it adds to opening a TCP connection, and a tunnel's
// throughput next to a direct connection's. The sandbox's side is a
// socketpair here; the channel's own cost (Mux, agent forwarder) is not in
// these numbers. Destinations: a TCP origin on 127.0.0.1 (the proxy runs
// with allow_internal). Writes JSON to argv[1].
//   egress_bench OUT.json [connections (500)] [MiB (256)]
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "tests/bench/bench_util.h"
#include "gateway/egress_proxy.h"

using namespace sg;
using Clock = std::chrono::steady_clock;

namespace {

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// Accepts connections; on each, sends `bytes` bytes (0: nothing) and closes.
struct Origin {
  int fd = -1;
  uint16_t port = 0;
  std::atomic<uint64_t> bytes{0};
  std::atomic<bool> stop{false};
  std::thread t;
  Origin() {
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd, 512) != 0) std::abort();
    socklen_t len = sizeof a;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    port = ntohs(a.sin_port);
    t = std::thread([this] {
      std::vector<char> buf(1 << 20, 'x');
      while (!stop) {
        struct pollfd p = {fd, POLLIN, 0};
        if (::poll(&p, 1, 100) <= 0) continue;
        int c = ::accept4(fd, nullptr, nullptr, SOCK_CLOEXEC);
        if (c < 0) continue;
        uint64_t left = bytes.load();
        while (left > 0) {
          ssize_t n = ::send(c, buf.data(), std::min<uint64_t>(left, buf.size()), MSG_NOSIGNAL);
          if (n <= 0) break;
          left -= static_cast<uint64_t>(n);
        }
        ::close(c);
      }
    });
  }
  ~Origin() {
    stop = true;
    t.join();
    ::close(fd);
  }
};

int connect_direct(uint16_t port) {
  int s = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  if (::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) std::abort();
  return s;
}

// A tunnel through the proxy: the sandbox's end, once "200" has arrived.
int connect_proxied(gateway::EgressProxy& proxy, uint16_t port) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) std::abort();
  proxy.adopt(UniqueFd(sv[1]), "bench");
  std::string req = "CONNECT 127.0.0.1:" + std::to_string(port) + " HTTP/1.1\r\n\r\n";
  if (::send(sv[0], req.data(), req.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(req.size())) std::abort();
  std::string got;
  char c;
  while (got.size() < 4 || got.compare(got.size() - 4, 4, "\r\n\r\n") != 0) {
    if (::recv(sv[0], &c, 1, 0) != 1) std::abort();
    got.push_back(c);
  }
  if (got.rfind("HTTP/1.1 200", 0) != 0) std::abort();
  return sv[0];
}

uint64_t drain(int fd) {
  std::vector<char> buf(1 << 20);
  uint64_t total = 0;
  for (;;) {
    ssize_t n = ::recv(fd, buf.data(), buf.size(), 0);
    if (n <= 0) return total;
    total += static_cast<uint64_t>(n);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: egress_bench OUT.json [connections] [MiB]\n");
    return 2;
  }
  int conns = argc > 2 ? std::atoi(argv[2]) : 500;
  uint64_t mib = argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 256;
  Origin origin;
  gateway::EgressConfig cfg;
  cfg.allow_internal = true;
  cfg.max_per_sandbox = 1024;
  network::EgressPolicies policies;
  policies.set("bench", network::parse_egress_policy({}, {}, true).value());
  gateway::EgressProxy proxy(cfg, policies);

  std::vector<double> direct_ms, proxied_ms;
  for (int i = 0; i < conns; ++i) {
    auto t0 = Clock::now();
    int d = connect_direct(origin.port);
    direct_ms.push_back(ms_since(t0));
    drain(d);
    ::close(d);
    t0 = Clock::now();
    int p = connect_proxied(proxy, origin.port);
    proxied_ms.push_back(ms_since(t0));
    drain(p);
    ::close(p);
  }
  origin.bytes = mib << 20;
  auto t0 = Clock::now();
  int d = connect_direct(origin.port);
  uint64_t got_d = drain(d);
  double direct_s = ms_since(t0) / 1000;
  ::close(d);
  t0 = Clock::now();
  int p = connect_proxied(proxy, origin.port);
  uint64_t got_p = drain(p);
  double proxied_s = ms_since(t0) / 1000;
  ::close(p);
  if (got_d != mib << 20 || got_p != mib << 20) {
    std::fprintf(stderr, "egress_bench: short transfer (%llu, %llu bytes)\n", static_cast<unsigned long long>(got_d),
                 static_cast<unsigned long long>(got_p));
    return 1;
  }
  auto pct = [](const std::vector<double>& v) {
    return nlohmann::json{{"p50", bench::percentile(v, 50)}, {"p90", bench::percentile(v, 90)}, {"p99", bench::percentile(v, 99)}};
  };
  nlohmann::json out = {
      {"machine", {{"cpu", bench::cpu_model()}, {"cores", std::thread::hardware_concurrency()}}},
      {"connections", conns},
      {"connect_ms", {{"direct", pct(direct_ms)}, {"through_proxy", pct(proxied_ms)}}},
      {"transfer_mib", mib},
      {"throughput_mib_s", {{"direct", static_cast<double>(mib) / direct_s}, {"through_proxy", static_cast<double>(mib) / proxied_s}}},
      {"note", "in process: the sandbox end is a socketpair; the channel (Mux, agent forwarder) is not included"}};
  std::ofstream(argv[1]) << out.dump(2) << "\n";
  std::printf("%s\n", out.dump(2).c_str());
  return 0;
}
