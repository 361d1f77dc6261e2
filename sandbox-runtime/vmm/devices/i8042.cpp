// I8042: controller commands and the reset line.
#include "sandbox-runtime/vmm/devices/i8042.h"

namespace sg::vmm {

I8042::I8042(std::function<void()> on_reset) : on_reset_(std::move(on_reset)) {}

void I8042::read(uint64_t offset, uint8_t* data, size_t len) {
  std::lock_guard lock(mu_);
  uint8_t v = 0xff;
  if (offset == 0) {
    v = out_;
    out_full_ = false;
  } else if (offset == 4) {
    v = static_cast<uint8_t>(0x04 | (out_full_ ? 0x01 : 0x00));
  }
  for (size_t i = 0; i < len; ++i) data[i] = i == 0 ? v : 0xff;
}

void I8042::write(uint64_t offset, const uint8_t* data, size_t len) {
  if (len == 0) return;
  uint8_t v = data[0];
  bool reset = false;
  {
    std::lock_guard lock(mu_);
    auto reply = [&](uint8_t b) {
      out_ = b;
      out_full_ = true;
    };
    if (offset == 0) {
      if (want_ctr_) ctr_ = v;
      want_ctr_ = false;  // bytes for absent keyboard/mouse are dropped
    } else if (offset == 4) {
      switch (v) {
        case 0x20: reply(ctr_); break;
        case 0x60: want_ctr_ = true; break;
        case 0xaa: reply(0x55); break;
        case 0xa9:
        case 0xab: reply(0x00); break;
        case 0xfe: reset = true; break;
        default: break;  // 0xad/0xae/0xa7/0xa8 and the rest: accepted, no reply
      }
    }
  }
  if (reset && on_reset_) on_reset_();
}

}  // namespace sg::vmm
