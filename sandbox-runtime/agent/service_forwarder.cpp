// ServiceForwarder implementation (service_forwarder.h).
#include "sandbox-runtime/agent/service_forwarder.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "sandbox-runtime/channel/services.h"
#include "base/log.h"
#include "base/sys.h"

namespace sg::agent {

ServiceForwarder::ServiceForwarder(channel::Mux& mux, std::string service, size_t max_open)
    : mux_(mux),
      service_(std::move(service)),
      open_payload_(channel::service_open_payload(service_)),
      max_open_(max_open) {}

Status ServiceForwarder::listen(uint16_t port) {
  std::string what = "127.0.0.1:" + std::to_string(port) + " (" + service_ + ")";
  UniqueFd s(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!s) return sys::errno_error("socket", what);
  int one = 1;
  ::setsockopt(s.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  struct sockaddr_in a;
  std::memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  // SAFETY: a is a fully initialised sockaddr_in and its size is passed.
  if (::bind(s.get(), reinterpret_cast<const struct sockaddr*>(&a), sizeof a) != 0)
    return sys::errno_error("bind", what);
  if (::listen(s.get(), kBacklog) != 0) return sys::errno_error("listen", what);
  socklen_t len = sizeof a;
  // SAFETY: a and len describe a sockaddr_in the kernel fills.
  if (::getsockname(s.get(), reinterpret_cast<struct sockaddr*>(&a), &len) != 0)
    return sys::errno_error("getsockname", what);
  UniqueFd spare(::eventfd(0, EFD_CLOEXEC));
  if (!spare) return sys::errno_error("eventfd", "spare fd for " + what);
  listener_ = std::move(s);
  spare_ = std::move(spare);
  port_ = ntohs(a.sin_port);
  return Status::Ok();
}

void ServiceForwarder::refuse(UniqueFd conn, const std::string& why) {
  ++stats_.refused;
  LOG_DEBUG("agent: " << service_ << " connection refused: " << why);
  // SO_LINGER 0: the client sees a reset rather than an EOF it might take
  // for an empty answer.
  struct linger lg = {1, 0};
  ::setsockopt(conn.get(), SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
}

bool ServiceForwarder::drop_one_without_fds() {
  spare_.reset();
  UniqueFd c(::accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
  bool dropped = c.valid();
  if (dropped) {
    ++stats_.refused;
    if (!warned_no_fds_) {
      LOG_WARN("agent: " << service_ << ": out of file descriptors; resetting connections until some close");
      warned_no_fds_ = true;
    }
    struct linger lg = {1, 0};
    ::setsockopt(c.get(), SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
  }
  c.reset();
  spare_.reset(::eventfd(0, EFD_CLOEXEC));
  return dropped;
}

void ServiceForwarder::on_readable() {
  // Streams queued in this call are not in stats().open_streams until the
  // Mux's next round, which comes before this handler runs again.
  size_t queued = 0;
  for (int i = 0; i < kAcceptsPerRound; ++i) {
    UniqueFd c(::accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (!c) {
      int err = errno;
      if (err == EAGAIN || err == EWOULDBLOCK) return;
      if (err == EINTR || err == ECONNABORTED) continue;
      // The fd is allocated before the queue is looked at: EMFILE also
      // means "maybe nothing pending", which the spare's accept tells.
      if ((err == EMFILE || err == ENFILE) && spare_) {
        if (drop_one_without_fds()) continue;
        return;
      }
      // ENOBUFS, ENOMEM, or no spare: the pending connection stays; the
      // bound above keeps this from monopolising the loop.
      LOG_DEBUG("agent: " << service_ << ": accept: " << std::strerror(err));
      return;
    }
    warned_no_fds_ = false;
    if (mux_.stats().open_streams + queued >= max_open_) {
      refuse(std::move(c), "stream budget of " + std::to_string(max_open_) + " spent");
      continue;
    }
    // Relayed bytes arrive in pieces (request head, then body): no Nagle
    // delay between them.
    int one = 1;
    ::setsockopt(c.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    auto id = mux_.open_stream(std::move(c), open_payload_);
    if (!id) {
      // open_stream consumed the fd: closing it is what the client sees.
      ++stats_.refused;
      LOG_DEBUG("agent: " << service_ << " connection refused: " << id.error().message());
      continue;
    }
    ++queued;
    ++stats_.forwarded;
  }
}

}  // namespace sg::agent
