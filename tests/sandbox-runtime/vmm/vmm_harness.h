// Test helpers for the VMM devices, all on plain anonymous memory with no
// KVM: a counting IrqLine, a virtio-mmio driver that performs the same
// register sequence as Linux's drivers/virtio/virtio_mmio.c, and a split
// ring writer that builds descriptor chains in guest memory (the driver's
// side of VIRTIO 1.2 section 2.7).
#pragma once

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <utility>
#include <vector>

#include "sandbox-runtime/vmm/devices/virtio_mmio.h"
#include "sandbox-runtime/vmm/kvm/memory.h"

namespace sg::vmm::test {

// Counts triggers; a test thread can wait for a predicate re-checked at
// every trigger (the console's I/O thread signals through it).
class FakeIrq final : public IrqLine {
 public:
  void trigger() override {
    count_.fetch_add(1);
    { std::lock_guard lock(mu_); }  // a waiter between its check and its wait sees the notify
    cv_.notify_all();
  }
  int count() const { return count_.load(); }
  // Waits until pred() holds, re-checking it at every trigger and every
  // 10 ms (pred may depend on state that changes without a trigger).
  bool wait_until(const std::function<bool()>& pred, std::chrono::milliseconds timeout = std::chrono::seconds(5)) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    std::unique_lock lock(mu_);
    while (!pred()) {
      if (std::chrono::steady_clock::now() >= deadline) return false;
      cv_.wait_for(lock, std::chrono::milliseconds(10));
    }
    return true;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<int> count_{0};
};

inline GuestMemory make_ram(uint64_t size = 16ull << 20) {
  auto m = GuestMemory::create_anonymous(size);
  REQUIRE(m.ok());
  return std::move(m.value());
}

// Virtio-mmio register offsets (virtio_mmio.h's register map).
enum : uint64_t {
  kRegMagic = 0x000, kRegVersion = 0x004, kRegDeviceId = 0x008, kRegVendor = 0x00c,
  kRegDeviceFeatures = 0x010, kRegDeviceFeaturesSel = 0x014, kRegDriverFeatures = 0x020,
  kRegDriverFeaturesSel = 0x024, kRegQueueSel = 0x030, kRegQueueNumMax = 0x034, kRegQueueNum = 0x038,
  kRegQueueReady = 0x044, kRegQueueNotify = 0x050, kRegInterruptStatus = 0x060, kRegInterruptAck = 0x064,
  kRegStatus = 0x070, kRegQueueDescLow = 0x080, kRegQueueDescHigh = 0x084, kRegQueueDriverLow = 0x090,
  kRegQueueDriverHigh = 0x094, kRegQueueDeviceLow = 0x0a0, kRegQueueDeviceHigh = 0x0a4,
  kRegConfigGeneration = 0x0fc, kRegConfig = 0x100,
};

// Where the default ring layout puts queue q: descriptors, avail, used.
inline constexpr uint64_t kRingBase = 0x100000, kRingStride = 0x10000;
inline uint64_t desc_gpa(size_t q) { return kRingBase + q * kRingStride; }
inline uint64_t avail_gpa(size_t q) { return desc_gpa(q) + 0x4000; }
inline uint64_t used_gpa(size_t q) { return desc_gpa(q) + 0x8000; }
// Data buffers go from here up.
inline constexpr uint64_t kDataBase = 0x400000;

struct Buf {
  uint64_t addr;
  uint32_t len;
  bool device_writes;
};

// The driver's half of one split ring at fixed guest addresses.
class Ring {
 public:
  Ring(const GuestMemory& mem, uint64_t desc, uint64_t avail, uint64_t used, uint16_t size)
      : mem_(&mem), desc_(desc), avail_(avail), used_(used), size_(size) {}

  uint16_t size() const { return size_; }
  void put_desc(uint16_t i, uint64_t addr, uint32_t len, uint16_t flags, uint16_t next) {
    uint8_t d[16];
    std::memcpy(d, &addr, 8);
    std::memcpy(d + 8, &len, 4);
    std::memcpy(d + 12, &flags, 2);
    std::memcpy(d + 14, &next, 2);
    REQUIRE(mem_->write(desc_ + 16ull * i, d, 16));
  }
  // Publishes head in the next avail slot and bumps avail idx.
  void push_avail(uint16_t head) {
    REQUIRE(mem_->write_obj(avail_ + 4 + 2ull * (avail_idx_ % size_), head));
    set_avail_idx(static_cast<uint16_t>(avail_idx_ + 1));
  }
  // Published with release: the ring entries before it are visible to a
  // device thread that reads the index.
  void set_avail_idx(uint16_t idx) {
    avail_idx_ = idx;
    // SAFETY: avail_ + 2 is 2-byte aligned (valid_config) and inside RAM (checked by span).
    auto* p = reinterpret_cast<uint16_t*>(mem_->span(avail_ + 2, 2));
    REQUIRE(p != nullptr);
    __atomic_store_n(p, idx, __ATOMIC_RELEASE);
  }
  uint16_t avail_idx() const { return avail_idx_; }
  void set_avail_flags(uint16_t flags) { REQUIRE(mem_->write_obj(avail_, flags)); }

  // Writes bufs as one chain in the next free descriptor slots and
  // publishes it. Returns the head index.
  uint16_t add_chain(const std::vector<Buf>& bufs) {
    REQUIRE(!bufs.empty());
    uint16_t head = next_desc_;
    for (size_t i = 0; i < bufs.size(); ++i) {
      uint16_t at = static_cast<uint16_t>((head + i) % size_);
      uint16_t next = static_cast<uint16_t>((head + i + 1) % size_);
      uint16_t flags = static_cast<uint16_t>((bufs[i].device_writes ? kDescFlagWrite : 0) |
                                             (i + 1 < bufs.size() ? kDescFlagNext : 0));
      put_desc(at, bufs[i].addr, bufs[i].len, flags, next);
    }
    next_desc_ = static_cast<uint16_t>((head + bufs.size()) % size_);
    push_avail(head);
    return head;
  }

