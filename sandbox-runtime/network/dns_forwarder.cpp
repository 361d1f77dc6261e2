// DnsForwarder: see dns_forwarder.h.
#include "sandbox-runtime/network/dns_forwarder.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <chrono>
#include <map>
#include <sstream>

#include "base/log.h"
#include "base/sys.h"
#include "sandbox-runtime/network/dns_message.h"

namespace sg::network {
namespace {

constexpr auto kUpstreamTimeout = std::chrono::seconds(5);
constexpr size_t kMaxPendingPerSandbox = 64;
// An allowed name's addresses stay open at least this long (resolvers
// cache past short TTLs) and at most an hour.
constexpr uint32_t kMinAllowTtl = 60, kMaxAllowTtl = 3600;

uint16_t random_id() {
  uint16_t v = 0;
  if (::getrandom(&v, sizeof v, 0) != sizeof v) v = static_cast<uint16_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  return v;
}

constexpr auto kTcpIdle = std::chrono::seconds(10);
constexpr size_t kMaxTcpPerSandbox = 8;
constexpr size_t kMaxTcpAnswer = 2 + 65535;

// A message with TCP's two-byte length in front (RFC 1035 4.2.2).
std::string framed(std::string_view m) {
  std::string o;
  o.push_back(static_cast<char>(m.size() >> 8));
  o.push_back(static_cast<char>(m.size() & 0xff));
  o.append(m);
  return o;
}
size_t frame_length(const std::string& b) {
  return (static_cast<size_t>(static_cast<unsigned char>(b[0])) << 8) | static_cast<unsigned char>(b[1]);
}

sockaddr_in sa(uint32_t addr, uint16_t port) {
  sockaddr_in s{};
  s.sin_family = AF_INET;
  s.sin_addr.s_addr = htonl(addr);
  s.sin_port = htons(port);
  return s;
}

}  // namespace

std::optional<uint32_t> resolv_conf_nameserver(const std::string& text) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream l(line);
    std::string key, value;
    if (!(l >> key >> value) || key != "nameserver") continue;
    struct in_addr a {};
    if (::inet_pton(AF_INET, value.c_str(), &a) == 1) return ntohl(a.s_addr);
  }
  return std::nullopt;
}

Result<std::unique_ptr<DnsForwarder>> DnsForwarder::start(DnsForwarderConfig cfg, uint16_t port) {
  if (!cfg.policy_of) return internal_error("DNS forwarder without a policy source");
  if (cfg.upstream == 0) {
    Result<std::string> rc = sys::read_file("/etc/resolv.conf", 64 * 1024);
    if (!rc) return Error(ErrorKind::kUnavailable, "DNS forwarder: " + rc.error().message());
    std::optional<uint32_t> ns = resolv_conf_nameserver(*rc);
    if (!ns) return Error(ErrorKind::kUnavailable, "DNS forwarder: /etc/resolv.conf names no IPv4 nameserver");
    cfg.upstream = *ns;
  }
  // UDP first (port 0 picks one), then TCP on the same number; another
  // program may hold that number for TCP, so a picked one is tried a few times.
  UniqueFd s, t;
  sockaddr_in any = sa(0, port);
  for (int attempt = 0;; ++attempt) {
    s.reset(::socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!s) return sys::errno_error("socket", "DNS forwarder");
    any = sa(0, port);
    if (::bind(s.get(), reinterpret_cast<sockaddr*>(&any), sizeof any) != 0)
      return sys::errno_error("bind", "DNS forwarder port " + std::to_string(port));
    socklen_t len = sizeof any;
    if (::getsockname(s.get(), reinterpret_cast<sockaddr*>(&any), &len) != 0)
      return sys::errno_error("getsockname", "DNS forwarder");
    t.reset(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!t) return sys::errno_error("socket", "DNS forwarder (TCP)");
    int one = 1;
    ::setsockopt(t.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(t.get(), reinterpret_cast<const sockaddr*>(&any), sizeof any) == 0) break;
    if (errno != EADDRINUSE || port != 0 || attempt == 16)
      return sys::errno_error("bind", "DNS forwarder TCP port " + std::to_string(ntohs(any.sin_port)));
  }
  if (::listen(t.get(), 64) != 0) return sys::errno_error("listen", "DNS forwarder (TCP)");
  UniqueFd wake(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!wake) return sys::errno_error("eventfd", "DNS forwarder");
  auto f = std::unique_ptr<DnsForwarder>(
      new DnsForwarder(std::move(cfg), std::move(s), std::move(t), ntohs(any.sin_port), std::move(wake)));
  f->thread_ = std::thread([p = f.get()] { p->run(); });
  return f;
}

