// Serial: 16550A transmit path with the THR-empty interrupt.
#include "sandbox-runtime/vmm/devices/serial.h"

#include <unistd.h>

namespace sg::vmm {

namespace {
constexpr uint8_t kLcrDlab = 0x80;
constexpr uint8_t kIerThre = 0x02;
constexpr uint8_t kIirNone = 0x01, kIirThre = 0x02, kIirFifo = 0xc0;
constexpr uint8_t kLsrThre = 0x20, kLsrTemt = 0x40;
constexpr uint8_t kMsrDefault = 0xb0;  // DCD | DSR | CTS
}  // namespace

Serial::Serial(int sink_fd, IrqLine* irq, uint64_t out_limit) : sink_fd_(sink_fd), irq_(irq), out_limit_(out_limit) {}

void Serial::emit(uint8_t byte) {
  if (written_ >= out_limit_ || sink_fd_ < 0) {
    ++dropped_;
    return;
  }
  // The sink is a regular file: a short or failed write drops the byte.
  if (::write(sink_fd_, &byte, 1) == 1) ++written_;
  else ++dropped_;
}

void Serial::read(uint64_t offset, uint8_t* data, size_t len) {
  std::lock_guard lock(mu_);
  uint8_t v = 0;
  switch (offset) {
    case 0: v = (lcr_ & kLcrDlab) ? dll_ : 0; break;
    case 1: v = (lcr_ & kLcrDlab) ? dlm_ : ier_; break;
    case 2:
      if (thre_pending_ && (ier_ & kIerThre)) {
        v = kIirThre | kIirFifo;
        thre_pending_ = false;  // reading IIR clears a THR-empty interrupt
      } else {
        v = kIirNone | kIirFifo;
      }
      break;
    case 3: v = lcr_; break;
    case 4: v = mcr_; break;
    case 5: v = kLsrThre | kLsrTemt; break;
    case 6: v = kMsrDefault; break;
    case 7: v = scr_; break;
    default: v = 0xff;
  }
  for (size_t i = 0; i < len; ++i) data[i] = i == 0 ? v : 0xff;
}

void Serial::write(uint64_t offset, const uint8_t* data, size_t len) {
  if (len == 0) return;
  uint8_t v = data[0];
  bool raise = false;
  {
    std::lock_guard lock(mu_);
    switch (offset) {
      case 0:
        if (lcr_ & kLcrDlab) {
          dll_ = v;
        } else {
          emit(v);
          // The byte left at once: THR is empty again.
          thre_pending_ = true;
          raise = (ier_ & kIerThre) != 0;
        }
        break;
      case 1:
        if (lcr_ & kLcrDlab) {
          dlm_ = v;
        } else {
          bool was = ier_ & kIerThre;
          ier_ = v & 0x0f;
          if ((ier_ & kIerThre) && !was) {
            thre_pending_ = true;
            raise = true;
          }
        }
        break;
      case 2: break;  // FCR: FIFO control, nothing to do
      case 3: lcr_ = v; break;
      case 4: mcr_ = v; break;
      case 7: scr_ = v; break;
      default: break;  // LSR/MSR are read-only
    }
  }
  if (raise && irq_) irq_->trigger();
}

uint64_t Serial::bytes_written() const {
  std::lock_guard lock(mu_);
  return written_;
}
uint64_t Serial::bytes_dropped() const {
  std::lock_guard lock(mu_);
  return dropped_;
}

void Serial::save(StateWriter& w) const {
  std::lock_guard lock(mu_);
  w.put(ier_), w.put(lcr_), w.put(mcr_), w.put(scr_), w.put(dll_), w.put(dlm_);
  w.put(static_cast<uint8_t>(thre_pending_));
}

bool Serial::restore(StateReader& r) {
  std::lock_guard lock(mu_);
  uint8_t thre = 0;
  if (!(r.get(&ier_) && r.get(&lcr_) && r.get(&mcr_) && r.get(&scr_) && r.get(&dll_) && r.get(&dlm_) && r.get(&thre))) return false;
  ier_ &= 0x0f;
  thre_pending_ = thre != 0;
  return true;
}

}  // namespace sg::vmm
