// Linux boot: loads a bzImage and its initramfs into guest RAM and lays
// out what the 64-bit boot protocol expects (Documentation/arch/x86/boot.rst,
// "64-bit boot protocol"): the zero page (boot_params) with the setup
// header copied from the image, an e820 map, the command line, identity-
// mapped page tables for the first 4 GiB, and a GDT. The vCPU then starts
// in long mode at the kernel's 64-bit entry (load address + 0x200) with
// RSI pointing at the zero page. No BIOS, no real-mode code.
//
// Guest-physical layout (low memory):
//   0x0500 GDT   0x7000 zero page   0x9000 PML4   0xa000 PDPT   0xb000.. 4 PDs
//   0x20000 command line (up to the kernel's cmdline_size, max 64 KiB)
//   0x9fc00-0x100000 reserved (EBDA, legacy hole; ACPI tables at 0xe0000, acpi.h)
//   kernel at its preferred address (16 MiB on Debian), initramfs at the
//   top of low RAM below the kernel's initrd_addr_max.
//
// All inputs are untrusted files: sizes and header fields are checked
// against the RAM size before anything is copied.
#pragma once

#include <linux/kvm.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "base/status.h"
#include "sandbox-runtime/vmm/kvm/memory.h"

namespace sg::vmm::boot {

inline constexpr uint64_t kGdtAddr = 0x500;
inline constexpr uint64_t kZeroPage = 0x7000;
inline constexpr uint64_t kPml4 = 0x9000;
inline constexpr uint64_t kCmdlineAddr = 0x20000;
inline constexpr uint64_t kCmdlineMax = 0x10000;
inline constexpr uint64_t kEbdaStart = 0x9fc00;

struct LoadedKernel {
  uint64_t entry = 0;        // 64-bit entry point (guest physical)
  uint64_t load_addr = 0;    // where the protected-mode kernel was put
  uint64_t initrd_addr = 0;  // 0 when there is none
  uint64_t initrd_size = 0;
};

// Loads bzimage (the whole file's bytes) and initrd (may be empty) into mem
// and writes the zero page, command line and e820 map. Fails with
// kInvalid for an image that is not a 64-bit-capable bzImage (boot protocol
// >= 2.12 with XLF_KERNEL_64), a command line too long, or files that do
// not fit in RAM.
Result<LoadedKernel> load_linux(const GuestMemory& mem, std::string_view bzimage, std::string_view initrd,
                                const std::string& cmdline);

// Page tables and GDT in guest memory for long mode (identity map of
// [0, 4 GiB) with 2 MiB pages).
Status write_long_mode_tables(const GuestMemory& mem);

// Boot vCPU registers: long mode, flat 64-bit code and data segments,
// paging on with CR3 = kPml4, RIP = entry, RSI = zero page.
void boot_sregs(kvm_sregs* s);
kvm_regs boot_regs(uint64_t entry);

}  // namespace sg::vmm::boot
