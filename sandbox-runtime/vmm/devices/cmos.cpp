// Cmos: wall-clock registers in BCD and CMOS RAM.
#include "sandbox-runtime/vmm/devices/cmos.h"

namespace sg::vmm {

namespace {
uint8_t bcd(int v) { return static_cast<uint8_t>(((v / 10) << 4) | (v % 10)); }
}  // namespace

Cmos::Cmos(std::function<int64_t()> now) : now_(std::move(now)) {
  if (!now_) now_ = [] { return static_cast<int64_t>(::time(nullptr)); };
}

uint8_t Cmos::reg(uint8_t index) {
  if (index <= 0x09 || index == 0x32) {
    time_t t = static_cast<time_t>(now_());
    struct tm tm {};
    ::gmtime_r(&t, &tm);
    switch (index) {
      case 0x00: return bcd(tm.tm_sec);
      case 0x02: return bcd(tm.tm_min);
      case 0x04: return bcd(tm.tm_hour);
      case 0x06: return bcd(tm.tm_wday + 1);
      case 0x07: return bcd(tm.tm_mday);
      case 0x08: return bcd(tm.tm_mon + 1);
      case 0x09: return bcd(tm.tm_year % 100);
      case 0x32: return bcd((tm.tm_year + 1900) / 100);
      default: return 0;  // alarm registers
    }
  }
  switch (index) {
    case 0x0a: return 0x26;
    case 0x0b: return 0x02;
    case 0x0c: return 0x00;
    case 0x0d: return 0x80;
    default: return ram_[index & 0x7f];
  }
}

void Cmos::read(uint64_t offset, uint8_t* data, size_t len) {
  std::lock_guard lock(mu_);
  uint8_t v = offset == 0 ? index_ : reg(index_ & 0x7f);
  for (size_t i = 0; i < len; ++i) data[i] = i == 0 ? v : 0xff;
}

void Cmos::write(uint64_t offset, const uint8_t* data, size_t len) {
  if (len == 0) return;
  std::lock_guard lock(mu_);
  if (offset == 0) {
    index_ = data[0] & 0x7f;  // bit 7 masks NMIs on real hardware: ignored
    return;
  }
  uint8_t i = index_;
  if (i <= 0x0d || i == 0x32) return;  // clock and status registers are read-only here
  ram_[i] = data[0];
}

void Cmos::save(StateWriter& w) const {
  std::lock_guard lock(mu_);
  w.put(index_);
  for (uint8_t b : ram_) w.put(b);
}

bool Cmos::restore(StateReader& r) {
  std::lock_guard lock(mu_);
  if (!r.get(&index_)) return false;
  index_ &= 0x7f;
  for (uint8_t& b : ram_)
    if (!r.get(&b)) return false;
  return true;
}

}  // namespace sg::vmm
