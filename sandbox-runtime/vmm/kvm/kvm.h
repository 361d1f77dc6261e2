// Thin RAII wrappers over the KVM API (Documentation/virt/kvm/api.rst):
// Kvm (/dev/kvm), Vm (one VM fd) and Vcpu (one vCPU fd with its mmap'd
// kvm_run). Every call returns a Status/Result whose message names the
// ioctl and the object ("KVM_SET_USER_MEMORY_REGION slot 0: Invalid
// argument"). No policy lives here: the machine builder and the snapshot
// code decide what to set.
//
// Thread safety: a Vm may be used from any thread. A Vcpu's run() belongs to
// its vCPU thread; its get/set calls are made only while that thread is
// parked outside KVM_RUN (the kernel serialises them on the vcpu mutex, but
// state read from a running vCPU would be stale).
#pragma once

#include <linux/kvm.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "base/fd.h"
#include "base/status.h"

namespace sg::vmm::kvm {

// kvm_cpuid2 / kvm_msrs with their flexible arrays, as vectors.
struct CpuidEntries {
  std::vector<kvm_cpuid_entry2> entries;
};
// kvm_xsave without its flexible array (KVM_GET_XSAVE fills 4 KiB).
struct XsaveArea {
  uint32_t region[1024];
};
struct MsrEntry {
  uint32_t index;
  uint64_t data;
};

class Kvm {
 public:
  // Opens /dev/kvm (or path) and checks the API version is 12.
  static Result<Kvm> open(const std::string& path = "/dev/kvm");
  int fd() const { return fd_.get(); }
  int check_extension(long cap) const;
  Result<int> vcpu_mmap_size() const;
  Result<CpuidEntries> supported_cpuid() const;
  // KVM_GET_MSR_INDEX_LIST: the MSRs a snapshot must save.
  Result<std::vector<uint32_t>> msr_index_list() const;

 private:
  UniqueFd fd_;
};

class Vm {
 public:
  static Result<Vm> create(const Kvm& kvm);
  int fd() const { return fd_.get(); }
  Status set_tss_addr(uint64_t addr);
  Status set_identity_map_addr(uint64_t addr);
  Status create_irqchip();
  Status create_pit2();
  Status set_user_memory_region(uint32_t slot, uint64_t gpa, uint64_t size, void* host);
  // Edge on the GSI each time eventfd is written.
  Status irqfd(int eventfd, uint32_t gsi);
  Status irq_line(uint32_t irq, bool level);
  Result<kvm_irqchip> get_irqchip(uint32_t chip_id);
  Status set_irqchip(const kvm_irqchip& chip);
  Result<kvm_pit_state2> get_pit2();
  Status set_pit2(const kvm_pit_state2& pit);
  Result<kvm_clock_data> get_clock();
  Status set_clock(const kvm_clock_data& clock);

 private:
  UniqueFd fd_;
};

class Vcpu {
 public:
  static Result<std::unique_ptr<Vcpu>> create(const Kvm& kvm, const Vm& vm, uint32_t index);
  ~Vcpu();
  Vcpu(const Vcpu&) = delete;
  Vcpu& operator=(const Vcpu&) = delete;

  uint32_t index() const { return index_; }
  int fd() const { return fd_.get(); }
  kvm_run* run_state() const { return run_; }
  // KVM_RUN: Ok on any exit (read run_state()->exit_reason); an error with
  // errno EINTR/EAGAIN is reported as kUnavailable so the caller can tell
  // an interrupted run (pause, immediate_exit) from a failure.
  Status run();

  Result<kvm_regs> get_regs();
  Status set_regs(const kvm_regs& r);
  Result<kvm_sregs> get_sregs();
  Status set_sregs(const kvm_sregs& s);
  Result<kvm_fpu> get_fpu();
  Status set_fpu(const kvm_fpu& f);
  Result<XsaveArea> get_xsave();
  Status set_xsave(const XsaveArea& x);
  Result<kvm_xcrs> get_xcrs();
  Status set_xcrs(const kvm_xcrs& x);
  Result<kvm_lapic_state> get_lapic();
  Status set_lapic(const kvm_lapic_state& l);
  Result<kvm_vcpu_events> get_vcpu_events();
  Status set_vcpu_events(const kvm_vcpu_events& e);
  Result<kvm_mp_state> get_mp_state();
  Status set_mp_state(const kvm_mp_state& m);
  Result<kvm_debugregs> get_debugregs();
  Status set_debugregs(const kvm_debugregs& d);
  Status set_cpuid(const CpuidEntries& c);
  // Reads the given MSRs; entries the kernel refuses are dropped (KVM
  // stops at the first one it cannot read), so the result may be shorter.
  Result<std::vector<MsrEntry>> get_msrs(const std::vector<uint32_t>& indices);
  Status set_msrs(const std::vector<MsrEntry>& msrs);

 private:
  Vcpu() = default;
  UniqueFd fd_;
  kvm_run* run_ = nullptr;
  size_t run_size_ = 0;
  uint32_t index_ = 0;
};

// The requests a VMM makes of KVM once its guest runs (the VMM's seccomp
// allow list, vm/confine.*): KVM_RUN, interrupts, the kvmclock pause
// notice, the memory slot, and every get and set of VM and vCPU state
// (snapshots, and a restore's). Creating VMs, vCPUs, the irqchip and the
// PIT, and the one-time VM set-up, happen before and are not in it.
std::vector<unsigned long> running_ioctls();

}  // namespace sg::vmm::kvm
