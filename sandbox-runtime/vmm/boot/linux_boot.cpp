// Linux boot: bzImage parsing, zero page, e820, long-mode tables.
#include "sandbox-runtime/vmm/boot/linux_boot.h"

#include <cstdlib>
#include <cstring>

#include "sandbox-runtime/vmm/boot/acpi.h"

namespace sg::vmm::boot {

namespace {

// Offsets in the zero page / setup header (boot.rst, "The real-mode kernel header").
constexpr size_t kSetupSects = 0x1f1, kBootFlag = 0x1fe, kHeaderMagic = 0x202, kVersion = 0x206,
                 kTypeOfLoader = 0x210, kLoadFlags = 0x211, kRamdiskImage = 0x218, kRamdiskSize = 0x21c,
                 kHeapEndPtr = 0x224, kCmdLinePtr = 0x228, kInitrdAddrMax = 0x22c, kKernelAlignment = 0x230,
                 kRelocatable = 0x234, kXloadFlags = 0x236, kCmdlineSize = 0x238, kPrefAddress = 0x258,
                 kInitSize = 0x260, kE820Entries = 0x1e8, kE820Table = 0x2d0, kExtRamdiskImage = 0x0c0,
                 kExtRamdiskSize = 0x0c4, kExtCmdLinePtr = 0x0c8, kAcpiRsdpAddr = 0x070;
constexpr size_t kE820Max = 128;
constexpr uint32_t kE820Ram = 1, kE820Reserved = 2;

template <typename T>
T get(std::string_view b, size_t off) {
  T v{};
  std::memcpy(&v, b.data() + off, sizeof v);
  return v;
}
template <typename T>
void put(uint8_t* zp, size_t off, T v) {
  std::memcpy(zp + off, &v, sizeof v);
}

struct E820 {
  uint64_t addr, size;
  uint32_t type;
} __attribute__((packed));
static_assert(sizeof(E820) == 20);

uint64_t align_down(uint64_t v, uint64_t a) { return v & ~(a - 1); }
uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) & ~(a - 1); }

}  // namespace

