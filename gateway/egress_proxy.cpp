// The egress proxy (egress_proxy.h).
#include "gateway/egress_proxy.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "base/log.h"
#include "base/sys.h"

namespace sg::gateway {

namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kMaxHead = network::kMaxEgressHead;
constexpr size_t kRelayBuf = 64 * 1024;

int ms_left(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<long long>(left, 60000));
}

// Blocking-with-deadline I/O on a non-blocking fd.
bool wait_for(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    int left = ms_left(deadline);
    if (left == 0) return false;
    struct pollfd p = {fd, events, 0};
    int n = ::poll(&p, 1, left);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return false;
    if (n > 0) return true;
  }
}

bool write_all(int fd, std::string_view data, Clock::time_point deadline) {
  while (!data.empty()) {
    ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n > 0) {
      data.remove_prefix(static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && wait_for(fd, POLLOUT, deadline)) continue;
    return false;
  }
  return true;
}

void respond(int fd, int code, const char* reason, const std::string& message) {
  std::string body = message + "\n";
  std::string r = "HTTP/1.1 " + std::to_string(code) + " " + reason +
                  "\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: " + std::to_string(body.size()) +
                  "\r\nConnection: close\r\n\r\n" + body;
  (void)write_all(fd, r, Clock::now() + std::chrono::seconds(5));
}

// The request head (through the blank line) and the bytes after it.
bool read_head(int fd, Clock::time_point deadline, std::string* head, std::string* rest) {
  std::string buf;
  char tmp[4096];
  for (;;) {
    size_t end = buf.find("\r\n\r\n");
    if (end != std::string::npos) {
      *head = buf.substr(0, end + 4);
      *rest = buf.substr(end + 4);
      return true;
    }
    if (buf.size() > kMaxHead) return false;
    ssize_t n = ::recv(fd, tmp, sizeof tmp, 0);
    if (n > 0) {
      buf.append(tmp, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && wait_for(fd, POLLIN, deadline)) continue;
    return false;
  }
}

Result<std::vector<std::array<uint8_t, 16>>> system_resolve(const std::string& host) {
  std::vector<std::array<uint8_t, 16>> out;
  if (auto a = network::parse_ip(host)) return std::vector<std::array<uint8_t, 16>>{*a};
  struct addrinfo hints {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  struct addrinfo* res = nullptr;
  int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0) return Error(ErrorKind::kNotFound, "cannot resolve " + host + ": " + ::gai_strerror(rc));
  for (struct addrinfo* r = res; r; r = r->ai_next) {
    std::array<uint8_t, 16> a{};
    if (r->ai_family == AF_INET) {
      a = network::v4_mapped(&reinterpret_cast<sockaddr_in*>(r->ai_addr)->sin_addr);
    } else if (r->ai_family == AF_INET6) {
      std::memcpy(a.data(), &reinterpret_cast<sockaddr_in6*>(r->ai_addr)->sin6_addr, 16);
    } else {
      continue;
    }
    if (std::find(out.begin(), out.end(), a) == out.end()) out.push_back(a);
  }
  ::freeaddrinfo(res);
  if (out.empty()) return Error(ErrorKind::kNotFound, "cannot resolve " + host + ": no address");
  return out;
}

Result<UniqueFd> connect_to(const std::array<uint8_t, 16>& a, uint16_t port, std::chrono::milliseconds timeout) {
  bool v4 = network::is_v4_mapped(a);
  sockaddr_storage ss{};
  socklen_t len;
  if (v4) {
    auto* s4 = reinterpret_cast<sockaddr_in*>(&ss);
    s4->sin_family = AF_INET;
    s4->sin_port = htons(port);
    std::memcpy(&s4->sin_addr, a.data() + 12, 4);
    len = sizeof *s4;
  } else {
    auto* s6 = reinterpret_cast<sockaddr_in6*>(&ss);
    s6->sin6_family = AF_INET6;
    s6->sin6_port = htons(port);
    std::memcpy(&s6->sin6_addr, a.data(), 16);
    len = sizeof *s6;
  }
  UniqueFd fd(::socket(v4 ? AF_INET : AF_INET6, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd) return sys::errno_error("socket", "egress");
  int one = 1;
  ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  // SAFETY: ss holds a sockaddr_in or sockaddr_in6 of length len.
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&ss), len) != 0) {
    if (errno != EINPROGRESS) return sys::errno_error("connect", "egress destination");
    if (!wait_for(fd.get(), POLLOUT, Clock::now() + timeout))
      return Error(ErrorKind::kTimeout, "connect timed out after " + std::to_string(timeout.count()) + " ms");
    int err = 0;
    socklen_t el = sizeof err;
    if (::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &el) != 0) err = errno;
    if (err != 0) return sys::errno_error("connect", "egress destination", err);
  }
  return fd;
}

