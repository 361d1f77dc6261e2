// Bus: window lookup with overflow-safe bounds.
#include "sandbox-runtime/vmm/devices/bus.h"

#include <algorithm>
#include <cstring>

namespace sg::vmm {

Status Bus::add(uint64_t base, uint64_t len, BusDevice* device) {
  if (len == 0 || base + len < base) return invalid_error("bus window is empty or wraps");
  for (const Range& r : ranges_)
    if (base < r.base + r.len && r.base < base + len) return invalid_error("bus window overlaps another device");
  ranges_.push_back({base, len, device});
  std::sort(ranges_.begin(), ranges_.end(), [](const Range& a, const Range& b) { return a.base < b.base; });
  return {};
}

Bus::Hit Bus::find(uint64_t addr, uint64_t len) const {
  auto it = std::upper_bound(ranges_.begin(), ranges_.end(), addr, [](uint64_t a, const Range& r) { return a < r.base; });
  if (it == ranges_.begin()) return {};
  --it;
  uint64_t off = addr - it->base;
  if (off >= it->len || len > it->len - off) return {};
  return {it->device, off};
}

bool Bus::read(uint64_t addr, uint8_t* data, size_t len) const {
  Hit h = find(addr, len);
  if (!h.device) {
    std::memset(data, 0xff, len);
    return false;
  }
  h.device->read(h.offset, data, len);
  return true;
}

bool Bus::write(uint64_t addr, const uint8_t* data, size_t len) const {
  Hit h = find(addr, len);
  if (!h.device) return false;
  h.device->write(h.offset, data, len);
  return true;
}

}  // namespace sg::vmm
