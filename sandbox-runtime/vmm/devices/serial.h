// Serial: a 16550A UART at port 0x3f8, IRQ 4, transmit only: the guest
// kernel's console (console=ttyS0). Output goes to a sink fd (the VMM's
// serial log), at most out_limit bytes over the device's life so a guest
// cannot fill the host's disk; the rest is counted and dropped. The guest
// sees a transmitter that is always empty and no received bytes.
//
// Register map (offset from 0x3f8; DLAB = LCR bit 7):
//   0  R: RBR (always 0)            W: THR (a byte out)      DLAB: DLL
//   1  IER (bit 1: THR-empty interrupt enable; 0x0f used)    DLAB: DLM
//   2  R: IIR (0xc1 none, 0xc2 THR empty; FIFO bits set)     W: FCR (ignored)
//   3  LCR    4  MCR    5  LSR (0x60: THRE|TEMT)    6  MSR (0xb0)    7  SCR
// Reference: PC16550D datasheet; Linux drivers/tty/serial/8250.
//
// Thread safety: one mutex; called from vCPU threads.
#pragma once

#include <cstdint>
#include <mutex>

#include "sandbox-runtime/vmm/devices/device.h"

namespace sg::vmm {

class Serial final : public BusDevice {
 public:
  static constexpr uint16_t kPort = 0x3f8;
  static constexpr uint32_t kIrq = 4;
  static constexpr uint64_t kWindow = 8;

  // sink_fd may be -1 (output dropped); irq may be null (no interrupts).
  Serial(int sink_fd, IrqLine* irq, uint64_t out_limit = 4u << 20);
  void read(uint64_t offset, uint8_t* data, size_t len) override;
  void write(uint64_t offset, const uint8_t* data, size_t len) override;

  uint64_t bytes_written() const;
  uint64_t bytes_dropped() const;
  void save(StateWriter& w) const;
  bool restore(StateReader& r);

 private:
  void emit(uint8_t byte);

  int sink_fd_;
  IrqLine* irq_;
  uint64_t out_limit_;
  mutable std::mutex mu_;
  uint8_t ier_ = 0, lcr_ = 0, mcr_ = 0, scr_ = 0, dll_ = 0x0c, dlm_ = 0;  // GUARDED_BY(mu_)
  bool thre_pending_ = false;                                           // GUARDED_BY(mu_)
  uint64_t written_ = 0, dropped_ = 0;                                  // GUARDED_BY(mu_)
};

}  // namespace sg::vmm