Result<LoadedKernel> load_linux(const GuestMemory& mem, std::string_view img, std::string_view initrd,
                                const std::string& cmdline) {
  if (img.size() < 0x1000) return invalid_error("kernel image too small to be a bzImage");
  if (get<uint16_t>(img, kBootFlag) != 0xaa55 || std::memcmp(img.data() + kHeaderMagic, "HdrS", 4) != 0)
    return invalid_error("kernel image is not a bzImage (no boot-sector signature or HdrS header)");
  uint16_t version = get<uint16_t>(img, kVersion);
  if (version < 0x020c) return invalid_error("kernel boot protocol too old (need 2.12 or later for the 64-bit entry)");
  if (!(get<uint16_t>(img, kXloadFlags) & 1)) return invalid_error("kernel has no 64-bit entry point (XLF_KERNEL_64)");
  if (!(get<uint8_t>(img, kLoadFlags) & 1)) return invalid_error("kernel is not loaded high (LOADED_HIGH clear)");
  uint32_t setup_sects = get<uint8_t>(img, kSetupSects);
  if (setup_sects == 0) setup_sects = 4;
  uint64_t setup_size = (setup_sects + 1ull) * 512;
  if (setup_size >= img.size()) return invalid_error("kernel image truncated (setup larger than the file)");
  uint64_t kernel_size = img.size() - setup_size;
  uint32_t cmdline_size = get<uint32_t>(img, kCmdlineSize);
  uint64_t cmd_max = cmdline_size < kCmdlineMax ? cmdline_size : kCmdlineMax - 1;
  if (cmdline.size() > cmd_max) return invalid_error("kernel command line longer than " + std::to_string(cmd_max) + " bytes");

  // Where to put the kernel: its preferred address when that leaves room
  // for init_size (the decompressor works in place up to there).
  uint64_t pref = get<uint64_t>(img, kPrefAddress);
  uint64_t init_size = get<uint32_t>(img, kInitSize);
  uint64_t align = get<uint32_t>(img, kKernelAlignment);
  if (align == 0 || (align & (align - 1))) align = 0x200000;
  uint64_t load = pref ? pref : 0x1000000;
  if (load < 0x100000) load = 0x100000;
  bool relocatable = get<uint8_t>(img, kRelocatable) != 0;
  // A non-relocatable kernel runs at pref_address whatever we do: below
  // 1 MiB it would land on the zero page, command line and page tables.
  if (!relocatable && pref && pref < 0x100000) return invalid_error("kernel is not relocatable and wants to load below 1 MiB");
  if (!relocatable && pref) load = pref;
  uint64_t low = mem.low_size();
  // Checked before aligning: align_up of an address near 2^64 wraps to 0.
  if (load > low) return invalid_error("kernel does not fit in guest RAM (load address past the end of low RAM)");
  load = align_up(load, relocatable ? align : 1);
  uint64_t need = init_size > kernel_size ? init_size : kernel_size;
  if (load > low || need > low - load)
    return invalid_error("kernel does not fit in guest RAM (needs " + std::to_string((load >> 20) + (need >> 20)) + " MiB)");
  if (!mem.write(load, img.data() + setup_size, kernel_size)) return invalid_error("kernel does not fit in guest RAM");

  LoadedKernel k;
  k.load_addr = load;
  k.entry = load + 0x200;

  // Initramfs: page aligned, as high as the kernel allows.
  if (!initrd.empty()) {
    uint64_t max = get<uint32_t>(img, kInitrdAddrMax);
    if (max == 0) max = 0x37ffffff;
    uint64_t top = low < max + 1 ? low : max + 1;
    if (initrd.size() > top) return invalid_error("initramfs larger than the memory the kernel can reach");
    uint64_t addr = align_down(top - initrd.size(), 4096);
    if (addr < load + need) return invalid_error("initramfs does not fit in guest RAM above the kernel");
    if (!mem.write(addr, initrd.data(), initrd.size())) return invalid_error("initramfs does not fit in guest RAM");
    k.initrd_addr = addr;
    k.initrd_size = initrd.size();
  }

  // Command line.
  std::string cl = cmdline;
  cl.push_back('\0');
  if (!mem.write(kCmdlineAddr, cl.data(), cl.size())) return internal_error("guest RAM too small for the command line");

  // Zero page: cleared, setup header copied from the image (0x1f1 up to
  // the end the header's jump at 0x201 says), then our fields.
  uint8_t* zp = mem.span(kZeroPage, 4096);
  if (!zp) return internal_error("guest RAM too small for the zero page");
  std::memset(zp, 0, 4096);
  size_t hdr_end = 0x202 + get<uint8_t>(img, 0x201);
  if (hdr_end > 0x280 || hdr_end > img.size()) hdr_end = 0x280;
  std::memcpy(zp + kSetupSects, img.data() + kSetupSects, hdr_end - kSetupSects);
  put<uint8_t>(zp, kTypeOfLoader, 0xff);
  put<uint8_t>(zp, kLoadFlags, static_cast<uint8_t>(get<uint8_t>(img, kLoadFlags) | 0x80));  // CAN_USE_HEAP
  put<uint16_t>(zp, kHeapEndPtr, 0xfe00);
  put<uint32_t>(zp, kCmdLinePtr, static_cast<uint32_t>(kCmdlineAddr));
  put<uint32_t>(zp, kExtCmdLinePtr, 0);
  put<uint32_t>(zp, kRamdiskImage, static_cast<uint32_t>(k.initrd_addr));
  put<uint32_t>(zp, kRamdiskSize, static_cast<uint32_t>(k.initrd_size));
  put<uint32_t>(zp, kExtRamdiskImage, static_cast<uint32_t>(k.initrd_addr >> 32));
  put<uint32_t>(zp, kExtRamdiskSize, static_cast<uint32_t>(k.initrd_size >> 32));
  put<uint64_t>(zp, kAcpiRsdpAddr, kRsdpAddr);

  // e820: low RAM up to the EBDA, the legacy hole reserved, RAM from 1 MiB
  // to the MMIO hole, and RAM above 4 GiB if any.
  E820 map[4];
  size_t n = 0;
  map[n++] = {0, kEbdaStart, kE820Ram};
  map[n++] = {kEbdaStart, 0x100000 - kEbdaStart, kE820Reserved};
  map[n++] = {0x100000, low - 0x100000, kE820Ram};
  if (mem.high_size()) map[n++] = {kHighStart, mem.high_size(), kE820Ram};
  static_assert(4 <= kE820Max);
  put<uint8_t>(zp, kE820Entries, static_cast<uint8_t>(n));
  std::memcpy(zp + kE820Table, map, n * sizeof(E820));
  return k;
}

