// Exit dispatch: what the VMM does with one KVM_RUN exit. A pure function
// of the kvm_run block and the two buses, so it is tested with made-up
// exits (tests/sandbox-runtime/vmm/exit_test.cpp), as Firecracker tests
// its handle_kvm_exit.
#pragma once

#include <linux/kvm.h>

#include <cstddef>
#include <string>

#include "sandbox-runtime/vmm/devices/bus.h"

namespace sg::vmm {

enum class ExitAction {
  kContinue,  // re-enter the guest
  kShutdown,  // the guest asked to stop (reset, shutdown, triple fault)
  kFailed,    // KVM could not run the guest: the VM is dead
};

// run_size is the size of the kvm_run mapping: port-I/O data must lie in it.
ExitAction handle_exit(kvm_run& run, size_t run_size, const Bus& pio, const Bus& mmio, std::string* why);

}  // namespace sg::vmm