// Both directions until each has ended (half-closes passed on) or nothing
// moved for idle. Counts the bytes.
void relay(int a, int b, std::chrono::milliseconds idle, uint64_t* a_to_b, uint64_t* b_to_a) {
  std::string buf_ab, buf_ba;  // pending writes
  bool a_eof = false, b_eof = false, ab_shut = false, ba_shut = false;
  std::vector<char> tmp(kRelayBuf);
  for (;;) {
    if (a_eof && buf_ab.empty() && !ab_shut) {
      ::shutdown(b, SHUT_WR);
      ab_shut = true;
    }
    if (b_eof && buf_ba.empty() && !ba_shut) {
      ::shutdown(a, SHUT_WR);
      ba_shut = true;
    }
    if (ab_shut && ba_shut) return;
    // An fd with nothing to read or write is left out, so a peer that is
    // gone (POLLHUP) cannot make the loop spin.
    struct pollfd p[2] = {{a, 0, 0}, {b, 0, 0}};
    if (!a_eof && buf_ab.size() < kRelayBuf) p[0].events |= POLLIN;
    if (!buf_ba.empty()) p[0].events |= POLLOUT;
    if (!b_eof && buf_ba.size() < kRelayBuf) p[1].events |= POLLIN;
    if (!buf_ab.empty()) p[1].events |= POLLOUT;
    for (auto& q : p)
      if (q.events == 0) q.fd = -1;
    int n = ::poll(p, 2, static_cast<int>(idle.count()));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // idle, or poll failed
    auto pump_in = [&](int fd, short rev, bool* eof, std::string* out) {
      if (!(rev & (POLLIN | POLLHUP | POLLERR)) || *eof) return true;
      ssize_t r = ::recv(fd, tmp.data(), tmp.size(), 0);
      if (r > 0) out->append(tmp.data(), static_cast<size_t>(r));
      else if (r == 0) *eof = true;
      else if (errno != EINTR && errno != EAGAIN) return false;
      return true;
    };
    auto pump_out = [&](int fd, short rev, std::string* pending, uint64_t* counter) {
      if (!(rev & (POLLOUT | POLLHUP | POLLERR)) || pending->empty()) return true;
      ssize_t w = ::send(fd, pending->data(), pending->size(), MSG_NOSIGNAL);
      if (w > 0) {
        pending->erase(0, static_cast<size_t>(w));
        *counter += static_cast<uint64_t>(w);
      } else if (w < 0 && errno != EINTR && errno != EAGAIN) {
        return false;
      }
      return true;
    };
    if (!pump_in(a, p[0].revents, &a_eof, &buf_ab) || !pump_in(b, p[1].revents, &b_eof, &buf_ba)) return;
    if (!pump_out(b, p[1].revents, &buf_ab, a_to_b) || !pump_out(a, p[0].revents, &buf_ba, b_to_a)) return;
  }
}

}  // namespace

EgressProxy::EgressProxy(EgressConfig cfg, network::EgressPolicies& policies, Resolver resolve)
    : cfg_(std::move(cfg)), policies_(policies), resolve_(resolve ? std::move(resolve) : Resolver(system_resolve)) {
  policies_.listen(this);
}

EgressProxy::~EgressProxy() {
  policies_.unlisten(this);
  std::unique_lock<std::mutex> l(mu_);
  stopping_ = true;
  for (const auto& [fd, o] : open_) ::shutdown(fd, SHUT_RDWR);
  cv_.wait(l, [&] { return threads_ == 0; });
}

EgressStats EgressProxy::stats() {
  std::lock_guard<std::mutex> l(mu_);
  return stats_;
}

void EgressProxy::adopt(UniqueFd conn, const std::string& sandbox_id) {
  int fl = ::fcntl(conn.get(), F_GETFL);
  if (fl < 0 || ::fcntl(conn.get(), F_SETFL, fl | O_NONBLOCK) != 0) return;
  bool refused = false;
  {
    std::lock_guard<std::mutex> l(mu_);
    ++stats_.connections;
    size_t& mine = per_sandbox_[sandbox_id];
    if (stopping_ || mine >= cfg_.max_per_sandbox || threads_ >= cfg_.max_total) {
      ++stats_.refused;
      if (mine == 0) per_sandbox_.erase(sandbox_id);
      refused = true;
    } else {
      ++mine;
      ++threads_;
      open_[conn.get()].sandbox_id = sandbox_id;
    }
  }
  if (refused) {  // written outside the lock: the sandbox may not read it
    respond(conn.get(), 429, "Too Many Requests", "too many egress connections from this sandbox at once");
    return;
  }
  std::thread([this, fd = conn.release(), sandbox_id] {
    serve(fd, sandbox_id);
    std::lock_guard<std::mutex> l(mu_);
    open_.erase(fd);
    ::close(fd);
    if (--per_sandbox_[sandbox_id] == 0) per_sandbox_.erase(sandbox_id);
    --threads_;
    cv_.notify_all();
  }).detach();
}