DnsForwarder::DnsForwarder(DnsForwarderConfig cfg, UniqueFd sock, UniqueFd tcp, uint16_t port, UniqueFd wake)
    : cfg_(std::move(cfg)), sock_(std::move(sock)), tcp_(std::move(tcp)), port_(port), wake_(std::move(wake)) {}

DnsForwarder::~DnsForwarder() {
  stop_ = true;
  uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof one);
  if (thread_.joinable()) thread_.join();
}

DnsForwarder::Counters DnsForwarder::counters() const {
  return {queries_.load(), forwarded_.load(), refused_.load(), malformed_.load(), upstream_failures_.load(), dropped_.load()};
}

void DnsForwarder::run() {
  struct Pending {
    UniqueFd upstream;
    sockaddr_in client{};
    std::string query;  // as the sandbox sent it (for a SERVFAIL)
    uint16_t client_id = 0, upstream_id = 0;
    bool allow_out_name = false;
    std::chrono::steady_clock::time_point deadline;
  };
  // A sandbox's TCP connection: one query at a time, its answer asked of
  // the upstream over a TCP connection of its own.
  struct Tcp {
    UniqueFd client;
    uint32_t src = 0;
    std::string in, out;  // framed queries read, framed answers to send
    UniqueFd upstream;    // set while a query is out
    std::string up_out, up_in;
    std::string query;
    uint16_t client_id = 0, upstream_id = 0;
    bool allow_out_name = false;
    bool closing = false;  // close once out is sent
    std::chrono::steady_clock::time_point deadline;  // the upstream's, or idle
  };
  std::vector<Pending> pending;
  std::vector<Tcp> tcp;
  std::map<uint32_t, size_t> per_sandbox, tcp_per_sandbox;
  std::string buf(kMaxDnsMessage + 1, '\0');
  std::string answer(65536, '\0');

  auto reply = [&](const sockaddr_in& to, const std::string& msg) {
    (void)::sendto(sock_.get(), msg.data(), msg.size(), MSG_DONTWAIT, reinterpret_cast<const sockaddr*>(&to), sizeof to);
  };
  auto finish = [&](size_t i) {
    uint32_t src = ntohl(pending[i].client.sin_addr.s_addr);
    if (--per_sandbox[src] == 0) per_sandbox.erase(src);
    pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
  };
  auto tcp_close = [&](size_t i) {
    uint32_t src = tcp[i].src;
    if (--tcp_per_sandbox[src] == 0) tcp_per_sandbox.erase(src);
    tcp.erase(tcp.begin() + static_cast<std::ptrdiff_t>(i));
  };
  // The decision for one query (the same for both transports): an
  // immediate reply (REFUSED, FORMERR), or nullopt and the question's id
  // and whether its name is one of allowOut's, to ask the upstream.
  struct Decision {
    std::optional<std::string> reply;
    bool drop = false;  // not one of our sandboxes
    uint16_t id = 0;
    bool named = false;
  };
  auto decide = [&](uint32_t src, std::string_view msg) {
    Decision d;
    std::optional<EgressPolicy> pol = cfg_.policy_of(src);
    if (!pol) {
      ++dropped_;
      d.drop = true;
      return d;
    }
    Result<DnsQuestion> q = parse_dns_query(msg);
    if (!q) {
      ++malformed_;
      if (msg.size() >= kDnsHeader && msg.size() <= kMaxDnsMessage)
        d.reply = dns_error_reply(msg.substr(0, kDnsHeader), 1);  // FORMERR
      else
        d.drop = true;
      return d;
    }
    d.named = name_in_allow_out(*pol, q->name);
    if (!pol->internet && !d.named) {
      ++refused_;
      d.reply = dns_error_reply(msg, 5);
      return d;
    }
    d.id = q->id;
    return d;
  };
  // The upstream's answer to c's query (or its failure) into c.out.
  auto tcp_answered = [&](Tcp& c, std::chrono::steady_clock::time_point now) {
    std::optional<Result<DnsAnswers>> a;
    if (c.up_in.size() >= 2 && c.up_in.size() == 2 + frame_length(c.up_in))
      a = parse_dns_answers(std::string_view(c.up_in).substr(2));
    if (!a || !*a || (*a)->id != c.upstream_id) {
      ++upstream_failures_;
      c.out += framed(dns_error_reply(c.query, 2));
    } else {
      if (c.allow_out_name && (*a)->rcode == 0 && !(*a)->a.empty() && cfg_.on_allowed)
        cfg_.on_allowed(c.src, (*a)->a, std::clamp((*a)->min_ttl, kMinAllowTtl, kMaxAllowTtl));
      c.out += framed(dns_with_id(std::string_view(c.up_in).substr(2), c.client_id));
      ++forwarded_;
    }
    c.upstream.reset();
    c.up_out.clear();
    c.up_in.clear();
    c.query.clear();
    c.deadline = now + kTcpIdle;
  };
  // The next whole query in c.in, if any and none is out.
  auto tcp_next = [&](Tcp& c, std::chrono::steady_clock::time_point now) {
    // One answer waits at most: a sandbox that does not read gets no more.
    if (c.upstream || c.closing || c.in.size() < 2 || c.out.size() >= kMaxTcpAnswer) return;
    size_t len = frame_length(c.in);
    if (len < kDnsHeader || len > kMaxDnsMessage) {
      ++queries_;
      ++malformed_;
      c.closing = true;  // the stream cannot be followed past it
      return;
    }
    if (c.in.size() < 2 + len) return;
    std::string msg = c.in.substr(2, len);
    c.in.erase(0, 2 + len);
    ++queries_;
    Decision d = decide(c.src, msg);
    if (d.drop) {
      c.closing = true;
      return;
    }
    if (d.reply) {
      c.out += framed(*d.reply);
      c.deadline = now + kTcpIdle;
      return;
    }
    c.upstream.reset(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    sockaddr_in up = sa(cfg_.upstream, 53);
    if (!c.upstream ||
        (::connect(c.upstream.get(), reinterpret_cast<sockaddr*>(&up), sizeof up) != 0 && errno != EINPROGRESS)) {
      c.upstream.reset();
      ++upstream_failures_;
      c.out += framed(dns_error_reply(msg, 2));
      return;
    }
    c.query = msg;
    c.client_id = d.id;
    c.upstream_id = random_id();
    c.allow_out_name = d.named;
    c.up_out = framed(dns_with_id(msg, c.upstream_id));
    c.deadline = now + kUpstreamTimeout;
  };

  while (!stop_) {
    std::vector<pollfd> fds;
    fds.push_back({wake_.get(), POLLIN, 0});
    fds.push_back({sock_.get(), POLLIN, 0});
    fds.push_back({tcp_.get(), static_cast<short>(tcp.size() < kMaxTcp ? POLLIN : 0), 0});
    for (const Pending& p : pending) fds.push_back({p.upstream.get(), POLLIN, 0});
    const size_t tcp_base = fds.size();
    for (const Tcp& c : tcp) {
      short ev = 0;
      if (!c.upstream && !c.closing && c.in.size() < 2 + kMaxDnsMessage && c.out.size() < kMaxTcpAnswer) ev |= POLLIN;
      if (!c.out.empty()) ev |= POLLOUT;
      fds.push_back({c.client.get(), ev, 0});
      fds.push_back({c.upstream ? c.upstream.get() : -1, static_cast<short>(c.up_out.empty() ? POLLIN : POLLOUT), 0});
    }
    int timeout = -1;
    auto now = std::chrono::steady_clock::now();
    auto until = [&](std::chrono::steady_clock::time_point d) {
      auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(d - now).count() + 1;
      int v = static_cast<int>(std::clamp<int64_t>(ms, 0, 60000));
      timeout = timeout < 0 ? v : std::min(timeout, v);
    };
    for (const Pending& p : pending) until(p.deadline);
    for (const Tcp& c : tcp) until(c.deadline);
    int r = ::poll(fds.data(), fds.size(), timeout);
    if (r < 0 && errno != EINTR) {
      LOG_ERROR("DNS forwarder: poll: " << std::strerror(errno));
      return;
    }
    if (stop_) return;
    now = std::chrono::steady_clock::now();

    // TCP connections (before the UDP answers: their slots stay put here),
    // back to front so indexes hold.
    for (size_t i = tcp.size(); i-- > 0;) {
      Tcp& c = tcp[i];
      const pollfd& cf = fds[tcp_base + 2 * i];
      const pollfd& uf = fds[tcp_base + 2 * i + 1];
      bool gone = false;
      if (c.upstream && uf.revents) {
        if (!c.up_out.empty() && (uf.revents & (POLLOUT | POLLERR | POLLHUP))) {
          ssize_t n = ::send(c.upstream.get(), c.up_out.data(), c.up_out.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
          if (n > 0) c.up_out.erase(0, static_cast<size_t>(n));
          else if (n < 0 && errno != EAGAIN && errno != EINTR) tcp_answered(c, now);  // refused: SERVFAIL
        } else if (c.up_out.empty() && (uf.revents & (POLLIN | POLLERR | POLLHUP))) {
          size_t want = c.up_in.size() < 2 ? 2 - c.up_in.size() : 2 + frame_length(c.up_in) - c.up_in.size();
          want = std::min(want, answer.size());
          ssize_t n = want == 0 ? 0 : ::recv(c.upstream.get(), answer.data(), want, MSG_DONTWAIT);
          if (n > 0) {
            c.up_in.append(answer.data(), static_cast<size_t>(n));
            if (c.up_in.size() >= 2 && c.up_in.size() == 2 + frame_length(c.up_in)) tcp_answered(c, now);
          } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
            tcp_answered(c, now);  // closed or failed before a whole answer: SERVFAIL
          }
        }
      }
      if (cf.revents & POLLIN) {
        size_t room = 2 + kMaxDnsMessage - c.in.size();
        ssize_t n = ::recv(c.client.get(), buf.data(), std::min(room, buf.size()), MSG_DONTWAIT);
        if (n > 0) {
          c.in.append(buf.data(), static_cast<size_t>(n));  // no more time: a whole query within kTcpIdle
        } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
          gone = true;  // the sandbox closed its end (or it failed)
        }
      } else if (cf.revents & (POLLERR | POLLHUP)) {
        gone = true;
      }
      if (!gone) tcp_next(c, now);
      if (!gone && !c.out.empty() && (cf.revents & POLLOUT)) {
        ssize_t n = ::send(c.client.get(), c.out.data(), c.out.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n > 0) c.out.erase(0, static_cast<size_t>(n));
        else if (n < 0 && errno != EAGAIN && errno != EINTR) gone = true;
      }
      if (!gone && c.upstream && c.deadline <= now) tcp_answered(c, now);  // the upstream's 5 s: SERVFAIL
      if (!gone && !c.upstream && c.out.empty() && (c.closing || c.deadline <= now)) gone = true;
      if (gone) tcp_close(i);
    }
    if (fds[2].revents & POLLIN) {
      for (int k = 0; k < 16 && tcp.size() < kMaxTcp; ++k) {
        sockaddr_in from{};
        socklen_t fl = sizeof from;
        UniqueFd c(::accept4(tcp_.get(), reinterpret_cast<sockaddr*>(&from), &fl, SOCK_NONBLOCK | SOCK_CLOEXEC));
        if (!c) break;
        uint32_t src = ntohl(from.sin_addr.s_addr);
        if (fl != sizeof from || from.sin_family != AF_INET || !cfg_.policy_of(src) ||
            tcp_per_sandbox[src] >= kMaxTcpPerSandbox) {
          ++dropped_;  // not one of our sandboxes, or too many at once
          if (tcp_per_sandbox[src] == 0) tcp_per_sandbox.erase(src);
          continue;
        }
        Tcp t;
        t.client = std::move(c);
        t.src = src;
        t.deadline = now + kTcpIdle;
        ++tcp_per_sandbox[src];
        tcp.push_back(std::move(t));
      }
    }

    // UDP answers first (their slots go), back to front so indexes hold.
    for (size_t i = pending.size(); i-- > 0;) {
      if (!(fds[i + 3].revents & (POLLIN | POLLERR))) continue;
      Pending& p = pending[i];
      ssize_t n = ::recv(p.upstream.get(), answer.data(), answer.size(), MSG_DONTWAIT);
      if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      Result<DnsAnswers> a = n > 0 ? parse_dns_answers(std::string_view(answer.data(), static_cast<size_t>(n)))
                                   : Result<DnsAnswers>(invalid_error("upstream error"));
      if (!a || a->id != p.upstream_id) {
        if (n <= 0) {
          ++upstream_failures_;
          reply(p.client, dns_error_reply(p.query, 2));
          finish(i);
        }
        continue;  // not our answer (or garbage): keep waiting for the real one
      }
      uint32_t src = ntohl(p.client.sin_addr.s_addr);
      if (p.allow_out_name && a->rcode == 0 && !a->a.empty() && cfg_.on_allowed)
        cfg_.on_allowed(src, a->a, std::clamp(a->min_ttl, kMinAllowTtl, kMaxAllowTtl));
      reply(p.client, dns_with_id(std::string_view(answer.data(), static_cast<size_t>(n)), p.client_id));
      ++forwarded_;
      finish(i);
    }
    for (size_t i = pending.size(); i-- > 0;) {
      if (pending[i].deadline > now) continue;
      ++upstream_failures_;
      reply(pending[i].client, dns_error_reply(pending[i].query, 2));
      finish(i);
    }

    if (!(fds[1].revents & POLLIN)) continue;
    // A bounded batch of queries per round, so answers are not starved.
    for (int k = 0; k < 64; ++k) {
      sockaddr_in from{};
      socklen_t fl = sizeof from;
      ssize_t n = ::recvfrom(sock_.get(), buf.data(), buf.size(), MSG_DONTWAIT, reinterpret_cast<sockaddr*>(&from), &fl);
      if (n < 0) break;
      ++queries_;
      if (fl != sizeof from || from.sin_family != AF_INET) {
        ++dropped_;
        continue;
      }
      uint32_t src = ntohl(from.sin_addr.s_addr);
      std::string_view msg(buf.data(), static_cast<size_t>(n));
      Decision d = decide(src, msg);
      if (d.drop) continue;
      if (d.reply) {
        reply(from, *d.reply);
        continue;
      }
      if (pending.size() >= kMaxPending || per_sandbox[src] >= kMaxPendingPerSandbox) {
        ++dropped_;
        reply(from, dns_error_reply(msg, 2));
        if (per_sandbox[src] == 0) per_sandbox.erase(src);
        continue;
      }
      Pending p;
      p.upstream.reset(::socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
      sockaddr_in up = sa(cfg_.upstream, 53);
      if (!p.upstream || ::connect(p.upstream.get(), reinterpret_cast<sockaddr*>(&up), sizeof up) != 0) {
        ++upstream_failures_;
        reply(from, dns_error_reply(msg, 2));
        continue;
      }
      p.client = from;
      p.query = std::string(msg);
      p.client_id = d.id;
      p.upstream_id = random_id();
      p.allow_out_name = d.named;
      p.deadline = now + kUpstreamTimeout;
      std::string out = dns_with_id(msg, p.upstream_id);
      if (::send(p.upstream.get(), out.data(), out.size(), MSG_DONTWAIT) != static_cast<ssize_t>(out.size())) {
        ++upstream_failures_;
        reply(from, dns_error_reply(msg, 2));
        continue;
      }
      ++per_sandbox[src];
      pending.push_back(std::move(p));
    }
  }
}

}  // namespace sg::network
