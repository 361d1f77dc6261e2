// Virtqueue: the device side of one split virtqueue (VIRTIO 1.2, section
// 2.7). The driver (guest) owns the descriptor table and the available
// ring; the device owns the used ring. Every address and index read from
// guest memory is checked: a head or next index out of range, a chain
// longer than the queue, or a buffer outside RAM makes pop() return an
// error for that chain (the device then completes it with length 0 and
// goes on) instead of touching anything else. Indirect descriptors and
// event-idx are not offered, so the guest never uses them.
//
// Thread safety: none; the owning device serialises access.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "sandbox-runtime/vmm/devices/device.h"
#include "sandbox-runtime/vmm/kvm/memory.h"

namespace sg::vmm {

inline constexpr uint16_t kDescFlagNext = 1;
inline constexpr uint16_t kDescFlagWrite = 2;
inline constexpr uint16_t kDescFlagIndirect = 4;
inline constexpr uint16_t kAvailFlagNoInterrupt = 1;

struct Descriptor {
  uint64_t addr;
  uint32_t len;
  bool write;  // device writes (guest reads)
};

struct Chain {
  uint16_t head = 0;
  std::vector<Descriptor> descs;
  bool valid = true;  // false: malformed; complete it with length 0
  uint64_t readable_bytes() const;
  uint64_t writable_bytes() const;
};

class Virtqueue {
 public:
  // Configuration written by the driver through the transport.
  uint16_t max_size = 256;
  uint16_t size = 0;
  bool ready = false;
  uint64_t desc_addr = 0, avail_addr = 0, used_addr = 0;

  // Indices the device keeps (saved in snapshots).
  uint16_t next_avail = 0;
  uint16_t next_used = 0;

  void reset();
  // True if size is a power of two within max_size and the three rings
  // lie in RAM.
  bool valid_config(const GuestMemory& mem) const;
  // The next available chain, or nullopt when the ring is empty (or the
  // queue is not ready, or the driver's idx is impossible: more than size
  // ahead, which is reported once through broken()).
  std::optional<Chain> pop(const GuestMemory& mem);
  // Puts a chain back (the device could not use it yet).
  void undo_pop() { --next_avail; }
  bool has_available(const GuestMemory& mem) const;
  // Writes the used element and publishes it.
  void add_used(const GuestMemory& mem, uint16_t head, uint32_t len);
  // Whether the driver asked not to be interrupted (VRING_AVAIL_F_NO_INTERRUPT).
  bool interrupt_suppressed(const GuestMemory& mem) const;
  bool broken() const { return broken_; }

  void save(StateWriter& w) const;
  bool restore(StateReader& r);

 private:
  bool broken_ = false;
};

}  // namespace sg::vmm