void EgressProxy::recheck(const std::string& sandbox_id) {
  std::optional<network::EgressPolicy> pol = policies_.get(sandbox_id);  // not under mu_
  std::lock_guard<std::mutex> l(mu_);
  for (const auto& [fd, o] : open_) {
    if (o.sandbox_id != sandbox_id || !o.decided) continue;
    if (pol && network::decide_egress(*pol, o.host, o.addr, cfg_.allow_internal).allowed) continue;
    LOG_INFO("sandbox " << sandbox_id << ": egress to " << o.host << " closed: the new network policy refuses it");
    ::shutdown(fd, SHUT_RDWR);  // its relay sees the end; the thread closes it
  }
}

void EgressProxy::serve(int fd, const std::string& sandbox_id) {
  auto count = [&](uint64_t EgressStats::*field) {
    std::lock_guard<std::mutex> l(mu_);
    ++(stats_.*field);
  };
  std::string head, rest;
  if (!read_head(fd, Clock::now() + cfg_.head_timeout, &head, &rest)) {
    count(&EgressStats::failed);
    respond(fd, 400, "Bad Request", "no complete proxy request head (at most 16 KiB) within the time limit");
    return;
  }
  Result<network::EgressRequest> t = network::parse_egress_request(head);
  if (!t) {
    count(&EgressStats::failed);
    respond(fd, 400, "Bad Request", t.error().message());
    return;
  }
  auto addrs = resolve_(t->host);
  if (!addrs) {
    count(&EgressStats::failed);
    respond(fd, 502, "Bad Gateway", addrs.error().message());
    return;
  }
  // From here a policy update decides this connection again (recheck):
  // marked before the policy is read, so an update after that reading
  // finds it, and one before is in it. A connection recheck refuses has
  // its client end shut: the writes below fail.
  auto watch = [&](const std::array<uint8_t, 16>& a) {
    std::lock_guard<std::mutex> l(mu_);
    Open& o = open_[fd];
    o.decided = true;
    o.host = t->host;
    o.addr = a;
  };
  watch(addrs->front());
  std::optional<network::EgressPolicy> pol = policies_.get(sandbox_id);
  if (!pol) {
    count(&EgressStats::denied);
    respond(fd, 403, "Forbidden", "this sandbox has no network egress");
    return;
  }
  // Every address the name has must be allowed: a name cannot smuggle an
  // internal address in beside a public one.
  for (const auto& a : *addrs) {
    network::EgressDecision d = network::decide_egress(*pol, t->host, a, cfg_.allow_internal);
    if (!d.allowed) {
      count(&EgressStats::denied);
      LOG_DEBUG("sandbox " << sandbox_id << ": egress " << d.why);
      respond(fd, 403, "Forbidden", d.why);
      return;
    }
  }
  Result<UniqueFd> up = Error(ErrorKind::kUnavailable, "no address");
  for (const auto& a : *addrs) {
    watch(a);
    up = connect_to(a, t->port, cfg_.connect_timeout);
    if (up) break;
  }
  if (!up) {
    count(&EgressStats::failed);
    bool timeout = up.error().kind() == ErrorKind::kTimeout;
    respond(fd, timeout ? 504 : 502, timeout ? "Gateway Timeout" : "Bad Gateway",
            t->host + ":" + std::to_string(t->port) + ": " + up.error().message());
    return;
  }
  count(&EgressStats::allowed);
  auto deadline = Clock::now() + cfg_.connect_timeout;
  if (t->tunnel) {
    if (!write_all(fd, "HTTP/1.1 200 Connection Established\r\n\r\n", deadline)) return;
    if (!rest.empty() && !write_all(up->get(), rest, deadline)) return;
  } else {
    if (!write_all(up->get(), t->origin_head + rest, deadline)) return;
  }
  uint64_t out = rest.size(), in = 0;
  relay(fd, up->get(), cfg_.idle_timeout, &out, &in);
  std::lock_guard<std::mutex> l(mu_);
  stats_.bytes_out += out;
  stats_.bytes_in += in;
}

}  // namespace sg::gateway
