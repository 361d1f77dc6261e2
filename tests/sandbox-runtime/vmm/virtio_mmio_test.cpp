// VirtioMmio transport driven as Linux's virtio_mmio driver drives it:
// identification, status handshake, feature negotiation (VERSION_1 is
// required for FEATURES_OK), queue setup rules, DRIVER_OK activation,
// notifications, interrupts, reset by writing 0, config space, save/restore.
#include <doctest/doctest.h>

#include <vector>

#include "sandbox-runtime/vmm/devices/virtio_mmio.h"
#include "tests/sandbox-runtime/vmm/vmm_harness.h"

using namespace sg;
using namespace sg::vmm;
using namespace sg::vmm::test;

namespace {

constexpr uint64_t kOffered = kVirtioFVersion1 | (1ull << 9) | (1ull << 2);

// Records what the transport calls.
struct FakeDevice final : VirtioDevice {
  int activations = 0, resets = 0;
  std::vector<size_t> notified;
  uint8_t config[16] = {0x10, 0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x18, 0x19, 0x1a, 0x1b, 0x1c, 0x1d, 0x1e, 0x1f};
  std::vector<std::pair<uint64_t, size_t>> config_writes;

  uint32_t device_id() const override { return 42; }
  uint64_t device_features() const override { return kOffered; }
  size_t num_queues() const override { return 2; }
  void read_config(uint64_t offset, uint8_t* data, size_t len) override {
    for (size_t i = 0; i < len; ++i) data[i] = offset + i < sizeof config ? config[offset + i] : 0;
  }
  void write_config(uint64_t offset, const uint8_t*, size_t len) override { config_writes.push_back({offset, len}); }
  void activate(VirtioMmio&) override { ++activations; }
  void queue_notify(VirtioMmio&, size_t queue) override { notified.push_back(queue); }
  void reset() override { ++resets; }
};

struct Fixture {
  GuestMemory mem = make_ram();
  FakeIrq irq;
  FakeDevice dev;
  VirtioMmio t{mem, irq, dev, 64};
  Driver drv{t, mem};
};

}  // namespace

TEST_CASE("virtio-mmio: identification registers") {
  Fixture f;
  CHECK(f.drv.r32(kRegMagic) == 0x74726976);  // "virt"
  CHECK(f.drv.r32(kRegVersion) == 2);
  CHECK(f.drv.r32(kRegDeviceId) == 42);
  CHECK(f.drv.r32(kRegVendor) == 0x53474154);
  CHECK(f.drv.device_features() == kOffered);
  f.drv.w32(kRegDeviceFeaturesSel, 2);  // past the 64 feature bits
  CHECK(f.drv.r32(kRegDeviceFeatures) == 0);
  CHECK(f.drv.r32(0x0f8) == 0);  // a hole in the register map
  uint8_t b[2];
  f.t.read(kRegMagic, b, 2);  // registers are 32-bit only
  CHECK(b[0] == 0xff);
  CHECK(b[1] == 0xff);
}

TEST_CASE("virtio-mmio: narrow register writes are ignored") {
  Fixture f;
  uint8_t v[2] = {1, 0};
  f.t.write(kRegStatus, v, 2);
  f.t.write(kRegStatus, v, 1);
  CHECK(f.drv.status() == 0);
}

TEST_CASE("virtio-mmio: VERSION_1 negotiation") {
  Fixture f;
  CHECK(f.drv.negotiate(kVirtioFVersion1));
  CHECK(f.t.acked_features() == kVirtioFVersion1);
  CHECK(f.drv.status() == (kVirtioStatusAcknowledge | kVirtioStatusDriver | kVirtioStatusFeaturesOk));

  CHECK(f.drv.negotiate(kOffered));
  CHECK(f.t.acked_features() == kOffered);

  // A legacy driver that does not ack VERSION_1 never gets FEATURES_OK.
  CHECK(!f.drv.negotiate(1ull << 9));
  CHECK((f.drv.status() & kVirtioStatusFeaturesOk) == 0);
  CHECK(f.drv.status() == (kVirtioStatusAcknowledge | kVirtioStatusDriver));
  CHECK(!f.drv.negotiate(0));

  // Nor does one that acks a feature that was not offered.
  CHECK(!f.drv.negotiate(kVirtioFVersion1 | (1ull << 28)));
  CHECK(!f.drv.negotiate(kVirtioFVersion1 | (1ull << 40)));
}

