// HostNetwork (sandbox-runtime/network/host_network.h) on the real kernel:
// network namespaces stand in for a sandbox, a second sandbox, "the
// internet" (203.0.113.0/24, a TCP and a UDP server) and a private network
// (192.168.213.0/24); the host routes between them and the sandboxes' links
// through the server's nftables table. Needs root (CAP_NET_ADMIN) and
// nf_tables: a skip otherwise, in an entry of its own.
#include "sandbox-runtime/network/host_network.h"

#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <fcntl.h>
#include <linux/rtnetlink.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "base/fd.h"
#include "sandbox-runtime/network/dns_message.h"
#include "sandbox-runtime/network/rtnl.h"
#include "tests/support/skip.h"

using namespace sg;
using namespace sg::network;

namespace {

uint32_t v4(const char* s) { return ntohl(::inet_addr(s)); }

// A new network namespace, held open by its nsfs descriptor.
UniqueFd new_netns() {
  UniqueFd fd;
  std::thread t([&] {
    if (::unshare(CLONE_NEWNET) == 0) fd.reset(::open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC));
  });
  t.join();
  REQUIRE_MESSAGE(fd, "a network namespace: " << std::strerror(errno));
  return fd;
}

// Runs f on a thread inside netns (sockets it makes stay in that namespace).
template <typename F>
auto in_ns(int netns, F f) {
  decltype(f()) out{};
  std::thread t([&] {
    if (::setns(netns, CLONE_NEWNET) != 0) return;
    out = f();
  });
  t.join();
  return out;
}

sockaddr_in sa(uint32_t addr, uint16_t port) {
  sockaddr_in s{};
  s.sin_family = AF_INET;
  s.sin_addr.s_addr = htonl(addr);
  s.sin_port = htons(port);
  return s;
}

// A stand-in network behind the host: a veth from the host (host_addr/24)
// to a namespace (ns_addr/24, default route back), lo up there.
struct Net {
  UniqueFd ns;
  std::string link;
  Net(const std::string& link_name, uint32_t host_addr, uint32_t ns_addr) : ns(new_netns()), link(link_name) {
    Result<Rtnl> h = Rtnl::open();
    REQUIRE(h);
    REQUIRE(h->create_veth(link, "eth0", ns.get()));
    Result<int> hi = h->link_index(link);
    REQUIRE(hi);
    REQUIRE(h->add_address4(*hi, htonl(host_addr), 24));
    REQUIRE(h->set_up(*hi));
    Result<Rtnl> in = Rtnl::open_in(ns.get());
    REQUIRE(in);
    Result<int> lo = in->link_index("lo");
    REQUIRE(lo);
    REQUIRE(in->set_up(*lo));
    Result<int> e = in->link_index("eth0");
    REQUIRE(e);
    REQUIRE(in->add_address4(*e, htonl(ns_addr), 24));
    REQUIRE(in->set_up(*e));
    REQUIRE(in->add_default_route4(*e, htonl(host_addr)));
  }
  ~Net() {
    if (Result<Rtnl> h = Rtnl::open()) (void)h->delete_link(link);
  }
};

// A TCP server in a namespace: each connection gets "hello\n", then an
// endless stream of bytes until it fails (a download to cut). And a UDP
// echo on the same port.
class Servers {
 public:
  Servers(int netns, uint32_t addr, uint16_t port) {
    tcp_ = in_ns(netns, [&] { return UniqueFd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)); });
    udp_ = in_ns(netns, [&] { return UniqueFd(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0)); });
    REQUIRE(tcp_);
    REQUIRE(udp_);
    int one = 1;
    ::setsockopt(tcp_.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in s = sa(addr, port);
    REQUIRE(::bind(tcp_.get(), reinterpret_cast<sockaddr*>(&s), sizeof s) == 0);
    REQUIRE(::listen(tcp_.get(), 64) == 0);
    REQUIRE(::bind(udp_.get(), reinterpret_cast<sockaddr*>(&s), sizeof s) == 0);
    threads_.emplace_back([this] { accept_loop(); });
    threads_.emplace_back([this] { echo_loop(); });
  }
  ~Servers() {
    stop_ = true;
    ::shutdown(tcp_.get(), SHUT_RDWR);
    ::shutdown(udp_.get(), SHUT_RDWR);
    {
      std::lock_guard<std::mutex> l(mu_);
      for (int c : conns_) ::shutdown(c, SHUT_RDWR);
    }
    for (auto& t : threads_) t.join();
    for (int c : conns_) ::close(c);
  }

 public:
  std::vector<std::string> received() {
    std::lock_guard<std::mutex> l(mu_);
    return received_;
  }

 private:
  void accept_loop() {
    while (!stop_) {
      int c = ::accept4(tcp_.get(), nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) return;
      std::lock_guard<std::mutex> l(mu_);
      conns_.push_back(c);
      threads_.emplace_back([this, c] {
        const char hello[] = "hello\n";
        if (::send(c, hello, 6, MSG_NOSIGNAL) != 6) return;
        std::vector<char> chunk(16384, 'x');
        while (!stop_ && ::send(c, chunk.data(), chunk.size(), MSG_NOSIGNAL) > 0) {
        }
      });
    }
  }
  void echo_loop() {
    char buf[512];
    while (!stop_) {
      sockaddr_in from{};
      socklen_t fl = sizeof from;
      ssize_t n = ::recvfrom(udp_.get(), buf, sizeof buf, 0, reinterpret_cast<sockaddr*>(&from), &fl);
      if (n <= 0) return;
      {
        std::lock_guard<std::mutex> l(mu_);
        received_.emplace_back(buf, static_cast<size_t>(n));
      }
      ::sendto(udp_.get(), buf, static_cast<size_t>(n), 0, reinterpret_cast<sockaddr*>(&from), fl);
    }
  }
  UniqueFd tcp_, udp_;
  std::vector<std::string> received_;  // UDP payloads, in order
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::vector<int> conns_;
  std::vector<std::thread> threads_;
};

enum class Got { kHello, kRefused, kTimeout, kOther };

const char* name(Got g) {
  switch (g) {
    case Got::kHello: return "hello";
    case Got::kRefused: return "refused";
    case Got::kTimeout: return "timeout";
    default: return "other";
  }
}

