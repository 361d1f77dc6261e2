// VirtioMmio: the virtio-mmio transport, version 2 (VIRTIO 1.2, section
// 4.2.2), one 4 KiB window per device, announced to Linux on the kernel
// ACPI tables (boot/acpi.h, _HID LNRO0005). It owns the queues and
// the interrupt status and forwards the device-specific part to a
// VirtioDevice. The device is activated when the driver sets DRIVER_OK on
// a valid configuration; writing 0 to Status resets it.
//
// Register map (all 32-bit; config space at 0x100 any width):
//   0x000 MagicValue "virt"   0x004 Version (2)   0x008 DeviceID   0x00c VendorID
//   0x010 DeviceFeatures      0x014 DeviceFeaturesSel
//   0x020 DriverFeatures      0x024 DriverFeaturesSel
//   0x030 QueueSel  0x034 QueueNumMax  0x038 QueueNum  0x044 QueueReady
//   0x050 QueueNotify  0x060 InterruptStatus  0x064 InterruptACK  0x070 Status
//   0x080/0x084 QueueDesc lo/hi  0x090/0x094 QueueDriver lo/hi  0x0a0/0x0a4 QueueDevice lo/hi
//   0x0fc ConfigGeneration    0x100.. device configuration
//
// Thread safety: one mutex per transport, held across every call into the
// device (vCPU MMIO exits and the device's own I/O thread both enter through
// here: lock() gives a device thread the same lock).
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

#include "sandbox-runtime/vmm/devices/device.h"
#include "sandbox-runtime/vmm/devices/virtqueue.h"
#include "sandbox-runtime/vmm/kvm/memory.h"

namespace sg::vmm {

inline constexpr uint64_t kVirtioFVersion1 = 1ull << 32;
inline constexpr uint32_t kVirtioStatusAcknowledge = 1, kVirtioStatusDriver = 2, kVirtioStatusDriverOk = 4,
                          kVirtioStatusFeaturesOk = 8, kVirtioStatusNeedsReset = 64, kVirtioStatusFailed = 128;
inline constexpr uint64_t kVirtioMmioWindow = 0x1000;

class VirtioMmio;

// What the device part implements. All calls are made with the transport
// lock held.
class VirtioDevice {
 public:
  virtual ~VirtioDevice() = default;
  virtual uint32_t device_id() const = 0;
  virtual uint64_t device_features() const = 0;  // must include kVirtioFVersion1
  virtual size_t num_queues() const = 0;
  virtual void read_config(uint64_t offset, uint8_t* data, size_t len) = 0;
  virtual void write_config(uint64_t, const uint8_t*, size_t) {}
  // DRIVER_OK on a valid setup: queues are configured, features agreed.
  virtual void activate(VirtioMmio& t) = 0;
  virtual void queue_notify(VirtioMmio& t, size_t queue) = 0;
  // The driver reset the device: drop in-flight work.
  virtual void reset() = 0;
  virtual void save(StateWriter&) const {}
  virtual bool restore(StateReader&) { return true; }
};

class VirtioMmio final : public BusDevice {
 public:
  VirtioMmio(const GuestMemory& mem, IrqLine& irq, VirtioDevice& dev, uint16_t queue_max = 256);
  void read(uint64_t offset, uint8_t* data, size_t len) override;
  void write(uint64_t offset, const uint8_t* data, size_t len) override;

  // For devices (lock held): guest memory, queues, interrupts.
  const GuestMemory& memory() const { return mem_; }
  Virtqueue& queue(size_t i) { return queues_[i]; }
  bool active() const { return active_; }
  uint64_t acked_features() const { return driver_features_; }
  // Sets the used-buffer interrupt bit and raises the line unless the
  // driver suppressed interrupts on that queue.
  void signal_used(size_t queue);
  // Marks the device broken (DEVICE_NEEDS_RESET) and tells the driver.
  void needs_reset();
  std::unique_lock<std::mutex> lock() { return std::unique_lock(mu_); }

  // Caller holds no lock; vCPUs are parked.
  void save(StateWriter& w);
  bool restore(StateReader& r);

 private:
  void reset_locked();
  void set_status(uint32_t v);

  const GuestMemory& mem_;
  IrqLine& irq_;
  VirtioDevice& dev_;
  std::mutex mu_;
  std::vector<Virtqueue> queues_;      // GUARDED_BY(mu_)
  uint32_t status_ = 0;                // GUARDED_BY(mu_)
  uint32_t device_features_sel_ = 0;   // GUARDED_BY(mu_)
  uint32_t driver_features_sel_ = 0;   // GUARDED_BY(mu_)
  uint64_t driver_features_ = 0;       // GUARDED_BY(mu_)
  uint32_t queue_sel_ = 0;             // GUARDED_BY(mu_)
  uint32_t interrupt_status_ = 0;      // GUARDED_BY(mu_)
  uint32_t config_generation_ = 0;     // GUARDED_BY(mu_)
  bool active_ = false;                // GUARDED_BY(mu_)
};

}  // namespace sg::vmm