TEST_CASE("virtio-mmio: driver features are frozen once FEATURES_OK is set") {
  Fixture f;
  REQUIRE(f.drv.negotiate(kVirtioFVersion1));
  f.drv.w32(kRegDriverFeaturesSel, 0);
  f.drv.w32(kRegDriverFeatures, 1u << 9);
  f.drv.w32(kRegDriverFeaturesSel, 1);
  f.drv.w32(kRegDriverFeatures, 0);
  CHECK(f.t.acked_features() == kVirtioFVersion1);
  f.drv.w32(kRegDriverFeaturesSel, 7);  // unknown selector: ignored, not aliased
}

TEST_CASE("virtio-mmio: a driver without FEATURES_OK cannot activate the device") {
  Fixture f;
  CHECK(!f.drv.negotiate(0));
  REQUIRE(f.drv.setup_queue(0, 16, desc_gpa(0), avail_gpa(0), used_gpa(0)));
  f.drv.driver_ok();
  CHECK(!f.t.active());
  CHECK(f.dev.activations == 0);
  f.drv.notify(0);
  CHECK(f.dev.notified.empty());
}

TEST_CASE("virtio-mmio: queue setup, DRIVER_OK activates once, notifications are forwarded") {
  Fixture f;
  CHECK(f.drv.r32(kRegQueueNumMax) == 64);
  f.drv.w32(kRegQueueSel, 2);  // past the device's two queues
  CHECK(f.drv.r32(kRegQueueNumMax) == 0);
  CHECK(f.drv.r32(kRegQueueReady) == 0);
  f.drv.w32(kRegQueueReady, 1);  // no queue selected: ignored
  CHECK((f.drv.status() & kVirtioStatusNeedsReset) == 0);

  f.drv.bring_up(2);
  CHECK(f.dev.activations == 1);
  CHECK(f.t.queue(0).size == 16);
  CHECK(f.t.queue(1).desc_addr == desc_gpa(1));
  CHECK(f.t.queue(1).avail_addr == avail_gpa(1));
  CHECK(f.t.queue(1).used_addr == used_gpa(1));
  f.drv.driver_ok();  // DRIVER_OK again: no second activation
  CHECK(f.dev.activations == 1);

  f.drv.notify(1);
  f.drv.notify(0);
  f.drv.notify(2);           // no such queue
  f.drv.notify(0x10000000);  // nor this
  CHECK(f.dev.notified == std::vector<size_t>{1, 0});
}

TEST_CASE("virtio-mmio: a queue's configuration is locked while it is ready") {
  Fixture f;
  REQUIRE(f.drv.negotiate(kVirtioFVersion1));
  REQUIRE(f.drv.setup_queue(0, 16, desc_gpa(0), avail_gpa(0), used_gpa(0)));
  f.drv.w32(kRegQueueNum, 32);
  f.drv.w32(kRegQueueDescLow, 0x2000);
  f.drv.w32(kRegQueueDriverHigh, 1);
  f.drv.w32(kRegQueueDeviceLow, 0x3000);
  CHECK(f.t.queue(0).size == 16);
  CHECK(f.t.queue(0).desc_addr == desc_gpa(0));
  CHECK(f.t.queue(0).avail_addr == avail_gpa(0));
  CHECK(f.t.queue(0).used_addr == used_gpa(0));
  f.drv.w32(kRegQueueReady, 0);  // un-ready before DRIVER_OK: configurable again
  f.drv.w32(kRegQueueDescHigh, 0);
  f.drv.w32(kRegQueueDescLow, 0x2000);
  CHECK(f.t.queue(0).desc_addr == 0x2000);
}

