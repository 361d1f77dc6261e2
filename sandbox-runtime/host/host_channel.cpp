// HostChannel implementation (host_channel.h).
#include "sandbox-runtime/host/host_channel.h"

#include <poll.h>

#include <cerrno>
#include <nlohmann/json.hpp>

#include "sandbox-runtime/channel/control_message.h"
#include "sandbox-runtime/channel/frame.h"
#include "sandbox-runtime/channel/services.h"

#include <sys/socket.h>

#include "base/log.h"
#include "base/sys.h"

namespace sg::process {

namespace {

channel::MuxConfig host_config(int fd) {
  channel::MuxConfig c;
  c.channel_fd = fd;
  c.odd_ids = true;
  return c;
}

}  // namespace

namespace {

// Reads exactly n bytes from a (blocking or not) fd before the deadline,
// watching pidfd for the agent's death. Never reads past n, so bytes after
// the ready frame stay in the socket for the channel's owner.
Status read_exact(int fd, int pidfd, char* buf, size_t n, uint64_t deadline_ns) {
  size_t got = 0;
  while (got < n) {
    uint64_t now = sys::monotonic_ns();
    if (now >= deadline_ns) return Error(ErrorKind::kTimeout, "timed out waiting for the agent's ready message");
    struct pollfd p[2] = {{fd, POLLIN, 0}, {pidfd, POLLIN, 0}};
    int r = ::poll(p, 2, static_cast<int>((deadline_ns - now) / 1000000 + 1));
    if (r < 0) {
      if (errno == EINTR) continue;
      return sys::errno_error("poll", "channel");
    }
    if (p[0].revents & (POLLIN | POLLHUP | POLLERR)) {
      ssize_t k = ::recv(fd, buf + got, n - got, MSG_DONTWAIT);
      if (k < 0) {
        if (errno == EINTR || errno == EAGAIN) continue;
        return sys::errno_error("read", "channel");
      }
      if (k == 0) {
        return internal_error("agent closed the channel before sending ready");
      }
      got += static_cast<size_t>(k);
      continue;
    }
    if (p[1].revents & POLLIN) {
      return internal_error("agent exited before sending ready");
    }
  }
  return Status::Ok();
}

}  // namespace

Status read_ready_frame(int channel_fd, int exit_fd, uint64_t deadline) {
  // Header first, then exactly its payload.
  char head[channel::kHeaderSize];
  if (Status s = read_exact(channel_fd, exit_fd, head, sizeof head, deadline); !s) return s;
  std::string frame(head, sizeof head);
  channel::DecodeResult dr = channel::decode(frame);
  if (dr.status == channel::DecodeStatus::kInvalid) return internal_error("agent sent an invalid frame: " + dr.error);
  if (dr.status == channel::DecodeStatus::kNeedMore) {
    size_t len = static_cast<uint8_t>(head[8]) | (static_cast<uint8_t>(head[9]) << 8) |
                 (static_cast<uint8_t>(head[10]) << 16) | (static_cast<size_t>(static_cast<uint8_t>(head[11])) << 24);
    frame.resize(sizeof head + len);
    if (Status s = read_exact(channel_fd, exit_fd, frame.data() + sizeof head, len, deadline); !s) return s;
    dr = channel::decode(frame);
  }
  if (dr.status != channel::DecodeStatus::kOk || dr.frame.stream != channel::kControlStream ||
      dr.frame.type != channel::FrameType::kData)
    return internal_error("agent's first frame is not a control message");
  auto msg = nlohmann::json::parse(dr.frame.payload, nullptr, false);
  if (channel::control_type(msg) != "ready")
    return internal_error("agent's first message is not \"ready\": " + dr.frame.payload.substr(0, 200));
  return {};
}

HostChannel::HostChannel(std::string sandbox_id, int channel_fd, runtime::ServiceOpener open_service)
    : id_(std::move(sandbox_id)),
      channel_fd_(channel_fd),
      open_service_(std::move(open_service)),
      mux_(
          host_config(channel_fd), [this](std::string_view p) { return on_agent_open(p); },
          [this](std::string_view p) { on_control(p); }) {
  thread_ = std::thread([this] { loop(); });
}

// Streams the agent opens: a sandbox process connected to a gateway
// service. The payload comes from the sandbox: parsed strictly, and the
// error messages (RESET reasons) never carry the payload back.
Result<UniqueFd> HostChannel::on_agent_open(std::string_view payload) {
  if (!open_service_) return not_found_error("no gateway services on this host");
  Result<std::string> service = channel::parse_service_open(payload);
  if (!service) return service.error();
  Result<UniqueFd> fd = open_service_(id_, *service);
  if (!fd) LOG_DEBUG("sandbox " << id_ << ": service " << *service << " refused: " << fd.error().message());
  return fd;
}

HostChannel::~HostChannel() { stop(); }

void HostChannel::loop() {
  Status s = mux_.run();
  std::string reason = "channel to the agent is closed";
  if (!s) {
    LOG_WARN("sandbox " << id_ << ": channel: " << s.error().message() << "; closing it");
    reason += " (" + s.error().message() + ")";
    // Framing is lost or the agent stopped reading: close our side so the
    // agent sees EOF and takes the sandbox's processes down.
    ::shutdown(channel_fd_, SHUT_RDWR);
  } else if (!stopping_) {
    // EOF from the agent's side: the sandbox (its agent, or the VMM) ended.
    LOG_WARN("sandbox " << id_ << ": the agent's end of the channel closed");
  }
  std::lock_guard<std::mutex> l(mu_);
  ended_ = true;
  end_reason_ = reason;
  for (auto& w : waiters_) w->done = true;
  waiters_.clear();
  cv_.notify_all();
}

void HostChannel::on_control(std::string_view payload) {
  std::lock_guard<std::mutex> l(mu_);
  if (waiters_.empty()) {
    LOG_DEBUG("sandbox " << id_ << ": unsolicited control message dropped: " << payload.substr(0, 200));
    return;
  }
  std::shared_ptr<Waiter> w = std::move(waiters_.front());
  waiters_.pop_front();
  if (w->abandoned) return;
  w->reply = std::string(payload);
  w->done = true;
  cv_.notify_all();
}

Result<UniqueFd> HostChannel::open_port(uint16_t port) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
    return sys::errno_error("socketpair", "port " + std::to_string(port));
  UniqueFd mine(sv[0]), theirs(sv[1]);
  auto id = mux_.open_stream(std::move(theirs), "{\"port\":" + std::to_string(port) + "}");
  if (!id) return id.error().with_context("sandbox " + id_ + ": open port " + std::to_string(port));
  return mine;
}