// A TCP connection from inside netns: the socket, connected, or empty
// with *got saying why not.
UniqueFd connect_from(int netns, uint32_t addr, uint16_t port, Got* got, int timeout_ms = 3000) {
  UniqueFd s = in_ns(netns, [] { return UniqueFd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)); });
  REQUIRE(s);
  sockaddr_in d = sa(addr, port);
  if (::connect(s.get(), reinterpret_cast<sockaddr*>(&d), sizeof d) != 0 && errno != EINPROGRESS) {
    *got = errno == ECONNREFUSED ? Got::kRefused : Got::kOther;
    return UniqueFd();
  }
  pollfd p = {s.get(), POLLOUT, 0};
  if (::poll(&p, 1, timeout_ms) != 1) {
    *got = Got::kTimeout;
    return UniqueFd();
  }
  int err = 0;
  socklen_t el = sizeof err;
  ::getsockopt(s.get(), SOL_SOCKET, SO_ERROR, &err, &el);
  if (err != 0) {
    *got = (err == ECONNREFUSED || err == ECONNRESET) ? Got::kRefused : Got::kOther;
    return UniqueFd();
  }
  return s;
}

// Connects and reads the server's "hello".
Got hello(int netns, uint32_t addr, uint16_t port) {
  Got got = Got::kOther;
  UniqueFd s = connect_from(netns, addr, port, &got);
  if (!s) return got;
  char buf[6];
  size_t have = 0;
  while (have < sizeof buf) {
    pollfd p = {s.get(), POLLIN, 0};
    if (::poll(&p, 1, 3000) != 1) return Got::kTimeout;
    ssize_t n = ::recv(s.get(), buf + have, sizeof buf - have, 0);
    if (n <= 0) return n < 0 && errno == ECONNRESET ? Got::kRefused : Got::kOther;
    have += static_cast<size_t>(n);
  }
  return std::memcmp(buf, "hello\n", 6) == 0 ? Got::kHello : Got::kOther;
}

// One UDP datagram from inside netns and its echo, within a second.
bool udp_echo(int netns, uint32_t addr, uint16_t port, const char* payload = "ping") {
  UniqueFd s = in_ns(netns, [] { return UniqueFd(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0)); });
  REQUIRE(s);
  sockaddr_in d = sa(addr, port);
  if (::connect(s.get(), reinterpret_cast<sockaddr*>(&d), sizeof d) != 0) return false;
  if (::send(s.get(), payload, 4, 0) != 4) return false;
  pollfd p = {s.get(), POLLIN, 0};
  if (::poll(&p, 1, 1000) != 1) return false;
  char buf[8];
  return ::recv(s.get(), buf, sizeof buf, 0) == 4 && std::memcmp(buf, payload, 4) == 0;
}

// One UDP datagram from inside netns from `from` (an address the test
// added to the sandbox's link: not the one the host gave it).
void udp_spoof(int netns, uint32_t from, uint32_t addr, uint16_t port, const char* payload) {
  UniqueFd s = in_ns(netns, [] { return UniqueFd(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0)); });
  REQUIRE(s);
  sockaddr_in b = sa(from, 0), d = sa(addr, port);
  REQUIRE(::bind(s.get(), reinterpret_cast<sockaddr*>(&b), sizeof b) == 0);
  REQUIRE(::sendto(s.get(), payload, std::strlen(payload), 0, reinterpret_cast<sockaddr*>(&d), sizeof d) > 0);
}

// A DNS server in a namespace (UDP port 53): A records from a table, NXDOMAIN otherwise.
// DNS over TCP: a message with its two-byte length in front; and each
// whole message at the front of in handed to f and taken off.
std::string frame(std::string_view m) {
  return std::string{static_cast<char>(m.size() >> 8), static_cast<char>(m.size() & 0xff)} + std::string(m);
}
template <typename F>
void take_frames(std::string& in, F f) {
  while (in.size() >= 2) {
    size_t len = (static_cast<size_t>(static_cast<unsigned char>(in[0])) << 8) | static_cast<unsigned char>(in[1]);
    if (in.size() < 2 + len) return;
    f(std::string_view(in).substr(2, len));
    in.erase(0, 2 + len);
  }
}

