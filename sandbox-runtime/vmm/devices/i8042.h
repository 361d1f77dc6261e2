// I8042: just enough of the PS/2 controller at ports 0x60 (data) and 0x64
// (status/command) for Linux to find a controller without devices
// (i8042.nokbd i8042.noaux) and to reset the machine: command 0xfe (pulse
// the reset line) is how the guest reboots with reboot=k, and the VMM
// treats it as the end of the VM, as Firecracker does.
//
// Register map:
//   0x60 R: output buffer (the reply to the last command)   W: data for command 0x60 (CTR)
//   0x64 R: status (bit 0 output full, bit 2 system flag)    W: command
// Commands: 0x20 read CTR, 0x60 write CTR, 0xaa self-test (0x55),
//   0xab/0xa9 port tests (0x00), 0xad/0xae/0xa7/0xa8 port disable/enable
//   (accepted), 0xfe reset; others ignored.
// Reference: Linux drivers/input/serio/i8042.c; Firecracker's i8042.
//
// Thread safety: one mutex; the reset callback runs outside it.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>

#include "sandbox-runtime/vmm/devices/device.h"

namespace sg::vmm {

class I8042 final : public BusDevice {
 public:
  static constexpr uint16_t kPort = 0x60;
  static constexpr uint64_t kWindow = 5;  // 0x60..0x64

  explicit I8042(std::function<void()> on_reset);
  void read(uint64_t offset, uint8_t* data, size_t len) override;
  void write(uint64_t offset, const uint8_t* data, size_t len) override;

 private:
  std::function<void()> on_reset_;
  std::mutex mu_;
  uint8_t ctr_ = 0x00;       // GUARDED_BY(mu_): controller configuration byte
  uint8_t out_ = 0;          // GUARDED_BY(mu_)
  bool out_full_ = false;    // GUARDED_BY(mu_)
  bool want_ctr_ = false;    // GUARDED_BY(mu_): next data byte is the CTR
};

}  // namespace sg::vmm