Result<std::string> HostChannel::control(std::string request, std::chrono::milliseconds timeout) {
  auto w = std::make_shared<Waiter>();
  std::unique_lock<std::mutex> l(mu_);
  if (ended_) return Error(ErrorKind::kUnavailable, "sandbox " + id_ + ": " + end_reason_);
  // Queued and sent under mu_, so the waiters' order is the requests' order.
  if (Status s = mux_.send_control(std::move(request)); !s) return s.error().with_context("sandbox " + id_);
  waiters_.push_back(w);
  if (!cv_.wait_for(l, timeout, [&] { return w->done; })) {
    w->abandoned = true;  // its reply, if it ever comes, is dropped
    return Error(ErrorKind::kTimeout, "sandbox " + id_ + ": no answer from the agent within " +
                                          std::to_string(timeout.count()) + " ms");
  }
  if (!w->reply) return Error(ErrorKind::kUnavailable, "sandbox " + id_ + ": " + end_reason_);
  return std::move(*w->reply);
}

void HostChannel::stop() {
  std::lock_guard<std::mutex> j(join_mu_);
  if (!thread_.joinable()) return;
  stopping_ = true;
  mux_.stop();
  thread_.join();
}

bool HostChannel::running() {
  std::lock_guard<std::mutex> l(mu_);
  return !ended_;
}

}  // namespace sg::process