class DnsServer {
 public:
  // records: one A record each; many: several, an answer over 512 bytes
  // (truncated over UDP, whole over TCP).
  DnsServer(int netns, uint32_t addr, std::map<std::string, uint32_t> records,
            std::map<std::string, std::vector<uint32_t>> many = {})
      : many_(std::move(many)) {
    for (auto& [n, a] : records) many_[n] = {a};
    sock_ = in_ns(netns, [] { return UniqueFd(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0)); });
    tcp_ = in_ns(netns, [] { return UniqueFd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)); });
    REQUIRE(sock_);
    REQUIRE(tcp_);
    sockaddr_in s = sa(addr, 53);
    REQUIRE(::bind(sock_.get(), reinterpret_cast<sockaddr*>(&s), sizeof s) == 0);
    int one = 1;
    ::setsockopt(tcp_.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    REQUIRE(::bind(tcp_.get(), reinterpret_cast<sockaddr*>(&s), sizeof s) == 0);
    REQUIRE(::listen(tcp_.get(), 16) == 0);
    thread_ = std::thread([this] { loop(); });
    tcp_thread_ = std::thread([this] { tcp_loop(); });
  }
  ~DnsServer() {
    ::shutdown(sock_.get(), SHUT_RDWR);
    ::shutdown(tcp_.get(), SHUT_RDWR);
    thread_.join();
    tcp_thread_.join();
  }

 private:
  // The answer to query q (empty: not a query), whole or cut to a
  // header and question with TC set when it would pass max bytes.
  std::string answer(std::string_view q, size_t max) {
    Result<DnsQuestion> dq = parse_dns_query(q);
    if (!dq) return "";
    auto it = many_.find(dq->name);
    std::string r = dns_error_reply(q, it == many_.end() ? 3 : 0);
    if (it == many_.end()) return r;
    size_t n = it->second.size();
    if (r.size() + n * 16 > max) {
      r[2] = static_cast<char>(r[2] | 0x02);  // TC
      return r;
    }
    r[6] = static_cast<char>(n >> 8);
    r[7] = static_cast<char>(n & 0xff);
    for (uint32_t a : it->second) {
      // A pointer to the question's name, A IN, TTL 60.
      const unsigned char rr[] = {0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4};
      r.append(reinterpret_cast<const char*>(rr), sizeof rr);
      uint32_t be = htonl(a);
      r.append(reinterpret_cast<const char*>(&be), 4);
    }
    return r;
  }
  void loop() {
    char buf[512];
    for (;;) {
      sockaddr_in from{};
      socklen_t fl = sizeof from;
      ssize_t n = ::recvfrom(sock_.get(), buf, sizeof buf, 0, reinterpret_cast<sockaddr*>(&from), &fl);
      if (n <= 0) return;
      std::string r = answer(std::string_view(buf, static_cast<size_t>(n)), 512);
      if (!r.empty()) ::sendto(sock_.get(), r.data(), r.size(), 0, reinterpret_cast<sockaddr*>(&from), fl);
    }
  }
  // One connection at a time, queries answered in order until it closes.
  void tcp_loop() {
    for (;;) {
      UniqueFd c(::accept4(tcp_.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (!c) return;
      std::string in;
      char buf[4096];
      for (;;) {
        pollfd p = {c.get(), POLLIN, 0};
        if (::poll(&p, 1, 5000) != 1) break;
        ssize_t n = ::recv(c.get(), buf, sizeof buf, 0);
        if (n <= 0) break;
        in.append(buf, static_cast<size_t>(n));
        take_frames(in, [&](std::string_view q) {
          std::string f = frame(answer(q, 65535));
          (void)::send(c.get(), f.data(), f.size(), MSG_NOSIGNAL);
        });
      }
    }
  }
  std::map<std::string, std::vector<uint32_t>> many_;
  UniqueFd sock_, tcp_;
  std::thread thread_, tcp_thread_;
};

// An A query for name (id 0x1234, RD).
std::string a_query(const std::string& name) {
  std::string q("\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00", 12);
  size_t start = 0;
  while (start <= name.size()) {
    size_t dot = name.find('.', start);
    if (dot == std::string::npos) dot = name.size();
    q.push_back(static_cast<char>(dot - start));
    q += name.substr(start, dot - start);
    start = dot + 1;
  }
  q += std::string("\0\0\x01\0\x01", 5);
  return q;
}

struct Resolved {
  int rcode = -1;  // -1: no answer within 3 s
  std::vector<uint32_t> a;
  bool truncated = false;
};
Resolved parse_reply(std::string_view r) {
  Result<DnsAnswers> a = parse_dns_answers(r);
  REQUIRE(a);
  CHECK(a->id == 0x1234);
  return {a->rcode, a->a, (static_cast<unsigned char>(r[2]) & 0x02) != 0};
}

// An A query for name from inside netns to server:53 over UDP.
Resolved resolve_udp(int netns, uint32_t server, const std::string& name) {
  UniqueFd s = in_ns(netns, [] { return UniqueFd(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0)); });
  REQUIRE(s);
  std::string q = a_query(name);
  sockaddr_in d = sa(server, 53);
  REQUIRE(::sendto(s.get(), q.data(), q.size(), 0, reinterpret_cast<sockaddr*>(&d), sizeof d) > 0);
  pollfd p = {s.get(), POLLIN, 0};
  if (::poll(&p, 1, 3000) != 1) return {};
  char buf[1024];
  ssize_t n = ::recv(s.get(), buf, sizeof buf, 0);
  if (n <= 0) return {};
  return parse_reply(std::string_view(buf, static_cast<size_t>(n)));
}

// Frames (two-byte length + bytes) from inside netns to server:53 over one
// TCP connection, all sent at once; the replies in order (fewer when the
// connection ends or 3 s pass without one).
std::vector<Resolved> resolve_tcp(int netns, uint32_t server, const std::vector<std::string>& frames) {
  Got got = Got::kOther;
  UniqueFd s = connect_from(netns, server, 53, &got);
  REQUIRE_MESSAGE(s, "TCP to the DNS server: " << name(got));
  std::string out;
  for (const std::string& f : frames) out += f;
  REQUIRE(::send(s.get(), out.data(), out.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(out.size()));
  std::vector<Resolved> got_back;
  std::string in;
  char buf[8192];
  while (got_back.size() < frames.size()) {
    pollfd p = {s.get(), POLLIN, 0};
    if (::poll(&p, 1, 3000) != 1) break;
    ssize_t n = ::recv(s.get(), buf, sizeof buf, 0);
    if (n <= 0) break;
    in.append(buf, static_cast<size_t>(n));
    take_frames(in, [&](std::string_view r) { got_back.push_back(parse_reply(r)); });
  }
  return got_back;
}

std::pair<int, std::vector<uint32_t>> resolve(int netns, uint32_t server, const std::string& name) {
  Resolved r = resolve_udp(netns, server, name);
  return {r.rcode, r.a};
}

EgressPolicy policy(std::vector<std::string> allow, std::vector<std::string> deny, bool internet) {
  Result<EgressPolicy> p = parse_egress_policy(allow, deny, internet);
  REQUIRE(p);
  return *p;
}

// Sandbox id on hn with the default policy (the internet), its link
// made into netns.
std::optional<SandboxLink> add_sandbox(HostNetwork& hn, EgressPolicies& policies, const std::string& id, int netns) {
  policies.set(id, policy({}, {}, true));
  Result<SandboxLink> l = hn.reserve(id);
  REQUIRE(l);
  REQUIRE_MESSAGE(hn.attach(id, netns), "attach " << id);
  return *l;
}

std::string hex4() {
  std::random_device rd;
  char b[8];
  std::snprintf(b, sizeof b, "%04x", static_cast<unsigned>(rd() & 0xffff));
  return b;
}

}  // namespace

TEST_CASE("nft scripts: a sandbox's chain follows egress_policy.h's order" * doctest::test_suite("unit")) {
  NftConfig c;
  c.table = "sandgate_abcd";
  c.if_prefix = "sgabcdn";
  c.range = {v4("10.201.0.0"), 16};
  c.dns_port = 5353;
  std::string t = nft_table_script(c);
  CHECK(t.find("ip saddr 10.201.0.0/16 oifname != \"sgabcdn*\" masquerade") != std::string::npos);
  CHECK(t.find("th dport 53 redirect to :5353") != std::string::npos);
  NftSandbox s{7, "sgabcdn7", v4("10.201.0.30")};
  std::string r = nft_sandbox_script(c, s, policy({"203.0.113.0/24", "example.com", "2001:db8::/32"}, {"8.8.8.8"}, false), false);
  size_t spoof = r.find("ip saddr != 10.201.0.30 drop"), internal = r.find("@internal counter name \"sb_7_refused\" goto refuse"),
         allow = r.find("@sb_7_allow counter name \"sb_7_tx\" accept"), deny = r.find("@sb_7_deny counter name \"sb_7_refused\" goto refuse"),
         off = r.find("sb_7 counter name \"sb_7_refused\" goto refuse");
  REQUIRE(spoof != std::string::npos);
  REQUIRE(internal != std::string::npos);
  REQUIRE(allow != std::string::npos);
  REQUIRE(deny != std::string::npos);
  REQUIRE(off != std::string::npos);
  CHECK(spoof < internal);
  CHECK(internal < allow);
  CHECK(allow < deny);
  CHECK(deny < off);
  CHECK(r.find("203.0.113.0/24") != std::string::npos);
  CHECK(r.find("8.8.8.8/32") != std::string::npos);
  CHECK(r.find("2001:db8") == std::string::npos);  // no IPv6 rules for IPv4-only sandboxes
  c.allow_internal = true;
  CHECK(nft_sandbox_script(c, s, policy({}, {}, true), true).find("@internal") == std::string::npos);
  CHECK(parse_ipv4_net("10.201.0.0/16"));
  CHECK_FALSE(parse_ipv4_net("10.201.0.1/16"));  // host bits set
  CHECK_FALSE(parse_ipv4_net("10.201.0.0/33"));
  CHECK_FALSE(parse_ipv4_net("010.201.0.0/16"));
  CHECK_FALSE(parse_ipv4_net("10.201.0.0/16 "));
}

