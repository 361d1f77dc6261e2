// VirtioConsole: the channel's byte pump between hvc0 and a host socket.
#include "sandbox-runtime/vmm/devices/virtio_console.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "base/log.h"
#include "base/sys.h"

namespace sg::vmm {

VirtioConsole::VirtioConsole(int fd, std::function<void(const std::string&)> on_disconnect)
    : fd_(fd), on_disconnect_(std::move(on_disconnect)) {}

VirtioConsole::~VirtioConsole() { stop(); }

Status VirtioConsole::start(VirtioMmio& transport) {
  transport_ = &transport;
  int fl = ::fcntl(fd_, F_GETFL);
  if (fl < 0 || ::fcntl(fd_, F_SETFL, fl | O_NONBLOCK) < 0) return sys::errno_error("fcntl O_NONBLOCK", "console socket");
  wake_fd_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_fd_) return sys::errno_error("eventfd", "console");
  thread_ = std::thread([this] { loop(); });
  return {};
}

void VirtioConsole::stop() {
  if (!thread_.joinable()) return;
  stopping_ = true;
  wake();
  thread_.join();
}

void VirtioConsole::wake() {
  if (!wake_fd_) return;
  uint64_t one = 1;
  (void)!::write(wake_fd_.get(), &one, sizeof one);
}

void VirtioConsole::set_paused(bool paused) {
  if (!transport_) return;  // not started: nothing moves data yet
  {
    auto lock = transport_->lock();
    paused_ = paused;
  }
  wake();
}

size_t VirtioConsole::FrameCursor::advance(const uint8_t* p, size_t n, bool stop_at_boundary) {
  size_t used = 0;
  while (used < n) {
    if (payload_left > 0) {
      size_t k = static_cast<size_t>(std::min<uint64_t>(payload_left, n - used));
      payload_left -= k;
      used += k;
    } else {
      hdr[hdr_have++] = p[used++];
      if (hdr_have < sizeof hdr) continue;
      hdr_have = 0;
      payload_left = static_cast<uint64_t>(hdr[8]) | (static_cast<uint64_t>(hdr[9]) << 8) |
                     (static_cast<uint64_t>(hdr[10]) << 16) | (static_cast<uint64_t>(hdr[11]) << 24);
    }
    if (stop_at_boundary && at_boundary()) break;
  }
  return used;
}

Status VirtioConsole::reattach(UniqueFd fd) {
  int fl = ::fcntl(fd.get(), F_GETFL);
  if (fl < 0 || ::fcntl(fd.get(), F_SETFL, fl | O_NONBLOCK) < 0) return sys::errno_error("fcntl O_NONBLOCK", "console socket");
  {
    auto lock = transport_->lock();
    if (!disconnected_) return conflict_error("the console still has its host");
    owned_fd_ = std::move(fd);
    fd_ = owned_fd_.get();
    // Guest bytes of a frame the old host got the start of go first.
    resync_ = !out_cursor_.at_boundary();
    disconnected_ = false;
  }
  wake();
  return {};
}

void VirtioConsole::read_config(uint64_t, uint8_t* data, size_t len) { std::memset(data, 0, len); }

void VirtioConsole::reset() {
  out_.clear();
  out_cursor_ = {};
  resync_ = false;
  in_.clear();
  in_whole_ = 0;
  in_cursor_ = {};
}

void VirtioConsole::disconnect(const std::string& why) {
  if (disconnected_) return;
  disconnected_ = true;
  // The frame the host was sending when it went: never seen by the guest.
  in_.resize(in_whole_);
  in_cursor_ = {};
  if (on_disconnect_) on_disconnect_(why);
}

void VirtioConsole::take_tx(VirtioMmio& t) {
  if (!t.active() || disconnected_) return;
  Virtqueue& q = t.queue(1);
  const GuestMemory& mem = t.memory();
  bool any = false;
  while (out_.size() < kOutMax) {
    auto c = q.pop(mem);
    if (!c) break;
    uint64_t bytes = c->valid ? c->readable_bytes() : 0;
    if (out_.size() + bytes > 2 * kOutMax) {
      if (!out_.empty()) {
        q.undo_pop();  // take it once the buffer has drained
        break;
      }
      // A single chain larger than the bound: the guest broke the rules
      // (Linux sends page-sized buffers); drop it rather than buffer it.
      ++dropped_chains_;
      bytes = 0;
    }
    any = true;
    if (bytes > 0)
      for (const Descriptor& d : c->descs)
        if (!d.write) out_.append(reinterpret_cast<const char*>(mem.span(d.addr, d.len)), d.len);
    q.add_used(mem, c->head, 0);
  }
  if (q.broken()) t.needs_reset();
  if (any) t.signal_used(1);
}

void VirtioConsole::flush_out() {
  while (!out_.empty() && !disconnected_) {
    if (resync_) {
      size_t k = out_cursor_.advance(reinterpret_cast<const uint8_t*>(out_.data()), out_.size(), true);
      out_.erase(0, k);
      if (out_cursor_.at_boundary()) resync_ = false;
      continue;
    }
    ssize_t n = ::write(fd_, out_.data(), out_.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) {
      disconnect(std::string("write to the host channel: ") + std::strerror(errno));
      return;
    }
    to_host_ += static_cast<uint64_t>(n);
    out_cursor_.advance(reinterpret_cast<const uint8_t*>(out_.data()), static_cast<size_t>(n), false);
    out_.erase(0, static_cast<size_t>(n));
  }
}

