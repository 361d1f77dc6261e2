// Cmos: the MC146818 real-time clock and its 128 bytes of CMOS RAM at
// ports 0x70 (index, bit 7 = NMI mask) and 0x71 (data). The clock reads
// the host's wall time (UTC) at each access, in BCD, 24-hour mode, never
// "update in progress"; writes to the time registers are ignored (the guest
// cannot move the host's clock). No alarm or periodic interrupts: Linux
// uses it only to read the time at boot (kvmclock keeps time after that).
//
// Register map (index at port 0x70):
//   0x00 seconds  0x02 minutes  0x04 hours  0x06 weekday (1 = Sunday)
//   0x07 day  0x08 month  0x09 year (2 digits)  0x32 century
//   0x0a status A (0x26)  0x0b status B (0x02: 24h, BCD)  0x0c C (0)  0x0d D (0x80: valid)
//   other indices: plain RAM
// Reference: MC146818A datasheet; Cloud Hypervisor devices/src/legacy/cmos.rs.
//
// Thread safety: one mutex.
#pragma once

#include <cstdint>
#include <ctime>
#include <functional>
#include <mutex>

#include "sandbox-runtime/vmm/devices/device.h"

namespace sg::vmm {

class Cmos final : public BusDevice {
 public:
  static constexpr uint16_t kPort = 0x70;
  static constexpr uint64_t kWindow = 2;

  // now() returns unix seconds; defaults to time(nullptr). Tests inject one.
  explicit Cmos(std::function<int64_t()> now = nullptr);
  void read(uint64_t offset, uint8_t* data, size_t len) override;
  void write(uint64_t offset, const uint8_t* data, size_t len) override;
  void save(StateWriter& w) const;
  bool restore(StateReader& r);

 private:
  uint8_t reg(uint8_t index);

  std::function<int64_t()> now_;
  mutable std::mutex mu_;
  uint8_t index_ = 0;      // GUARDED_BY(mu_)
  uint8_t ram_[128] = {};  // GUARDED_BY(mu_)
};

}  // namespace sg::vmm
