// The egress proxy (gateway/egress_proxy.h) in process: sandbox
// connections are socketpairs, destinations a real TCP server on
// 127.0.0.1 port 0 that answers with the request head it got.
#include "gateway/egress_proxy.h"

#include <doctest/doctest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>

using namespace sg;
using namespace std::chrono_literals;

namespace {

// Answers every connection with "200 OK" and, as the body, the request
// head it read; then closes.
struct Origin {
  UniqueFd listener;
  uint16_t port = 0;
  std::thread thread;
  std::atomic<bool> stop{false};
  Origin() {
    listener.reset(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(listener.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    REQUIRE(::listen(listener.get(), 16) == 0);
    socklen_t len = sizeof a;
    ::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&a), &len);
    port = ntohs(a.sin_port);
    thread = std::thread([this] {
      while (!stop) {
        struct pollfd p = {listener.get(), POLLIN, 0};
        if (::poll(&p, 1, 100) <= 0) continue;
        UniqueFd c(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
        if (!c) continue;
        std::string head;
        char buf[4096];
        while (head.find("\r\n\r\n") == std::string::npos) {
          ssize_t n = ::recv(c.get(), buf, sizeof buf, 0);
          if (n <= 0) break;
          head.append(buf, static_cast<size_t>(n));
        }
        std::string r = "HTTP/1.1 200 OK\r\nContent-Length: " + std::to_string(head.size()) + "\r\n\r\n" + head;
        (void)!::send(c.get(), r.data(), r.size(), MSG_NOSIGNAL);
      }
    });
  }
  ~Origin() {
    stop = true;
    thread.join();
  }
};

// What the proxy sends until `until` has arrived, or (empty `until`) until
// it closes; 10 s at most.
std::string read_until(int fd, const std::string& until) {
  std::string out;
  char buf[4096];
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while ((until.empty() || out.find(until) == std::string::npos) && std::chrono::steady_clock::now() < deadline) {
    struct pollfd p = {fd, POLLIN, 0};
    if (::poll(&p, 1, 200) <= 0) continue;
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}
std::string read_all(int fd) { return read_until(fd, ""); }

struct Client {
  UniqueFd mine;
  Client(gateway::EgressProxy& proxy, const std::string& sandbox) {
    int sv[2];
    REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    mine.reset(sv[0]);
    proxy.adopt(UniqueFd(sv[1]), sandbox);
  }
  void send(const std::string& s) { REQUIRE(::send(mine.get(), s.data(), s.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(s.size())); }
  std::string exchange(const std::string& request) {
    if (!request.empty()) send(request);
    return read_all(mine.get());
  }
};

// The sandboxes of these tests: one open to the internet, one closed, one
// that may reach allowed.test only.
struct Policies : network::EgressPolicies {
  Policies() {
    set("open", *network::parse_egress_policy({}, {}, true));
    set("closed", *network::parse_egress_policy({}, {}, false));
    set("named", *network::parse_egress_policy({"allowed.test"}, {}, false));
  }
};

// Test names: allowed.test and other.test are the loopback address.
gateway::EgressProxy::Resolver resolver() {
  return [](const std::string& host) -> Result<std::vector<std::array<uint8_t, 16>>> {
    if (host == "allowed.test" || host == "other.test") return std::vector<std::array<uint8_t, 16>>{*network::parse_ip("127.0.0.1")};
    if (auto a = network::parse_ip(host)) return std::vector<std::array<uint8_t, 16>>{*a};
    return Error(ErrorKind::kNotFound, "cannot resolve " + host);
  };
}

gateway::EgressConfig internal_open() {
  gateway::EgressConfig c;
  c.allow_internal = true;  // the origin is on loopback
  return c;
}

}  // namespace

TEST_CASE("egress proxy: an absolute-form request reaches the origin in origin form, one request, no Proxy-* headers") {
  Origin origin;
  Policies proxy_policies;
  gateway::EgressProxy proxy(internal_open(), proxy_policies, resolver());
  Client c(proxy, "open");
  std::string r = c.exchange("GET http://127.0.0.1:" + std::to_string(origin.port) +
                             "/simple?x=1 HTTP/1.1\r\nHost: 127.0.0.1\r\nProxy-Authorization: Basic c2VjcmV0\r\n"
                             "Proxy-Connection: keep-alive\r\nConnection: keep-alive\r\nUser-Agent: t\r\n\r\n");
  CHECK(r.rfind("HTTP/1.1 200 OK\r\n", 0) == 0);
  CHECK(r.find("GET /simple?x=1 HTTP/1.1\r\n") != std::string::npos);
  CHECK(r.find("User-Agent: t\r\n") != std::string::npos);
  CHECK(r.find("Connection: close\r\n") != std::string::npos);
  CHECK(r.find("Proxy-") == std::string::npos);
  CHECK(r.find("keep-alive") == std::string::npos);
  CHECK(proxy.stats().allowed == 1);
}

TEST_CASE("egress proxy: CONNECT opens a tunnel, by name where allowOut names it") {
  Origin origin;
  Policies proxy_policies;
  gateway::EgressProxy proxy(internal_open(), proxy_policies, resolver());
  Client c(proxy, "named");
  c.send("CONNECT allowed.test:" + std::to_string(origin.port) + " HTTP/1.1\r\nHost: allowed.test\r\n\r\n");
  std::string est = read_until(c.mine.get(), "\r\n\r\n");
  CHECK(est == "HTTP/1.1 200 Connection Established\r\n\r\n");
  std::string r = c.exchange("GET /through HTTP/1.1\r\nHost: allowed.test\r\n\r\n");
  CHECK(r.find("GET /through HTTP/1.1\r\n") != std::string::npos);
  // The same sandbox, another name for the same address: denied.
  Client d(proxy, "named");
  std::string denied = d.exchange("CONNECT other.test:" + std::to_string(origin.port) + " HTTP/1.1\r\n\r\n");
  CHECK(denied.rfind("HTTP/1.1 403 Forbidden\r\n", 0) == 0);
  CHECK(denied.find("no internet access") != std::string::npos);
}

TEST_CASE("egress proxy: refusals are 403s that say why; bad requests 400; unreachable 502") {
  Origin origin;
  std::string target = "127.0.0.1:" + std::to_string(origin.port);
  Policies strict_policies;
  gateway::EgressProxy strict(gateway::EgressConfig{}, strict_policies, resolver());  // internal networks closed
  std::string r = Client(strict, "open").exchange("CONNECT " + target + " HTTP/1.1\r\n\r\n");
  CHECK(r.rfind("HTTP/1.1 403", 0) == 0);
  CHECK(r.find("internal to the host's networks") != std::string::npos);
  r = Client(strict, "no-such-sandbox").exchange("CONNECT " + target + " HTTP/1.1\r\n\r\n");
  CHECK(r.find("this sandbox has no network egress") != std::string::npos);

  Policies proxy_policies;
  gateway::EgressProxy proxy(internal_open(), proxy_policies, resolver());
  r = Client(proxy, "closed").exchange("GET http://" + target + "/ HTTP/1.1\r\n\r\n");
  CHECK(r.rfind("HTTP/1.1 403", 0) == 0);
  for (const char* bad : {"GET /relative HTTP/1.1\r\n\r\n", "CONNECT nohostport HTTP/1.1\r\n\r\n",
                          "CONNECT a:99999 HTTP/1.1\r\n\r\n", "hello\r\n\r\n", "CONNECT [::1 HTTP/1.1\r\n\r\n"}) {
    r = Client(proxy, "open").exchange(bad);
    CHECK_MESSAGE(r.rfind("HTTP/1.1 400", 0) == 0, bad);
  }
  r = Client(proxy, "open").exchange("CONNECT nowhere.test:80 HTTP/1.1\r\n\r\n");
  CHECK(r.rfind("HTTP/1.1 502", 0) == 0);
  CHECK(r.find("cannot resolve nowhere.test") != std::string::npos);
  // A port nothing listens on.
  UniqueFd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  socklen_t len = sizeof a;
  ::getsockname(s.get(), reinterpret_cast<sockaddr*>(&a), &len);
  r = Client(proxy, "open").exchange("CONNECT 127.0.0.1:" + std::to_string(ntohs(a.sin_port)) + " HTTP/1.1\r\n\r\n");
  CHECK(r.rfind("HTTP/1.1 502", 0) == 0);
  auto st = proxy.stats();
  CHECK(st.denied == 1);
  CHECK(st.failed == 7);
}

TEST_CASE("egress proxy: a head that does not come in time is a 400; connections past the limit a 429") {
  gateway::EgressConfig cfg = internal_open();
  cfg.head_timeout = 300ms;
  cfg.max_per_sandbox = 1;
  Policies proxy_policies;
  gateway::EgressProxy proxy(cfg, proxy_policies, resolver());
  Client slow(proxy, "open");
  slow.send("CONNECT 127.0.0.1:1 HTTP/1.1\r\n");  // never finished
  // The slot is held while the head is awaited: a second connection of the
  // same sandbox is refused at once, another sandbox's is not.
  std::string second = Client(proxy, "open").exchange("");
  CHECK(second.rfind("HTTP/1.1 429", 0) == 0);
  std::string other = Client(proxy, "closed").exchange("CONNECT 127.0.0.1:1 HTTP/1.1\r\n\r\n");
  CHECK(other.rfind("HTTP/1.1 403", 0) == 0);
  std::string timed_out = read_all(slow.mine.get());
  CHECK(timed_out.rfind("HTTP/1.1 400", 0) == 0);
  CHECK(proxy.stats().refused == 1);
}

TEST_CASE("egress proxy: stopping closes open tunnels") {
  Origin origin;
  Client* held = nullptr;
  {
    Policies proxy_policies;
    gateway::EgressProxy proxy(internal_open(), proxy_policies, resolver());
    held = new Client(proxy, "open");
    held->send("CONNECT 127.0.0.1:" + std::to_string(origin.port) + " HTTP/1.1\r\n\r\n");
    CHECK(read_until(held->mine.get(), "\r\n\r\n") == "HTTP/1.1 200 Connection Established\r\n\r\n");
  }  // the tunnel is idle; the destructor must not wait for it
  CHECK(read_all(held->mine.get()).empty());
  delete held;
}

TEST_CASE("egress proxy: a policy update closes the open tunnels it refuses and keeps the rest") {
  Origin origin;
  network::EgressPolicies policies;
  policies.set("s", *network::parse_egress_policy({"allowed.test", "other.test"}, {}, false));
  policies.set("t", *network::parse_egress_policy({}, {}, true));
  gateway::EgressProxy proxy(internal_open(), policies, resolver());
  const std::string port = std::to_string(origin.port);
  Client kept(proxy, "s"), cut(proxy, "s"), other_sandbox(proxy, "t");
  for (auto [c, host] : {std::pair{&kept, "allowed.test"}, std::pair{&cut, "other.test"}, std::pair{&other_sandbox, "other.test"}}) {
    c->send(std::string("CONNECT ") + host + ":" + port + " HTTP/1.1\r\n\r\n");
    REQUIRE(read_until(c->mine.get(), "\r\n\r\n") == "HTTP/1.1 200 Connection Established\r\n\r\n");
  }
  // The table tells the proxy (its listener): no recheck call needed.
  policies.set("s", *network::parse_egress_policy({"allowed.test"}, {}, false));
  // The refused tunnel is closed: a request through it gets nothing back.
  // (The send may already fail: the proxy has closed its end.)
  auto cut_off = [](Client& c, const std::string& request) {
    (void)!::send(c.mine.get(), request.data(), request.size(), MSG_NOSIGNAL);
    return read_all(c.mine.get()).empty();
  };
  CHECK(cut_off(cut, "GET /after HTTP/1.1\r\nHost: other.test\r\n\r\n"));
  // The allowed one, and another sandbox's to the same place, go on.
  CHECK(kept.exchange("GET /kept HTTP/1.1\r\nHost: allowed.test\r\n\r\n").find("GET /kept HTTP/1.1\r\n") != std::string::npos);
  CHECK(other_sandbox.exchange("GET /t HTTP/1.1\r\nHost: other.test\r\n\r\n").find("GET /t HTTP/1.1\r\n") != std::string::npos);
  // A sandbox that is gone loses every tunnel.
  Client last(proxy, "t");
  last.send("CONNECT allowed.test:" + port + " HTTP/1.1\r\n\r\n");
  REQUIRE(read_until(last.mine.get(), "\r\n\r\n") == "HTTP/1.1 200 Connection Established\r\n\r\n");
  policies.erase("t");
  CHECK(cut_off(last, "GET /gone HTTP/1.1\r\nHost: allowed.test\r\n\r\n"));
}