// Reads what the host sent into in_ (while there is room), then hands
// the whole frames in it to the guest.
void VirtioConsole::fill_rx(VirtioMmio& t) {
  if (!t.active()) return;
  while (!disconnected_ && in_.size() < kInMax) {
    char buf[kInMax];
    ssize_t n = ::read(fd_, buf, kInMax - in_.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (n <= 0) {
      disconnect(n == 0 ? "the host closed the channel" : std::string("read from the host channel: ") + std::strerror(errno));
      break;
    }
    size_t pos = in_.size();
    in_.append(buf, static_cast<size_t>(n));
    while (pos < in_.size()) {
      pos += in_cursor_.advance(reinterpret_cast<const uint8_t*>(in_.data()) + pos, in_.size() - pos, true);
      if (in_cursor_.at_boundary()) in_whole_ = pos;
    }
  }
  deliver(t);
}

void VirtioConsole::deliver(VirtioMmio& t) {
  if (!t.active() || in_whole_ == 0) return;
  Virtqueue& q = t.queue(0);
  const GuestMemory& mem = t.memory();
  bool any = false;
  size_t done = 0;
  while (done < in_whole_) {
    auto c = q.pop(mem);
    if (!c) break;
    any = true;
    size_t put = 0;
    if (c->valid)
      for (const Descriptor& d : c->descs) {
        if (!d.write || d.len == 0 || done + put >= in_whole_) continue;
        size_t k = std::min<size_t>(d.len, in_whole_ - done - put);
        std::memcpy(mem.span(d.addr, d.len), in_.data() + done + put, k);
        put += k;
      }
    done += put;
    q.add_used(mem, c->head, static_cast<uint32_t>(put));
  }
  if (done > 0) {
    to_guest_ += done;
    in_.erase(0, done);
    in_whole_ -= done;
  }
  if (q.broken()) t.needs_reset();
  if (any) t.signal_used(0);
}

void VirtioConsole::queue_notify(VirtioMmio& t, size_t queue) {
  if (queue == 1) {
    take_tx(t);
    flush_out();
    // The I/O thread waits for the socket to drain, and takes the chains
    // left in the ring when the buffer filled (the socket may have taken
    // the whole buffer just now: then nothing else would wake it).
    if (!out_.empty() || t.queue(1).has_available(t.memory())) wake();
  } else {
    wake();  // new receive buffers: the I/O thread may read again
  }
}

void VirtioConsole::loop() {
  while (!stopping_) {
    short events = 0;
    int fd = -1;
    {
      auto lock = transport_->lock();
      if (!paused_ && transport_->active() && in_whole_ > 0 && transport_->queue(0).has_available(transport_->memory()))
        deliver(*transport_);  // frames that came before the host went reach the guest still
      if (!paused_ && !disconnected_ && transport_->active()) {
        if (!out_.empty()) events |= POLLOUT;
        if (in_.size() < kInMax) events |= POLLIN;
        // Guest output waiting in the ring while the buffer was full: one
        // round is not enough when the socket takes the whole buffer, so
        // go on while the ring has chains and take_tx takes some.
        Virtqueue& tx = transport_->queue(1);
        while (!disconnected_ && out_.size() < kOutMax && tx.has_available(transport_->memory())) {
          uint16_t before = tx.next_avail;
          take_tx(*transport_);
          flush_out();
          if (tx.next_avail == before) break;  // deferred until the buffer drains
        }
        if (!out_.empty()) events |= POLLOUT;
      }
      fd = fd_;
    }
    struct pollfd p[2] = {{wake_fd_.get(), POLLIN, 0}, {fd, events, 0}};
    int n = ::poll(p, events ? 2 : 1, -1);
    if (n < 0 && errno != EINTR) {
      LOG_ERROR("vmm: console poll: " << std::strerror(errno));
      return;
    }
    if (p[0].revents) {
      uint64_t v;
      (void)!::read(wake_fd_.get(), &v, sizeof v);
    }
    if (!events || !p[1].revents) continue;
    auto lock = transport_->lock();
    if (paused_ || disconnected_ || fd != fd_) continue;  // a host went (or came) meanwhile
    if (p[1].revents & POLLOUT) {
      flush_out();
      take_tx(*transport_);
      flush_out();
    }
    if (p[1].revents & (POLLIN | POLLHUP | POLLERR)) fill_rx(*transport_);
    if ((p[1].revents & (POLLHUP | POLLERR)) && !(p[1].revents & POLLIN) && !disconnected_) disconnect("the host channel hung up");
  }
}

void VirtioConsole::save(StateWriter& w) const { w.put_bytes(out_); }

bool VirtioConsole::restore(StateReader& r) { return r.get_bytes(&out_, 2 * kOutMax); }

}  // namespace sg::vmm
