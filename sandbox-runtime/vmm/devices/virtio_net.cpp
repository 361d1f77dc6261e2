// VirtioNet: frames between the guest's rings and a TAP device.
#include "sandbox-runtime/vmm/devices/virtio_net.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "base/log.h"
#include "base/sys.h"

namespace sg::vmm {

VirtioNet::VirtioNet(int tap_fd, const Mac& mac, uint16_t mtu)
    : fd_(tap_fd), mac_(mac), mtu_(std::clamp<uint16_t>(mtu, 68, 65521)) {}

VirtioNet::~VirtioNet() { stop(); }

bool VirtioNet::parse_mac(const std::string& s, Mac* out) {
  Mac m{};
  if (s.size() != 17) return false;
  for (size_t i = 0; i < 6; ++i) {
    auto hex = [](char c) -> int {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      if (c >= 'A' && c <= 'F') return c - 'A' + 10;
      return -1;
    };
    int hi = hex(s[3 * i]), lo = hex(s[3 * i + 1]);
    if (hi < 0 || lo < 0 || (i < 5 && s[3 * i + 2] != ':')) return false;
    m[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  if (m[0] & 1) return false;  // multicast (and broadcast)
  *out = m;
  return true;
}

Status VirtioNet::start(VirtioMmio& transport) {
  transport_ = &transport;
  if (fd_ >= 0) {
    int fl = ::fcntl(fd_, F_GETFL);
    if (fl < 0 || ::fcntl(fd_, F_SETFL, fl | O_NONBLOCK) < 0) return sys::errno_error("fcntl O_NONBLOCK", "tap");
  }
  wake_fd_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_fd_) return sys::errno_error("eventfd", "net");
  tx_buf_.reserve(kHdrLen + kMaxFrame);
  rx_buf_.resize(kMaxFrame);
  thread_ = std::thread([this] { loop(); });
  return {};
}

void VirtioNet::stop() {
  if (!thread_.joinable()) return;
  stopping_ = true;
  wake();
  thread_.join();
}

void VirtioNet::wake() {
  if (!wake_fd_) return;
  uint64_t one = 1;
  (void)!::write(wake_fd_.get(), &one, sizeof one);
}

void VirtioNet::set_paused(bool paused) {
  if (!transport_) return;
  {
    auto lock = transport_->lock();
    paused_ = paused;
  }
  wake();
}

void VirtioNet::read_config(uint64_t offset, uint8_t* data, size_t len) {
  uint8_t cfg[12] = {};
  std::memcpy(cfg, mac_.data(), 6);
  // status (6) 0: STATUS is not offered; max_virtqueue_pairs (8) 1.
  cfg[8] = 1;
  cfg[10] = static_cast<uint8_t>(mtu_);
  cfg[11] = static_cast<uint8_t>(mtu_ >> 8);
  for (size_t i = 0; i < len; ++i) data[i] = offset + i < sizeof cfg ? cfg[offset + i] : 0;
}

void VirtioNet::take_tx(VirtioMmio& t) {
  if (!t.active()) return;
  Virtqueue& q = t.queue(1);
  const GuestMemory& mem = t.memory();
  bool any = false;
  while (auto c = q.pop(mem)) {
    any = true;
    uint64_t bytes = c->valid ? c->readable_bytes() : 0;
    if (bytes < kHdrLen + kEthHdrLen || bytes > kHdrLen + kMaxFrame) {
      ++tx_dropped_;
      q.add_used(mem, c->head, 0);
      continue;
    }
    tx_buf_.clear();
    for (const Descriptor& d : c->descs)
      if (!d.write) {
        const auto* p = mem.span(d.addr, d.len);
        tx_buf_.insert(tx_buf_.end(), p, p + d.len);
      }
    q.add_used(mem, c->head, 0);
    size_t frame = tx_buf_.size() - kHdrLen;
    ssize_t n = -1;
    if (fd_ >= 0) {
      do n = ::write(fd_, tx_buf_.data() + kHdrLen, frame);
      while (n < 0 && errno == EINTR);
    }
    if (n == static_cast<ssize_t>(frame)) {
      ++tx_frames_;
      tx_bytes_ += frame;
    } else {
      ++tx_dropped_;  // no TAP, its queue full, or the link down
    }
  }
  if (q.broken()) t.needs_reset();
  if (any) t.signal_used(1);
}

bool VirtioNet::fill_rx(VirtioMmio& t) {
  Virtqueue& q = t.queue(0);
  const GuestMemory& mem = t.memory();
  bool any = false, more = true;
  for (size_t i = 0; i < kRxBatch; ++i) {
    if (!q.has_available(mem)) {
      more = false;
      break;
    }
    ssize_t n = ::read(fd_, rx_buf_.data(), rx_buf_.size());
    if (n < 0 && errno == EINTR) continue;
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) {
      // A TAP never reads 0 bytes: the host end is gone.
      LOG_WARN("vmm: read from the TAP device: " << (n == 0 ? "end of file" : std::strerror(errno))
                                                 << "; the guest's network is down");
      fd_ = -1;
    }
    if (n <= 0) {
      more = false;  // drained (or gone)
      break;
    }
    auto c = q.pop(mem);
    if (!c) break;
    auto frame = static_cast<size_t>(n);
    if (!c->valid || c->writable_bytes() < kHdrLen + frame) {
      ++rx_dropped_;
      if (c->valid) {
        q.undo_pop();  // a frame too large for it: the chain serves the next one
      } else {
        q.add_used(mem, c->head, 0);
        any = true;
      }
      continue;
    }
    uint8_t hdr[kHdrLen] = {};
    hdr[10] = 1;  // num_buffers
    size_t put = 0;
    for (const Descriptor& d : c->descs) {
      if (!d.write) continue;
      uint8_t* dst = mem.span(d.addr, d.len);
      size_t k = 0;
      if (put < kHdrLen) {
        k = std::min<size_t>(d.len, kHdrLen - put);
        std::memcpy(dst, hdr + put, k);
        put += k;
      }
      if (put >= kHdrLen && k < d.len && put - kHdrLen < frame) {
        size_t m = std::min<size_t>(d.len - k, frame - (put - kHdrLen));
        std::memcpy(dst + k, rx_buf_.data() + (put - kHdrLen), m);
        put += m;
      }
      if (put == kHdrLen + frame) break;
    }
    q.add_used(mem, c->head, static_cast<uint32_t>(put));
    any = true;
    ++rx_frames_;
    rx_bytes_ += frame;
  }
  if (q.broken()) t.needs_reset();
  if (any) t.signal_used(0);
  return more;
}

void VirtioNet::queue_notify(VirtioMmio& t, size_t queue) {
  if (queue == 1)
    take_tx(t);
  else if (queue == 0)
    wake();  // new receive buffers: the I/O thread may read again
}

void VirtioNet::loop() {
  while (!stopping_) {
    bool want = false;
    {
      auto lock = transport_->lock();
      if (fd_ >= 0 && !paused_ && transport_->active()) {
        // Frames the TAP holds while buffers are posted: take a batch,
        // and go round again without sleeping while there may be more.
        if (transport_->queue(0).has_available(transport_->memory())) {
          want = true;
          if (fill_rx(*transport_)) continue;
          want = transport_->queue(0).has_available(transport_->memory());
        }
      }
    }
    struct pollfd p[2] = {{wake_fd_.get(), POLLIN, 0}, {fd_, POLLIN, 0}};
    int n = ::poll(p, want ? 2 : 1, -1);
    if (n < 0 && errno != EINTR) {
      LOG_ERROR("vmm: net poll: " << std::strerror(errno));
      return;
    }
    if (p[0].revents) {
      uint64_t v;
      (void)!::read(wake_fd_.get(), &v, sizeof v);
    }
    if (want && (p[1].revents & (POLLERR | POLLHUP | POLLNVAL)) && !(p[1].revents & POLLIN)) {
      LOG_WARN("vmm: the TAP device went away; the guest's network is down");
      auto lock = transport_->lock();
      fd_ = -1;
    }
  }
}

VirtioNet::Counters VirtioNet::counters() const {
  return {tx_frames_.load(), tx_bytes_.load(), tx_dropped_.load(), rx_frames_.load(), rx_bytes_.load(),
          rx_dropped_.load()};
}

void VirtioNet::save(StateWriter& w) const {
  w.put(mac_);
  w.put(mtu_);
}

bool VirtioNet::restore(StateReader& r) {
  Mac mac{};
  uint16_t mtu = 0;
  if (!r.get(&mac) || !r.get(&mtu) || mtu < 68 || mtu > 65521 || (mac[0] & 1)) return false;
  mac_ = mac;
  mtu_ = mtu;
  return true;
}

}  // namespace sg::vmm