TEST_CASE("virtio-mmio: QueueReady on an invalid configuration sets DEVICE_NEEDS_RESET") {
  struct Bad {
    uint16_t size;
    uint64_t desc;
  } cases[] = {{12, desc_gpa(0)}, {0, desc_gpa(0)}, {128, desc_gpa(0)}, {16, desc_gpa(0) + 8}, {16, kMmioStart}};
  for (const Bad& b : cases) {
    Fixture f;
    REQUIRE(f.drv.negotiate(kVirtioFVersion1));
    f.drv.w32(kRegQueueSel, 0);
    f.drv.w32(kRegQueueNum, b.size);
    f.drv.w32(kRegQueueDescLow, static_cast<uint32_t>(b.desc));
    f.drv.w32(kRegQueueDescHigh, static_cast<uint32_t>(b.desc >> 32));
    f.drv.w32(kRegQueueDriverLow, static_cast<uint32_t>(avail_gpa(0)));
    f.drv.w32(kRegQueueDeviceLow, static_cast<uint32_t>(used_gpa(0)));
    f.drv.w32(kRegQueueReady, 1);
    CHECK(f.drv.r32(kRegQueueReady) == 0);
    CHECK((f.drv.status() & kVirtioStatusNeedsReset) != 0);
    CHECK(f.irq.count() == 0);  // no config interrupt before DRIVER_OK
  }
}

TEST_CASE("virtio-mmio: writing 0 to Status resets the device") {
  Fixture f;
  f.drv.bring_up(2);
  f.t.signal_used(0);
  REQUIRE(f.drv.r32(kRegInterruptStatus) == 1);
  f.drv.w32(kRegQueueSel, 1);
  f.drv.w32(kRegStatus, 0);
  CHECK(f.drv.status() == 0);
  CHECK(!f.t.active());
  CHECK(f.dev.resets == 1);
  CHECK(f.t.acked_features() == 0);
  CHECK(f.drv.r32(kRegInterruptStatus) == 0);
  for (size_t q = 0; q < 2; ++q) {
    CHECK(!f.t.queue(q).ready);
    CHECK(f.t.queue(q).size == 0);
    CHECK(f.t.queue(q).desc_addr == 0);
  }
  CHECK(f.drv.r32(kRegQueueReady) == 0);  // QueueSel went back to 0 too
  f.drv.notify(0);
  CHECK(f.dev.notified.empty());
  f.drv.w32(kRegStatus, 0);  // reset of an inactive device: no device reset call
  CHECK(f.dev.resets == 1);
  f.drv.bring_up(2);  // and it comes up again
  CHECK(f.dev.activations == 2);
}

TEST_CASE("virtio-mmio: used-buffer interrupts, suppression and ACK") {
  Fixture f;
  f.drv.bring_up(2);
  f.t.signal_used(0);
  CHECK(f.irq.count() == 1);
  CHECK(f.drv.r32(kRegInterruptStatus) == 1);
  f.drv.w32(kRegInterruptAck, 1);
  CHECK(f.drv.r32(kRegInterruptStatus) == 0);

  f.drv.ring(1).set_avail_flags(kAvailFlagNoInterrupt);
  f.t.signal_used(1);
  CHECK(f.irq.count() == 1);
  CHECK(f.drv.r32(kRegInterruptStatus) == 0);
  f.t.signal_used(7);  // no such queue
  CHECK(f.irq.count() == 1);

  f.t.needs_reset();  // after DRIVER_OK: a configuration-change interrupt
  CHECK(f.irq.count() == 2);
  CHECK(f.drv.r32(kRegInterruptStatus) == 2);
  CHECK((f.drv.status() & kVirtioStatusNeedsReset) != 0);
  f.t.signal_used(0);
  CHECK(f.drv.ack_interrupt() == 3);
  CHECK(f.drv.r32(kRegInterruptStatus) == 0);
}