Status write_long_mode_tables(const GuestMemory& mem) {
  // GDT: null, code64, data, TSS placeholder (KVM needs a valid TR).
  const uint64_t gdt[4] = {0, 0x00af9b000000ffffull, 0x00cf93000000ffffull, 0x008f8b000000ffffull};
  if (!mem.write(kGdtAddr, gdt, sizeof gdt)) return internal_error("guest RAM too small for the GDT");
  // PML4[0] -> PDPT; PDPT[0..3] -> 4 PDs of 512 2-MiB pages each.
  constexpr uint64_t kPdpt = kPml4 + 0x1000, kPd = kPml4 + 0x2000;
  uint8_t* t = mem.span(kPml4, 6 * 0x1000);
  if (!t) return internal_error("guest RAM too small for page tables");
  std::memset(t, 0, 6 * 0x1000);
  uint64_t e = kPdpt | 0x03;  // present | writable
  std::memcpy(t, &e, 8);
  for (uint64_t i = 0; i < 4; ++i) {
    uint64_t pd = (kPd + i * 0x1000) | 0x03;
    std::memcpy(t + 0x1000 + i * 8, &pd, 8);
    for (uint64_t j = 0; j < 512; ++j) {
      uint64_t page = ((i * 512 + j) << 21) | 0x83;  // present | writable | 2 MiB
      std::memcpy(t + 0x2000 + i * 0x1000 + j * 8, &page, 8);
    }
  }
  return {};
}

void boot_sregs(kvm_sregs* s) {
  auto seg = [](kvm_segment* g, uint16_t sel, uint8_t type, bool code) {
    g->base = 0;
    g->limit = 0xffffffff;
    g->selector = sel;
    g->type = type;
    g->present = 1;
    g->dpl = 0;
    g->db = code ? 0 : 1;
    g->s = 1;
    g->l = code ? 1 : 0;
    g->g = 1;
    g->avl = 0;
    g->unusable = 0;
  };
  seg(&s->cs, 0x08, 0x0b, true);
  seg(&s->ds, 0x10, 0x03, false);
  s->es = s->fs = s->gs = s->ss = s->ds;
  s->tr.base = 0;
  s->tr.limit = 0xffff;
  s->tr.selector = 0x18;
  s->tr.type = 0x0b;  // 64-bit busy TSS
  s->tr.present = 1;
  s->tr.s = 0;
  s->tr.g = 0;
  s->tr.unusable = 0;
  s->ldt.selector = 0;
  s->ldt.type = 0x02;
  s->ldt.present = 1;
  s->ldt.unusable = 1;
  s->gdt.base = kGdtAddr;
  s->gdt.limit = 4 * 8 - 1;
  s->idt.base = 0;
  s->idt.limit = 0;
  s->cr0 = 0x80000011ull | 0x20;  // PG | ET | PE | NE
  s->cr3 = kPml4;
  s->cr4 = 0x20;                  // PAE
  s->efer = 0x500;                // LME | LMA
}

kvm_regs boot_regs(uint64_t entry) {
  kvm_regs r{};
  r.rflags = 2;
  r.rip = entry;
  r.rsi = kZeroPage;
  r.rsp = 0x8ff0;  // below the page tables; the kernel sets its own stack
  return r;
}

}  // namespace sg::vmm::boot
