// vcpu_cpuid on a made-up supported set: what each vCPU is told, no KVM.
#include <doctest/doctest.h>

#include <asm/kvm_para.h>

#include "sandbox-runtime/vmm/vm/machine.h"

using namespace sg;

namespace {

kvm_cpuid_entry2 leaf(uint32_t function, uint32_t eax, uint32_t ebx, uint32_t ecx, uint32_t edx) {
  kvm_cpuid_entry2 e{};
  e.function = function;
  e.eax = eax;
  e.ebx = ebx;
  e.ecx = ecx;
  e.edx = edx;
  return e;
}

const kvm_cpuid_entry2* find(const vmm::kvm::CpuidEntries& c, uint32_t function) {
  for (const auto& e : c.entries)
    if (e.function == function) return &e;
  return nullptr;
}

}  // namespace

TEST_CASE("vcpu_cpuid: hypervisor bit, this vCPU's APIC ids, KVM's features less async page faults") {
  vmm::kvm::CpuidEntries supported;
  supported.entries = {leaf(1, 0x000a0f10, 0x00ab0800, 0x7ed8320b, 0x178bfbff),
                       leaf(0xb, 0, 0, 0, 0),
                       leaf(KVM_CPUID_SIGNATURE, KVM_CPUID_FEATURES, 0x4b4d564b, 0x564b4d56, 0x4d),
                       leaf(KVM_CPUID_FEATURES, 0xffffffff, 0, 0, 0)};
  vmm::kvm::CpuidEntries c = vmm::vcpu_cpuid(supported, 3);
  REQUIRE(c.entries.size() == supported.entries.size());
  const kvm_cpuid_entry2* l1 = find(c, 1);
  REQUIRE(l1);
  CHECK(l1->ebx == 0x03ab0800);  // initial APIC id 3, the rest kept
  CHECK(l1->ecx == 0xfed8320bu);
  CHECK(l1->edx == 0x178bfbffu);
  CHECK(find(c, 0xb)->edx == 3);
  CHECK(find(c, KVM_CPUID_SIGNATURE)->ebx == 0x4b4d564b);
  uint32_t feats = find(c, KVM_CPUID_FEATURES)->eax;
  CHECK((feats & (1u << KVM_FEATURE_ASYNC_PF)) == 0);
  CHECK((feats & (1u << KVM_FEATURE_ASYNC_PF_VMEXIT)) == 0);
  CHECK((feats & (1u << KVM_FEATURE_ASYNC_PF_INT)) == 0);
  // Every other paravirtual feature stays (kvmclock, PV EOI, steal time...).
  uint32_t others = ~((1u << KVM_FEATURE_ASYNC_PF) | (1u << KVM_FEATURE_ASYNC_PF_VMEXIT) | (1u << KVM_FEATURE_ASYNC_PF_INT));
  CHECK(feats == others);
}