TEST_CASE("dns messages: queries and answers parsed within bounds" * doctest::test_suite("unit")) {
  auto hdr = [](uint16_t flags, uint16_t qd, uint16_t an) {
    std::string h(12, '\0');
    h[0] = 0x12, h[1] = 0x34, h[2] = static_cast<char>(flags >> 8), h[3] = static_cast<char>(flags & 255);
    h[5] = static_cast<char>(qd), h[7] = static_cast<char>(an);
    return h;
  };
  const std::string qname("\x03" "WwW" "\x07" "example" "\x03" "com" "\x00", 17), tail("\x00\x01\x00\x01", 4);
  Result<DnsQuestion> q = parse_dns_query(hdr(0x0100, 1, 0) + qname + tail);
  REQUIRE(q);
  CHECK(q->id == 0x1234);
  CHECK(q->name == "www.example.com");
  CHECK(q->qtype == 1);
  CHECK_FALSE(parse_dns_query(hdr(0x8100, 1, 0) + qname + tail));            // a response
  CHECK_FALSE(parse_dns_query(hdr(0x0100, 2, 0) + qname + tail + qname + tail));  // two questions
  CHECK_FALSE(parse_dns_query(hdr(0x0100, 1, 0) + qname));                   // no type and class
  CHECK_FALSE(parse_dns_query(hdr(0x0100, 1, 0) + std::string("\x3f", 1) + "abc"));  // label past the end
  CHECK_FALSE(parse_dns_query(hdr(0x0100, 1, 0) + std::string("\xc0\x0c", 2) + tail));  // compressed
  CHECK_FALSE(parse_dns_query(hdr(0x0100, 1, 0) + std::string("\x40", 1) + tail));       // label type 01
  std::string longname;
  for (int i = 0; i < 5; ++i) longname += std::string(1, '\x3f') + std::string(63, 'a');
  CHECK_FALSE(parse_dns_query(hdr(0x0100, 1, 0) + longname + std::string(1, '\0') + tail));  // over 255 bytes
  CHECK_FALSE(parse_dns_query(std::string(4097, '\0')));

  // An answer: a CNAME then an A, the second name a pointer into the first.
  std::string a = hdr(0x8180, 1, 2) + qname + tail;
  a += std::string("\xc0\x0c\x00\x05\x00\x01\x00\x00\x01\x2c\x00\x02\xc0\x10", 14);
  a += std::string("\xc0\x10\x00\x01\x00\x01\x00\x00\x00\x3c\x00\x04\x5d\xb8\xd8\x22", 16);
  Result<DnsAnswers> ans = parse_dns_answers(a);
  REQUIRE(ans);
  CHECK(ans->a == std::vector<uint32_t>{v4("93.184.216.34")});
  CHECK(ans->min_ttl == 60);
  CHECK_FALSE(parse_dns_answers(a.substr(0, a.size() - 1)));  // record data past the end
  // A pointer to itself loops: bounded, an error.
  CHECK_FALSE(parse_dns_answers(hdr(0x8180, 1, 0) + std::string("\xc0\x0c", 2) + tail));
  // An error reply keeps the id and the question, and nothing after it.
  std::string e = dns_error_reply(hdr(0x0100, 1, 0) + qname + tail + "extra", 5);
  Result<DnsAnswers> back = parse_dns_answers(e);
  REQUIRE(back);
  CHECK(back->id == 0x1234);
  CHECK(back->rcode == 5);
  CHECK(e.size() == 12 + qname.size() + 4);
  CHECK(resolv_conf_nameserver("# x\nsearch lan\nnameserver ::1\nnameserver 10.0.0.53\n") == v4("10.0.0.53"));
  CHECK_FALSE(resolv_conf_nameserver("nameserver fe80::1\n"));
}

