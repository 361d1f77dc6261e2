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
  UniqueFd s(::socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!s) return sys::errno_error("socket", "DNS forwarder");
  sockaddr_in any = sa(0, port);
  if (::bind(s.get(), reinterpret_cast<sockaddr*>(&any), sizeof any) != 0)
    return sys::errno_error("bind", "DNS forwarder port " + std::to_string(port));
  socklen_t len = sizeof any;
  if (::getsockname(s.get(), reinterpret_cast<sockaddr*>(&any), &len) != 0) return sys::errno_error("getsockname", "DNS forwarder");
  UniqueFd wake(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!wake) return sys::errno_error("eventfd", "DNS forwarder");
  auto f = std::unique_ptr<DnsForwarder>(new DnsForwarder(std::move(cfg), std::move(s), ntohs(any.sin_port), std::move(wake)));
  f->thread_ = std::thread([p = f.get()] { p->run(); });
  return f;
}

DnsForwarder::DnsForwarder(DnsForwarderConfig cfg, UniqueFd sock, uint16_t port, UniqueFd wake)
    : cfg_(std::move(cfg)), sock_(std::move(sock)), port_(port), wake_(std::move(wake)) {}

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
  std::vector<Pending> pending;
  std::map<uint32_t, size_t> per_sandbox;
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

  while (!stop_) {
    std::vector<pollfd> fds;
    fds.push_back({wake_.get(), POLLIN, 0});
    fds.push_back({sock_.get(), POLLIN, 0});
    for (const Pending& p : pending) fds.push_back({p.upstream.get(), POLLIN, 0});
    int timeout = -1;
    auto now = std::chrono::steady_clock::now();
    for (const Pending& p : pending) {
      auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(p.deadline - now).count() + 1;
      timeout = timeout < 0 ? static_cast<int>(std::max<int64_t>(0, ms)) : std::min(timeout, static_cast<int>(std::max<int64_t>(0, ms)));
    }
    int r = ::poll(fds.data(), fds.size(), timeout);
    if (r < 0 && errno != EINTR) {
      LOG_ERROR("DNS forwarder: poll: " << std::strerror(errno));
      return;
    }
    if (stop_) return;
    now = std::chrono::steady_clock::now();

    // Answers first (their slots go), back to front so indexes hold.
    for (size_t i = pending.size(); i-- > 0;) {
      if (!(fds[i + 2].revents & (POLLIN | POLLERR))) continue;
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
      std::optional<EgressPolicy> pol = cfg_.policy_of(src);
      if (!pol) {
        ++dropped_;  // not one of our sandboxes
        continue;
      }
      std::string_view msg(buf.data(), static_cast<size_t>(n));
      Result<DnsQuestion> q = parse_dns_query(msg);
      if (!q) {
        ++malformed_;
        if (static_cast<size_t>(n) >= kDnsHeader && static_cast<size_t>(n) <= kMaxDnsMessage)
          reply(from, dns_error_reply(msg.substr(0, kDnsHeader), 1));  // FORMERR
        continue;
      }
      bool named = name_in_allow_out(*pol, q->name);
      if (!pol->internet && !named) {
        ++refused_;
        reply(from, dns_error_reply(msg, 5));
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
      p.client_id = q->id;
      p.upstream_id = random_id();
      p.allow_out_name = named;
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