TEST_CASE("virtio-mmio: config space is forwarded at any width, generation is stable") {
  Fixture f;
  uint32_t gen = f.drv.r32(kRegConfigGeneration);
  uint8_t b[8] = {};
  f.t.read(kRegConfig + 3, b, 1);
  CHECK(b[0] == 0x13);
  f.t.read(kRegConfig + 6, b, 2);
  CHECK(b[0] == 0x16);
  CHECK(b[1] == 0x17);
  f.t.read(kRegConfig + 8, b, 8);
  CHECK(b[7] == 0x1f);
  CHECK(f.drv.r32(kRegConfig) == 0x13121110);
  f.t.write(kRegConfig + 4, b, 2);
  REQUIRE(f.dev.config_writes.size() == 1);
  CHECK(f.dev.config_writes[0] == std::pair<uint64_t, size_t>{4, 2});
  CHECK(f.drv.r32(kRegConfigGeneration) == gen);  // config never changes under the driver
}

TEST_CASE("virtio-mmio: save and restore") {
  Fixture f;
  f.drv.bring_up(2);
  f.t.signal_used(1);
  StateWriter w;
  f.t.save(w);

  FakeIrq irq2;
  FakeDevice dev2;
  VirtioMmio t2(f.mem, irq2, dev2, 64);
  StateReader r(w.bytes().data(), w.bytes().size());
  REQUIRE(t2.restore(r));
  CHECK(r.done());
  CHECK(t2.active());
  CHECK(dev2.activations == 1);
  Driver d2(t2, f.mem);
  CHECK(d2.status() == f.drv.status());
  CHECK(d2.r32(kRegInterruptStatus) == 1);
  CHECK(t2.acked_features() == kVirtioFVersion1);
  CHECK(t2.queue(1).ready);
  CHECK(t2.queue(1).used_addr == used_gpa(1));
  StateWriter w2;
  t2.save(w2);
  CHECK(w2.bytes() == w.bytes());

  for (size_t n : {size_t{0}, size_t{10}, w.bytes().size() - 1}) {
    FakeDevice d3;
    VirtioMmio t3(f.mem, irq2, d3, 64);
    StateReader tr(w.bytes().data(), n);
    CHECK(!t3.restore(tr));
    CHECK(!t3.active());
    CHECK(d3.activations == 0);
  }
  // A saved queue that does not fit the restoring guest's RAM is refused.
  GuestMemory small = make_ram(1u << 20);
  FakeDevice d4;
  VirtioMmio t4(small, irq2, d4, 64);
  StateReader tr(w.bytes().data(), w.bytes().size());
  CHECK(!t4.restore(tr));
  CHECK(d4.activations == 0);
}

// Regression (found by virtio_fuzz): QueueNum was stored as written, so a
// driver that wrote more than QueueNumMax left state that save() wrote and
// restore() refused (size over max_size): such a VM could not be restored.
TEST_CASE("virtio-mmio: a QueueNum over QueueNumMax still saves and restores") {
  Fixture f;
  REQUIRE(f.drv.negotiate(kVirtioFVersion1));
  f.drv.w32(kRegQueueSel, 0);
  f.drv.w32(kRegQueueNum, 1000);  // QueueNumMax is 64
  StateWriter w;
  f.t.save(w);
  FakeDevice dev2;
  VirtioMmio t2(f.mem, f.irq, dev2, 64);
  StateReader r(w.bytes().data(), w.bytes().size());
  CHECK(t2.restore(r));
  // And the queue still cannot be made ready with that size.
  f.drv.w32(kRegQueueDescLow, static_cast<uint32_t>(desc_gpa(0)));
  f.drv.w32(kRegQueueDriverLow, static_cast<uint32_t>(avail_gpa(0)));
  f.drv.w32(kRegQueueDeviceLow, static_cast<uint32_t>(used_gpa(0)));
  f.drv.w32(kRegQueueReady, 1);
  CHECK(f.drv.r32(kRegQueueReady) == 0);
  CHECK((f.drv.status() & kVirtioStatusNeedsReset) != 0);
}