TEST_CASE("host network: sandboxes reach the internet by their policy, nothing else" * doctest::test_suite("own-entry")) {
  if (::geteuid() != 0) test::skip_case("needs root (CAP_NET_ADMIN) for veth pairs and nftables");
  const std::string inst = hex4();
  const uint32_t internet = v4("203.0.113.2"), private_host = v4("192.168.213.2");
  Net inet("sgt" + inst + "i", v4("203.0.113.1"), internet);
  Net priv("sgt" + inst + "p", v4("192.168.213.1"), private_host);
  Servers inet_srv(inet.ns.get(), internet, 8080);
  Servers priv_srv(priv.ns.get(), private_host, 8080);

  std::vector<uint32_t> forty;
  for (uint32_t k = 0; k < 40; ++k) forty.push_back(internet + 100 + k);
  DnsServer dns(inet.ns.get(), internet,
                {{"internet.test", internet}, {"allowed.test", internet}, {"a.wild.test", internet}},
                {{"many.test", forty}});

  EgressPolicies policies;
  NetworkConfig cfg;
  cfg.instance = inst;
  cfg.dns_upstream = internet;
  cfg.max_connections = 8;
  cfg.rate_bytes_per_s = 8 << 20;
  cfg.range = Ipv4Net{v4("10.222.0.0"), 24};
  cfg.policies = &policies;
  Result<std::unique_ptr<HostNetwork>> hn = HostNetwork::start(cfg);
  if (!hn && hn.error().kind() == ErrorKind::kUnavailable) test::skip_case("no host networking here: " + hn.error().message());
  REQUIRE_MESSAGE(hn, hn.error().message());

  {
    // A range must be the sandboxes' alone; without one, a free /20 of 10.192.0.0/10.
    NetworkConfig other;
    other.instance = hex4();
    other.range = Ipv4Net{v4("203.0.113.0"), 25};
    Result<std::unique_ptr<HostNetwork>> clash = HostNetwork::start(other);
    REQUIRE_FALSE(clash);
    CHECK(clash.error().kind() == ErrorKind::kInvalid);
    CHECK(clash.error().message().find("overlaps this host's route to 203.0.113.0/24") != std::string::npos);
    other.range.reset();
    if (other.instance == inst) other.instance = inst == "0000" ? "0001" : "0000";
    Result<std::unique_ptr<HostNetwork>> picked = HostNetwork::start(other);
    REQUIRE_MESSAGE(picked, picked.error().message());
    Ipv4Net r = (*picked)->nft_config().range;
    CHECK(r.prefix == 20);
    CHECK((r.addr & 0xffc00000u) == v4("10.192.0.0"));

    // The range is held by an unreachable route (protocol 83, metric
    // 0x5347 and the instance) from the start, with no sandbox yet: the
    // next server sees it taken.
    const uint32_t metric = 0x53470000u | static_cast<uint32_t>(std::stoul(other.instance, nullptr, 16));
    auto held = [&](const Ipv4Net& n) {
      Result<Rtnl> h = Rtnl::open();
      REQUIRE(h);
      Result<std::vector<Rtnl::Route4>> rs = h->routes4();
      REQUIRE(rs);
      return std::any_of(rs->begin(), rs->end(), [&](const Rtnl::Route4& x) {
        return x.dst == n.addr && x.prefix == n.prefix && x.protocol == 83 && x.metric == metric &&
               x.type == RTN_UNREACHABLE;
      });
    };
    CHECK(held(r));
    NetworkConfig third;
    third.instance = other.instance == "ffff" ? "fffe" : "ffff";
    if (third.instance == inst) third.instance = "fffd";
    third.range = r;
    Result<std::unique_ptr<HostNetwork>> taken = HostNetwork::start(third);
    REQUIRE_FALSE(taken);
    CHECK(taken.error().message().find("overlaps this host's route to " + ipv4_net_text(r)) != std::string::npos);
    third.range.reset();
    Result<std::unique_ptr<HostNetwork>> beside = HostNetwork::start(third);
    REQUIRE_MESSAGE(beside, beside.error().message());
    CHECK((*beside)->nft_config().range.addr != r.addr);
    beside->reset();

    // A stop gives the range back; a crash leaves the route, and the same
    // server's next start takes it back rather than moving on.
    picked->reset();
    CHECK_FALSE(held(r));
    {
      Result<Rtnl> h = Rtnl::open();
      REQUIRE(h);
      REQUIRE(h->add_unreachable_route4(r.addr, r.prefix, 83, metric));
    }
    Result<std::unique_ptr<HostNetwork>> again = HostNetwork::start(other);
    REQUIRE_MESSAGE(again, again.error().message());
    CHECK((*again)->nft_config().range.addr == r.addr);
    CHECK(held(r));
    again->reset();
    CHECK_FALSE(held(r));
  }

  UniqueFd sb1 = new_netns(), sb2 = new_netns();
  std::optional<SandboxLink> l1 = add_sandbox(**hn, policies, "sb1", sb1.get());
  std::optional<SandboxLink> l2 = add_sandbox(**hn, policies, "sb2", sb2.get());
  CHECK(l1->gateway + 1 == l1->address);
  CHECK(l1->address != l2->address);
  Servers sb2_srv(sb2.get(), l2->address, 8080);

  // A host service on all addresses (as the gateway's API may be).
  UniqueFd host_listener(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in any = sa(0, 0);
  REQUIRE(::bind(host_listener.get(), reinterpret_cast<sockaddr*>(&any), sizeof any) == 0);
  REQUIRE(::listen(host_listener.get(), 8) == 0);
  socklen_t al = sizeof any;
  ::getsockname(host_listener.get(), reinterpret_cast<sockaddr*>(&any), &al);
  const uint16_t host_port = ntohs(any.sin_port);

  SUBCASE("default: the internet by TCP and UDP; not the private network, the host or another sandbox") {
    CHECK(name(hello(sb1.get(), internet, 8080)) == std::string("hello"));
    CHECK(udp_echo(sb1.get(), internet, 8080));
    CHECK(name(hello(sb1.get(), private_host, 8080)) == std::string("refused"));
    CHECK_FALSE(udp_echo(sb1.get(), private_host, 8080));
    CHECK(name(hello(sb1.get(), l1->gateway, host_port)) == std::string("refused"));
    CHECK(name(hello(sb1.get(), v4("203.0.113.1"), host_port)) == std::string("refused"));
    CHECK(name(hello(sb1.get(), l2->address, 8080)) == std::string("refused"));
    // The other way too: nothing opens a connection into a sandbox.
    CHECK(name(hello(sb2.get(), l1->address, 8080)) == std::string("refused"));
    // A spoofed source address gets nowhere: neither one outside the
    // range nor another sandbox's. Datagrams on one path stay in order, so
    // once the echo of the honest one is back the spoofed ones would have
    // arrived before it.
    Result<Rtnl> in1 = Rtnl::open_in(sb1.get());
    REQUIRE(in1);
    Result<int> e = in1->link_index("eth0");
    REQUIRE(e);
    REQUIRE(in1->add_address4(*e, htonl(v4("198.51.100.7")), 32));
    REQUIRE(in1->add_address4(*e, htonl(l2->address), 32));
    udp_spoof(sb1.get(), v4("198.51.100.7"), internet, 8080, "spf1");
    udp_spoof(sb1.get(), l2->address, internet, 8080, "spf2");
    CHECK(udp_echo(sb1.get(), internet, 8080, "okay"));
    std::vector<std::string> got = inet_srv.received();
    CHECK(std::find(got.begin(), got.end(), "okay") != got.end());
    CHECK(std::find(got.begin(), got.end(), "spf1") == got.end());
    CHECK(std::find(got.begin(), got.end(), "spf2") == got.end());
  }
  SUBCASE("allow_internet_access false: nothing; allowOut opens a CIDR, and wins over denyOut") {
    policies.set("sb1", policy({}, {}, false));
    CHECK(name(hello(sb1.get(), internet, 8080)) == std::string("refused"));
    CHECK_FALSE(udp_echo(sb1.get(), internet, 8080));
    policies.set("sb1", policy({"203.0.113.0/24"}, {"203.0.113.2"}, false));
    CHECK(name(hello(sb1.get(), internet, 8080)) == std::string("hello"));
    CHECK(udp_echo(sb1.get(), internet, 8080));
    // Internal networks stay closed whatever allowOut says.
    policies.set("sb1", policy({"192.168.0.0/16"}, {}, true));
    CHECK(name(hello(sb1.get(), private_host, 8080)) == std::string("refused"));
  }
  SUBCASE("DNS through the gateway: answered by policy; allowOut names open their addresses") {
    auto [rc, addrs] = resolve(sb1.get(), l1->gateway, "internet.test");
    CHECK(rc == 0);
    CHECK(addrs == std::vector<uint32_t>{internet});
    CHECK(resolve(sb1.get(), l1->gateway, "missing.test").first == 3);  // NXDOMAIN, relayed
    policies.set("sb1", policy({"allowed.test", "*.wild.test"}, {"203.0.113.0/24"}, false));
    CHECK(resolve(sb1.get(), l1->gateway, "internet.test").first == 5);  // REFUSED: no internet, not in allowOut
    CHECK(name(hello(sb1.get(), internet, 8080)) == std::string("refused"));
    // Resolving an allowOut name opens what it answered (over denyOut).
    CHECK(resolve(sb1.get(), l1->gateway, "ALLOWED.test").second == std::vector<uint32_t>{internet});
    CHECK(name(hello(sb1.get(), internet, 8080)) == std::string("hello"));
    CHECK(udp_echo(sb1.get(), internet, 8080));
    // ... for this sandbox only; and a new policy forgets it.
    policies.set("sb2", policy({}, {}, false));
    CHECK(name(hello(sb2.get(), internet, 8080)) == std::string("refused"));
    policies.set("sb1", policy({"*.wild.test"}, {}, false));
    CHECK(name(hello(sb1.get(), internet, 8080)) == std::string("refused"));
    CHECK(resolve(sb1.get(), l1->gateway, "a.wild.test").first == 0);
    CHECK(name(hello(sb1.get(), internet, 8080)) == std::string("hello"));
    // Another DNS server is just another destination.
    CHECK(resolve(sb2.get(), internet, "internet.test").first == -1);
    DnsForwarder::Counters c = (*hn)->dns_counters();
    CHECK(c.forwarded >= 4);
    CHECK(c.refused >= 1);
  }
  SUBCASE("DNS over TCP: a truncated answer asked again over TCP, by the same policy") {
    Resolved udp = resolve_udp(sb1.get(), l1->gateway, "many.test");
    CHECK(udp.rcode == 0);
    CHECK(udp.truncated);
    CHECK(udp.a.empty());
    // Two queries on one connection, answered in order; the long answer whole.
    std::vector<Resolved> tcp = resolve_tcp(sb1.get(), l1->gateway, {frame(a_query("many.test")), frame(a_query("missing.test"))});
    REQUIRE(tcp.size() == 2);
    CHECK(tcp[0].rcode == 0);
    CHECK_FALSE(tcp[0].truncated);
    CHECK(tcp[0].a == forty);
    CHECK(tcp[1].rcode == 3);
    policies.set("sb1", policy({"allowed.test"}, {}, false));
    tcp = resolve_tcp(sb1.get(), l1->gateway, {frame(a_query("many.test")), frame(a_query("allowed.test"))});
    REQUIRE(tcp.size() == 2);
    CHECK(tcp[0].rcode == 5);  // REFUSED
    CHECK(tcp[1].a == std::vector<uint32_t>{internet});
    CHECK(name(hello(sb1.get(), internet, 8080)) == std::string("hello"));  // opened by the TCP answer
    // A frame too short for a header: FORMERR is not possible, the stream
    // cannot be followed past it, the connection closes.
    CHECK(resolve_tcp(sb1.get(), l1->gateway, {std::string("\0\3abc", 5), frame(a_query("allowed.test"))}).empty());
    // A query split across writes is still one query.
    std::string q = frame(a_query("allowed.test"));
    Got got = Got::kOther;
    UniqueFd c = connect_from(sb1.get(), l1->gateway, 53, &got);
    REQUIRE(c);
    REQUIRE(::send(c.get(), q.data(), 5, MSG_NOSIGNAL) == 5);
    REQUIRE(::send(c.get(), q.data() + 5, q.size() - 5, MSG_NOSIGNAL) == static_cast<ssize_t>(q.size() - 5));
    pollfd p = {c.get(), POLLIN, 0};
    CHECK(::poll(&p, 1, 3000) == 1);
    DnsForwarder::Counters n = (*hn)->dns_counters();
    CHECK(n.forwarded >= 3);
    CHECK(n.malformed >= 1);
  }
  SUBCASE("denyOut by CIDR for TCP and UDP, other sandboxes unaffected") {
    policies.set("sb1", policy({}, {"203.0.113.0/28"}, true));
    CHECK(name(hello(sb1.get(), internet, 8080)) == std::string("refused"));
    CHECK_FALSE(udp_echo(sb1.get(), internet, 8080));
    CHECK(name(hello(sb2.get(), internet, 8080)) == std::string("hello"));
  }
  SUBCASE("limits: connections past the limit refused, over-rate packets dropped, all counted") {
    std::vector<UniqueFd> held;
    Got got = Got::kOther;
    for (int i = 0; i < 8; ++i) {
      held.push_back(connect_from(sb1.get(), internet, 8080, &got));
      REQUIRE_MESSAGE(held.back(), "connection " << i << ": " << name(got));
    }
    CHECK(name(hello(sb1.get(), internet, 8080)) == std::string("refused"));
    CHECK(name(hello(sb2.get(), internet, 8080)) == std::string("hello"));  // another sandbox's own count
    // An abortive close (SO_LINGER 0) ends a connection with a reset at
    // its exact sequence, which takes it out of the count as conntrack
    // sees it pass. One whose window is full (held[1]: nothing reads it),
    // so no data is in flight to make the reset look out of window; then
    // tries until conntrack has seen it (bounded, no sleep).
    ::linger abort{1, 0};
    REQUIRE(::setsockopt(held[1].get(), SOL_SOCKET, SO_LINGER, &abort, sizeof abort) == 0);
    held.erase(held.begin() + 1);
    Got again = Got::kOther;
    for (int i = 0; i < 500 && again != Got::kHello; ++i) again = hello(sb1.get(), internet, 8080);
    CHECK(name(again) == std::string("hello"));
    // 12 MiB at 8 MiB/s: past the policer's first bucket (a second of rate
    // and the burst), TCP overshoots the rate and packets are dropped.
    std::vector<char> buf(65536);
    size_t got_bytes = 0;
    while (got_bytes < (12u << 20)) {
      pollfd p = {held[0].get(), POLLIN, 0};
      REQUIRE(::poll(&p, 1, 5000) == 1);
      ssize_t n = ::recv(held[0].get(), buf.data(), buf.size(), 0);
      REQUIRE(n > 0);
      got_bytes += static_cast<size_t>(n);
    }
    Result<HostNetwork::Traffic> t = (*hn)->traffic("sb1");
    REQUIRE(t);
    CHECK(t->rx_bytes >= (12u << 20));
    CHECK(t->tx_bytes > 0);
    CHECK(t->refused_packets >= 1);
    CHECK(t->limited_packets >= 1);
    std::string m;
    (*hn)->render_metrics(m);
    CHECK(m.find("sandgate_sandbox_network_bytes_total{sandbox=\"sb1\",direction=\"in\"} ") != std::string::npos);
    CHECK(m.find("sandgate_sandbox_network_refused_packets_total{sandbox=\"sb2\"} 0") != std::string::npos);
  }
  SUBCASE("a narrowed policy cuts a running download") {
    Got got = Got::kOther;
    UniqueFd s = connect_from(sb1.get(), internet, 8080, &got);
    REQUIRE(s);
    std::vector<char> buf(65536);
    size_t before = 0;
    while (before < (1u << 20)) {
      pollfd p = {s.get(), POLLIN, 0};
      REQUIRE(::poll(&p, 1, 3000) == 1);
      ssize_t n = ::recv(s.get(), buf.data(), buf.size(), 0);
      REQUIRE(n > 0);
      before += static_cast<size_t>(n);
    }
    policies.set("sb1", policy({}, {}, false));
    // The next segments' ACKs are refused with a reset: the socket fails
    // (the data already in flight may still arrive first).
    int err = 0;
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (std::chrono::steady_clock::now() < deadline) {
      pollfd p = {s.get(), POLLIN, 0};
      if (::poll(&p, 1, 1000) != 1) continue;
      ssize_t n = ::recv(s.get(), buf.data(), buf.size(), 0);
      if (n <= 0) {
        err = n < 0 ? errno : -1;
        break;
      }
    }
    CHECK_MESSAGE(err == ECONNRESET, "the download ended with " << (err > 0 ? std::strerror(err) : "no error"));
  }

  (*hn)->release("sb1");
  (*hn)->release("sb2");
  CHECK((*hn)->sandboxes() == 0);
  Result<Rtnl> h = Rtnl::open();
  REQUIRE(h);
  Result<std::vector<std::string>> left = h->links_with_prefix((*hn)->nft_config().if_prefix);
  REQUIRE(left);
  CHECK(left->empty());
}

TEST_CASE("host network: sandboxes' links outlive the server and are taken back after a restart" *
          doctest::test_suite("own-entry")) {
  if (::geteuid() != 0) test::skip_case("needs root (CAP_NET_ADMIN) for veth pairs and nftables");
  const std::string inst = hex4();
  const uint32_t internet = v4("203.0.113.2");
  Net inet("sgt" + inst + "i", v4("203.0.113.1"), internet);
  Servers inet_srv(inet.ns.get(), internet, 8080);

  EgressPolicies policies;
  NetworkConfig cfg;
  cfg.instance = inst;
  cfg.dns = false;
  cfg.range = Ipv4Net{v4("10.223.0.0"), 24};
  cfg.policies = &policies;
  cfg.keep_links = true;
  Result<std::unique_ptr<HostNetwork>> hn = HostNetwork::start(cfg);
  if (!hn && hn.error().kind() == ErrorKind::kUnavailable) test::skip_case("no host networking here: " + hn.error().message());
  REQUIRE_MESSAGE(hn, hn.error().message());
  const std::string prefix = (*hn)->nft_config().if_prefix;

  UniqueFd sb1 = new_netns(), sb2 = new_netns();
  std::optional<SandboxLink> l1 = add_sandbox(**hn, policies, "sb1", sb1.get());
  std::optional<SandboxLink> l2 = add_sandbox(**hn, policies, "sb2", sb2.get());
  CHECK(hello(sb1.get(), internet, 8080) == Got::kHello);

  // The server goes (a stop that keeps its sandboxes): links, table and
  // range stay, and the kernel keeps enforcing the policies meanwhile.
  hn->reset();
  Result<Rtnl> h = Rtnl::open();
  REQUIRE(h);
  CHECK(h->link_index(l1->link));
  CHECK(h->link_index(l2->link));
  CHECK(hello(sb1.get(), internet, 8080) == Got::kHello);

  // The next start keeps them (their routes overlap the range, as its
  // own), takes sb1 back, refuses a namespace with no link of its own,
  // keeps sb2's slot until the sweep, which removes sb2's link.
  policies.set("sb1", policy({}, {}, false));  // the policy now in force is the new server's
  Result<std::unique_ptr<HostNetwork>> again = HostNetwork::start(cfg);
  REQUIRE_MESSAGE(again, again.error().message());
  REQUIRE((*again)->adopt("sb1", sb1.get()));
  CHECK((*again)->adopt("sb1", sb1.get()).error().kind() == ErrorKind::kConflict);
  UniqueFd bare = new_netns();
  Status none = (*again)->adopt("bare", bare.get());
  REQUIRE_FALSE(none);
  CHECK(none.error().kind() == ErrorKind::kNotFound);
  CHECK(hello(sb1.get(), internet, 8080) == Got::kRefused);
  policies.set("sb1", policy({}, {}, true));
  CHECK(hello(sb1.get(), internet, 8080) == Got::kHello);
  Result<HostNetwork::Traffic> t = (*again)->traffic("sb1");
  REQUIRE(t);
  CHECK(t->rx_bytes > 0);
  Result<SandboxLink> l3 = (*again)->reserve("sb3");
  REQUIRE(l3);
  CHECK(l3->address != l1->address);
  CHECK(l3->address != l2->address);
  (*again)->sweep();
  CHECK(h->link_index(l1->link));
  Result<int> gone = h->link_index(l2->link);
  REQUIRE_FALSE(gone);
  CHECK(gone.error().kind() == ErrorKind::kNotFound);
  // sb2 is not the new server's: its namespace lost eth0 with the pair.
  CHECK(hello(sb2.get(), internet, 8080) == Got::kOther);

  // With no sandbox left, a stop removes everything, keep_links or not.
  (*again)->release("sb1");
  (*again)->release("sb3");
  again->reset();
  Result<std::vector<std::string>> left = h->links_with_prefix(prefix);
  REQUIRE(left);
  CHECK(left->empty());
  Result<std::vector<Rtnl::Route4>> routes = h->routes4();
  REQUIRE(routes);
  CHECK(std::none_of(routes->begin(), routes->end(), [](const Rtnl::Route4& r) { return r.protocol == 83; }));
}

namespace {

// A TAP device named name in netns (made on a thread inside it); its fd.
UniqueFd tap_in(int netns, const std::string& name) {
  std::optional<Result<UniqueFd>> fd;
  std::thread t([&] {
    if (::setns(netns, CLONE_NEWNET) == 0) fd.emplace(open_tap(name));
  });
  t.join();
  REQUIRE_MESSAGE(fd, "setns: " << std::strerror(errno));
  REQUIRE_MESSAGE(*fd, "a TAP device in the namespace: " << fd->error().message());
  return std::move(**fd);
}

// Copies frames both ways between two TAP fds until stopped: the wire a
// microVM's VMM is (its virtio-net moves whole frames, unchanged).
class FramePump {
 public:
  FramePump(int a, int b) : a_(a), b_(b), stop_(::eventfd(0, EFD_CLOEXEC)) {
    thread_ = std::thread([this] { run(); });
  }
  ~FramePump() {
    uint64_t one = 1;
    (void)!::write(stop_.get(), &one, sizeof one);
    thread_.join();
  }
  uint64_t frames() const { return frames_.load(); }

 private:
  void run() {
    std::vector<char> buf(65536);
    for (;;) {
      struct pollfd p[3] = {{a_, POLLIN, 0}, {b_, POLLIN, 0}, {stop_.get(), POLLIN, 0}};
      if (::poll(p, 3, -1) < 0 && errno != EINTR) return;
      if (p[2].revents) return;
      for (int i = 0; i < 2; ++i)
        if (p[i].revents & POLLIN) {
          ssize_t n = ::read(i == 0 ? a_ : b_, buf.data(), buf.size());
          if (n > 0 && ::write(i == 0 ? b_ : a_, buf.data(), static_cast<size_t>(n)) == n) ++frames_;
        }
    }
  }
  int a_, b_;
  UniqueFd stop_;
  std::atomic<uint64_t> frames_{0};
  std::thread thread_;
};

}  // namespace

TEST_CASE("host network: a microVM's TAP gets the same address plan and policy" * doctest::test_suite("own-entry")) {
  if (::geteuid() != 0) test::skip_case("needs root (CAP_NET_ADMIN) for TAP devices and nftables");
  const std::string inst = hex4();
  const uint32_t internet = v4("203.0.113.2"), private_host = v4("192.168.214.2");
  Net inet("sgt" + inst + "i", v4("203.0.113.1"), internet);
  Net priv("sgt" + inst + "p", v4("192.168.214.1"), private_host);
  Servers inet_srv(inet.ns.get(), internet, 8080);
  Servers priv_srv(priv.ns.get(), private_host, 8080);

  EgressPolicies policies;
  NetworkConfig cfg;
  cfg.instance = inst;
  cfg.dns = false;
  cfg.range = Ipv4Net{v4("10.224.0.0"), 24};
  cfg.policies = &policies;
  Result<std::unique_ptr<HostNetwork>> hn = HostNetwork::start(cfg);
  if (!hn && hn.error().kind() == ErrorKind::kUnavailable) test::skip_case("no host networking here: " + hn.error().message());
  REQUIRE_MESSAGE(hn, hn.error().message());

  // The microVM: a namespace whose eth0 is a TAP, configured as the agent
  // configures a guest's (address, default route), joined to the host's
  // TAP by a frame pump. A veth sandbox beside it.
  policies.set("vm1", policy({}, {}, true));
  Result<SandboxLink> l = (*hn)->reserve("vm1");
  REQUIRE(l);
  Result<UniqueFd> host_tap = (*hn)->attach_tap("vm1");
  REQUIRE_MESSAGE(host_tap, host_tap.error().message());
  Result<Rtnl> h = Rtnl::open();
  REQUIRE(h);
  Result<int> hidx = h->link_index(l->link);
  REQUIRE(hidx);
  Result<std::vector<std::pair<uint32_t, int>>> haddr = h->addresses4(*hidx);
  REQUIRE(haddr);
  REQUIRE(haddr->size() == 1);
  CHECK(haddr->front() == std::make_pair(l->gateway, 30));

  UniqueFd vm = new_netns();
  UniqueFd guest_tap = tap_in(vm.get(), "eth0");
  {
    Result<Rtnl> in = Rtnl::open_in(vm.get());
    REQUIRE(in);
    Result<int> e = in->link_index("eth0");
    REQUIRE(e);
    REQUIRE(in->add_address4(*e, htonl(l->address), 30));
    REQUIRE(in->set_up(*e));
    REQUIRE(in->add_default_route4(*e, htonl(l->gateway), true));
  }
  FramePump wire(host_tap->get(), guest_tap.get());
  UniqueFd sb = new_netns();
  std::optional<SandboxLink> l2 = add_sandbox(**hn, policies, "sb2", sb.get());
  Servers sb_srv(sb.get(), l2->address, 8080);

  CHECK(name(hello(vm.get(), internet, 8080)) == std::string("hello"));
  CHECK(udp_echo(vm.get(), internet, 8080));
  CHECK(name(hello(vm.get(), private_host, 8080)) == std::string("refused"));
  CHECK(name(hello(vm.get(), l2->address, 8080)) == std::string("refused"));
  // A spoofed source (another sandbox's address) gets nowhere.
  {
    Result<Rtnl> in = Rtnl::open_in(vm.get());
    REQUIRE(in);
    Result<int> e = in->link_index("eth0");
    REQUIRE(e);
    REQUIRE(in->add_address4(*e, htonl(l2->address), 32));
  }
  udp_spoof(vm.get(), l2->address, internet, 8080, "spf3");
  CHECK(udp_echo(vm.get(), internet, 8080, "okay"));
  std::vector<std::string> got = inet_srv.received();
  CHECK(std::find(got.begin(), got.end(), "spf3") == got.end());
  // The policy follows the table, as for a veth sandbox.
  policies.set("vm1", policy({}, {}, false));
  CHECK(name(hello(vm.get(), internet, 8080)) == std::string("refused"));
  Result<HostNetwork::Traffic> t = (*hn)->traffic("vm1");
  REQUIRE(t);
  CHECK(t->tx_bytes > 0);
  CHECK(t->refused_packets > 0);
  CHECK(wire.frames() > 0);

  // release removes the TAP even while its fd (the VMM's) is open.
  (*hn)->release("vm1");
  Result<int> gone = h->link_index(l->link);
  REQUIRE_FALSE(gone);
  CHECK(gone.error().kind() == ErrorKind::kNotFound);
  (*hn)->release("sb2");
}