  // The device's used ring, read with acquire: a device thread may be
  // publishing concurrently.
  uint16_t used_idx() const {
    // SAFETY: used_ + 2 is a 2-byte-aligned address inside RAM (checked by span).
    const auto* p = reinterpret_cast<const uint16_t*>(mem_->span(used_ + 2, 2));
    REQUIRE(p != nullptr);
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
  }
  // Element i of the used ring: {id, len}.
  std::pair<uint32_t, uint32_t> used_elem(uint16_t i) const {
    uint32_t v[2] = {};
    REQUIRE(mem_->read(used_ + 4 + 8ull * (i % size_), v, sizeof v));
    return {v[0], v[1]};
  }

 private:
  const GuestMemory* mem_;
  uint64_t desc_, avail_, used_;
  uint16_t size_;
  uint16_t avail_idx_ = 0, next_desc_ = 0;
};

// The guest's driver. All register accesses are 32-bit, as Linux does.
class Driver {
 public:
  Driver(VirtioMmio& t, const GuestMemory& mem) : t_(t), mem_(mem) {}

  uint32_t r32(uint64_t off) {
    uint8_t b[4];
    t_.read(off, b, 4);
    return static_cast<uint32_t>(le_load(b, 4));
  }
  void w32(uint64_t off, uint32_t v) {
    uint8_t b[4];
    le_store(b, 4, v);
    t_.write(off, b, 4);
  }
  uint32_t status() { return r32(kRegStatus); }

  uint64_t device_features() {
    w32(kRegDeviceFeaturesSel, 1);
    uint64_t f = static_cast<uint64_t>(r32(kRegDeviceFeatures)) << 32;
    w32(kRegDeviceFeaturesSel, 0);
    return f | r32(kRegDeviceFeatures);
  }

  // virtio_dev_probe up to FEATURES_OK: reset, ACKNOWLEDGE, DRIVER, the
  // driver features (high word first, as vm_finalize_features), then
  // FEATURES_OK and its read-back. Returns whether the device kept it.
  bool negotiate(uint64_t features) {
    w32(kRegStatus, 0);
    w32(kRegStatus, kVirtioStatusAcknowledge);
    w32(kRegStatus, kVirtioStatusAcknowledge | kVirtioStatusDriver);
    w32(kRegDriverFeaturesSel, 1);
    w32(kRegDriverFeatures, static_cast<uint32_t>(features >> 32));
    w32(kRegDriverFeaturesSel, 0);
    w32(kRegDriverFeatures, static_cast<uint32_t>(features));
    w32(kRegStatus, kVirtioStatusAcknowledge | kVirtioStatusDriver | kVirtioStatusFeaturesOk);
    return (status() & kVirtioStatusFeaturesOk) != 0;
  }

  // vm_setup_vq. Returns whether QueueReady reads back 1.
  bool setup_queue(uint32_t q, uint16_t size, uint64_t desc, uint64_t avail, uint64_t used) {
    w32(kRegQueueSel, q);
    if (r32(kRegQueueReady) != 0) return false;
    if (r32(kRegQueueNumMax) < size) return false;
    w32(kRegQueueNum, size);
    w32(kRegQueueDescLow, static_cast<uint32_t>(desc));
    w32(kRegQueueDescHigh, static_cast<uint32_t>(desc >> 32));
    w32(kRegQueueDriverLow, static_cast<uint32_t>(avail));
    w32(kRegQueueDriverHigh, static_cast<uint32_t>(avail >> 32));
    w32(kRegQueueDeviceLow, static_cast<uint32_t>(used));
    w32(kRegQueueDeviceHigh, static_cast<uint32_t>(used >> 32));
    w32(kRegQueueReady, 1);
    while (rings_.size() <= q) rings_.emplace_back(mem_, 0, 0, 0, 1);
    rings_[q] = Ring(mem_, desc, avail, used, size);
    return r32(kRegQueueReady) == 1;
  }

  void driver_ok() { w32(kRegStatus, status() | kVirtioStatusDriverOk); }

  // The whole probe with VERSION_1 and every queue at the default layout.
  void bring_up(size_t queues, uint16_t size = 16) {
    REQUIRE(r32(kRegMagic) == 0x74726976);
    REQUIRE(r32(kRegVersion) == 2);
    REQUIRE(negotiate(kVirtioFVersion1));
    for (size_t q = 0; q < queues; ++q)
      REQUIRE(setup_queue(static_cast<uint32_t>(q), size, desc_gpa(q), avail_gpa(q), used_gpa(q)));
    driver_ok();
    REQUIRE((status() & kVirtioStatusDriverOk) != 0);
    REQUIRE(t_.active());
  }

  Ring& ring(size_t q) { return rings_.at(q); }
  uint16_t add_chain(size_t q, const std::vector<Buf>& bufs) { return ring(q).add_chain(bufs); }
  void notify(size_t q) { w32(kRegQueueNotify, static_cast<uint32_t>(q)); }
  // The interrupt handler: read InterruptStatus, acknowledge it.
  uint32_t ack_interrupt() {
    uint32_t s = r32(kRegInterruptStatus);
    w32(kRegInterruptAck, s);
    return s;
  }

 private:
  VirtioMmio& t_;
  const GuestMemory& mem_;
  std::vector<Ring> rings_;
};

}  // namespace sg::vmm::test
