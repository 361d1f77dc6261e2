// ACPI tables: how the guest kernel learns its CPUs, its interrupt
// controllers and its virtio-mmio devices. The Debian cloud kernel has
// neither MP-table parsing (CONFIG_X86_MPPARSE) nor virtio-mmio command-line
// devices (CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES), but it has ACPI, so the VMM
// writes a minimal hardware-reduced ACPI 6 set, as Firecracker does:
//
//   RSDP (at kRsdpAddr, also given in boot_params.acpi_rsdp_addr)
//    -> XSDT -> FADT (HW_REDUCED_ACPI, no PM blocks) -> DSDT
//            -> MADT (one Local APIC per vCPU, the I/O APIC)
//   DSDT: one Device per virtio-mmio window under \_SB, _HID "LNRO0005"
//   (the ID Linux's virtio_mmio driver binds to), _CRS = Memory32Fixed
//   window + one edge, active-high interrupt.
//
// All tables live in [kRsdpAddr, kAcpiEnd), which the e820 map reserves.
// Reference: ACPI 6.4 spec, sections 5.2 (tables) and 19/20 (AML).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"
#include "sandbox-runtime/vmm/kvm/memory.h"

namespace sg::vmm::boot {

inline constexpr uint64_t kRsdpAddr = 0xe0000;
inline constexpr uint64_t kAcpiEnd = 0x100000;
inline constexpr uint32_t kMaxCpus = 32;
inline constexpr uint32_t kIoapicAddr = 0xfec00000;
inline constexpr uint32_t kLapicAddr = 0xfee00000;

struct MmioDeviceInfo {
  uint64_t base;
  uint32_t size;
  uint32_t irq;
};

// Writes the tables for cpus vCPUs and the given virtio-mmio devices.
Status write_acpi_tables(const GuestMemory& mem, uint32_t cpus, const std::vector<MmioDeviceInfo>& devices);

// The DSDT's AML body for the devices (exposed for tests).
std::vector<uint8_t> virtio_mmio_aml(const std::vector<MmioDeviceInfo>& devices);
// ACPI checksum: the byte that makes the sum of all bytes zero.
uint8_t acpi_checksum(const uint8_t* p, size_t n);

}  // namespace sg::vmm::boot
