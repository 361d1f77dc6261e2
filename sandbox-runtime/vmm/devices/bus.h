// Bus: maps non-overlapping address windows [base, base+len) to devices,
// for port I/O and for MMIO (Firecracker's BusRange). Lookups check the
// whole access lies inside one window; anything else is unclaimed and the
// caller answers it (reads as all ones, writes dropped).
//
// Thread safety: built before the vCPUs start, read-only afterwards.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sandbox-runtime/vmm/devices/device.h"

namespace sg::vmm {

class Bus {
 public:
  struct Hit {
    BusDevice* device = nullptr;
    uint64_t offset = 0;
  };
  // Fails if the window is empty, wraps, or overlaps one already added.
  Status add(uint64_t base, uint64_t len, BusDevice* device);
  // The device whose window holds all of [addr, addr+len), or a null device.
  Hit find(uint64_t addr, uint64_t len) const;

  // Dispatch helpers: unclaimed reads return all ones, writes are dropped.
  // Return whether a device claimed the access.
  bool read(uint64_t addr, uint8_t* data, size_t len) const;
  bool write(uint64_t addr, const uint8_t* data, size_t len) const;

 private:
  struct Range {
    uint64_t base, len;
    BusDevice* device;
  };
  std::vector<Range> ranges_;  // sorted by base
};

}  // namespace sg::vmm
