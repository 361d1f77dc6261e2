// Where the KVM tests and the microVM benchmark find their inputs. Defaults
// are the paths inside the KVM test harness's outer guest
// (tests/kvm-harness/outer-init); a machine with usable /dev/kvm sets:
//   SANDGATE_KVM_BIN_DIR   sandgate-vmm, sandgate-agent   (/opt/sandgate/bin)
//   SANDGATE_GUEST_DIR     vmlinuz, initramfs.cpio        (/opt/sandgate/guest)
//   SANDGATE_TEST_ROOTFS   template rootfs dir, image beside it as .ext4
//                                                          (/srv/assets/templates/base)
//   SANDGATE_KVM_STATE     writable scratch directory      (/srv/scratch/kvm-state)
// The harness's outer guest sets SANDGATE_KVM_EMULATED for its commands:
// their KVM runs under QEMU's TCG (kvm_emulated()).
#pragma once

#include <cstdlib>
#include <string>

#include "sandbox-runtime/microvm/microvm_runtime.h"

namespace sg::testing {

inline std::string env_or(const char* name, const char* dflt) {
  const char* v = std::getenv(name);
  return v && *v ? v : dflt;
}

inline microvm::MicrovmConfig kvm_test_config(const std::string& state_suffix, bool snapshots) {
  microvm::MicrovmConfig c;
  std::string bin = env_or("SANDGATE_KVM_BIN_DIR", "/opt/sandgate/bin");
  c.vmm_path = bin + "/sandgate-vmm";
  c.agent_path = bin + "/sandgate-agent";
  c.guest_dir = env_or("SANDGATE_GUEST_DIR", "/opt/sandgate/guest");
  c.state_root = env_or("SANDGATE_KVM_STATE", "/srv/scratch/kvm-state") + "/" + state_suffix;
  c.use_snapshots = snapshots;
  c.cgroup_parent = "sgkvmtest-" + state_suffix;
  return c;
}

// Whether /dev/kvm is the KVM harness's, under emulation: tests that the
// emulator cannot carry in full size run smaller there.
inline bool kvm_emulated() { return std::getenv("SANDGATE_KVM_EMULATED") != nullptr; }

inline std::string kvm_test_rootfs() { return env_or("SANDGATE_TEST_ROOTFS", "/srv/assets/templates/base"); }

}  // namespace sg::testing
