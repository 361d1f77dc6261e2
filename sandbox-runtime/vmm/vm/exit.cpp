// Exit dispatch.
#include "sandbox-runtime/vmm/vm/exit.h"

#include <cstdint>
#include <cstdio>

namespace sg::vmm {

ExitAction handle_exit(kvm_run& run, size_t run_size, const Bus& pio, const Bus& mmio, std::string* why) {
  switch (run.exit_reason) {
    case KVM_EXIT_IO: {
      uint64_t size = run.io.size, count = run.io.count;
      if ((size != 1 && size != 2 && size != 4) || count == 0 || run.io.data_offset > run_size ||
          size * count > run_size - run.io.data_offset) {
        *why = "malformed port I/O exit";
        return ExitAction::kFailed;
      }
      auto* data = reinterpret_cast<uint8_t*>(&run) + run.io.data_offset;
      for (uint64_t i = 0; i < count; ++i, data += size) {
        if (run.io.direction == KVM_EXIT_IO_OUT) pio.write(run.io.port, data, size);
        else pio.read(run.io.port, data, size);
      }
      return ExitAction::kContinue;
    }
    case KVM_EXIT_MMIO: {
      uint32_t len = run.mmio.len;
      if (len == 0 || len > 8) {
        *why = "malformed MMIO exit";
        return ExitAction::kFailed;
      }
      if (run.mmio.is_write) mmio.write(run.mmio.phys_addr, run.mmio.data, len);
      else if (!mmio.read(run.mmio.phys_addr, run.mmio.data, len)) {
        for (uint32_t i = 0; i < len; ++i) run.mmio.data[i] = 0;  // unclaimed MMIO reads as 0
      }
      return ExitAction::kContinue;
    }
    case KVM_EXIT_HLT:
      *why = "guest halted with interrupts off";
      return ExitAction::kShutdown;
    case KVM_EXIT_SHUTDOWN:
      *why = "guest shut down (triple fault)";
      return ExitAction::kShutdown;
    case KVM_EXIT_SYSTEM_EVENT:
      *why = "guest system event " + std::to_string(run.system_event.type);
      return ExitAction::kShutdown;
    case KVM_EXIT_INTR:
      return ExitAction::kContinue;
    case KVM_EXIT_FAIL_ENTRY: {
      char buf[64];
      std::snprintf(buf, sizeof buf, "KVM_EXIT_FAIL_ENTRY, hardware reason 0x%llx",
                    static_cast<unsigned long long>(run.fail_entry.hardware_entry_failure_reason));
      *why = buf;
      return ExitAction::kFailed;
    }
    case KVM_EXIT_INTERNAL_ERROR:
      *why = "KVM_EXIT_INTERNAL_ERROR, suberror " + std::to_string(run.internal.suberror);
      return ExitAction::kFailed;
    default:
      *why = "unexpected KVM exit reason " + std::to_string(run.exit_reason);
      return ExitAction::kFailed;
  }
}

}  // namespace sg::vmm
