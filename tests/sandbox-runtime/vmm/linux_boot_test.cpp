// Linux boot on plain memory: a fake bzImage built here (the setup header
// fields of Documentation/arch/x86/boot.rst), the zero page, command line,
// initramfs placement and e820 map that load_linux writes, its rejections,
// and the long-mode page tables, GDT and boot registers.
#include <doctest/doctest.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "sandbox-runtime/vmm/boot/acpi.h"
#include "sandbox-runtime/vmm/boot/linux_boot.h"
#include "tests/sandbox-runtime/vmm/vmm_harness.h"

using namespace sg;
using namespace sg::vmm;
using namespace sg::vmm::boot;

namespace {

constexpr uint64_t kMiB = 1ull << 20;
constexpr size_t kSetupSects = 4;
constexpr size_t kSetupSize = (kSetupSects + 1) * 512;
constexpr size_t kKernelBytes = 64 * 1024;

template <typename T>
void put(std::string& b, size_t off, T v) {
  std::memcpy(b.data() + off, &v, sizeof v);
}
template <typename T>
T at(const GuestMemory& m, uint64_t gpa) {
  T v{};
  REQUIRE(m.read_obj(gpa, &v));
  return v;
}
template <typename T>
T zp(const GuestMemory& m, size_t off) { return at<T>(m, kZeroPage + off); }

// A bzImage with boot protocol 2.15 whose protected-mode part is a byte
// pattern. Fields as in a Debian kernel.
std::string fake_bzimage(size_t kernel_bytes = kKernelBytes) {
  std::string b(kSetupSize + kernel_bytes, '\0');
  for (size_t i = 0; i < kernel_bytes; ++i) b[kSetupSize + i] = static_cast<char>(i * 13 + 1);
  put<uint8_t>(b, 0x1f1, kSetupSects);
  put<uint16_t>(b, 0x1fe, 0xaa55);
  put<uint8_t>(b, 0x200, 0xeb);  // jmp short: the header ends at 0x202 + 0x66
  put<uint8_t>(b, 0x201, 0x66);
  std::memcpy(b.data() + 0x202, "HdrS", 4);
  put<uint16_t>(b, 0x206, 0x020f);
  put<uint8_t>(b, 0x211, 0x01);               // LOADED_HIGH
  put<uint32_t>(b, 0x22c, 0x7fffffff);        // initrd_addr_max
  put<uint32_t>(b, 0x230, 0x200000);          // kernel_alignment
  put<uint8_t>(b, 0x234, 1);                  // relocatable_kernel
  put<uint16_t>(b, 0x236, 0x0001);            // XLF_KERNEL_64
  put<uint32_t>(b, 0x238, 2047);              // cmdline_size
  put<uint64_t>(b, 0x258, 0x1000000);         // pref_address
  put<uint32_t>(b, 0x260, 8 * kMiB);          // init_size
  put<uint32_t>(b, 0x270, 0xdeadbeef);        // past the header: not copied
  return b;
}

struct E820 {
  uint64_t addr, size;
  uint32_t type;
};
E820 e820(const GuestMemory& m, int i) {
  E820 e{};
  uint64_t base = kZeroPage + 0x2d0 + 20ull * i;
  e.addr = at<uint64_t>(m, base);
  e.size = at<uint64_t>(m, base + 8);
  e.type = at<uint32_t>(m, base + 16);
  return e;
}

std::string initrd_bytes(size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>(i * 31 + 7);
  return s;
}

}  // namespace

TEST_CASE("linux boot: the kernel, initramfs, command line and zero page are laid out") {
  ::unsetenv("SG_NORSDP");
  GuestMemory mem = test::make_ram(64 * kMiB);
  std::memset(mem.span(kZeroPage, 4096), 0xcc, 4096);  // stale bytes must not survive
  std::string img = fake_bzimage();
  std::string initrd = initrd_bytes(10000);
  const std::string cmdline = "console=ttyS0 root=/dev/vda ro";
  auto k = load_linux(mem, img, initrd, cmdline);
  REQUIRE(k.ok());
  CHECK(k->load_addr == 0x1000000);
  CHECK(k->entry == 0x1000000 + 0x200);
  CHECK(std::memcmp(mem.span(k->load_addr, kKernelBytes), img.data() + kSetupSize, kKernelBytes) == 0);

  // Initramfs: page aligned, at the top of RAM (below initrd_addr_max).
  CHECK(k->initrd_addr == ((64 * kMiB - 10000) & ~0xfffull));
  CHECK(k->initrd_size == 10000);
  CHECK(std::memcmp(mem.span(k->initrd_addr, 10000), initrd.data(), 10000) == 0);

  CHECK(std::string(reinterpret_cast<const char*>(mem.span(kCmdlineAddr, cmdline.size() + 1))) == cmdline);

  // The setup header copied from the image, then the loader's fields.
  CHECK(zp<uint16_t>(mem, 0x1fe) == 0xaa55);
  CHECK(zp<uint32_t>(mem, 0x202) == 0x53726448);  // "HdrS"
  CHECK(zp<uint16_t>(mem, 0x206) == 0x020f);
  CHECK(zp<uint8_t>(mem, 0x1f1) == kSetupSects);
  CHECK(zp<uint32_t>(mem, 0x260) == 8 * kMiB);
  CHECK(zp<uint32_t>(mem, 0x270) == 0);  // past the header end
  CHECK(zp<uint8_t>(mem, 0x210) == 0xff);          // type_of_loader: undefined
  CHECK(zp<uint8_t>(mem, 0x211) == (0x01 | 0x80));  // LOADED_HIGH | CAN_USE_HEAP
  CHECK(zp<uint16_t>(mem, 0x224) == 0xfe00);
  CHECK(zp<uint32_t>(mem, 0x228) == kCmdlineAddr);  // cmd_line_ptr
  CHECK(zp<uint32_t>(mem, 0x0c8) == 0);             // ext_cmd_line_ptr
  CHECK(zp<uint32_t>(mem, 0x218) == k->initrd_addr);
  CHECK(zp<uint32_t>(mem, 0x21c) == 10000);
  CHECK(zp<uint32_t>(mem, 0x0c0) == 0);
  CHECK(zp<uint32_t>(mem, 0x0c4) == 0);
  CHECK(zp<uint64_t>(mem, 0x070) == kRsdpAddr);  // acpi_rsdp_addr
  CHECK(zp<uint64_t>(mem, 0x000) == 0);          // the rest was cleared
  CHECK(zp<uint32_t>(mem, 0x1000 - 4) == 0);

  // e820: low RAM, the EBDA/BIOS hole, RAM from 1 MiB.
  REQUIRE(zp<uint8_t>(mem, 0x1e8) == 3);
  E820 e0 = e820(mem, 0), e1 = e820(mem, 1), e2 = e820(mem, 2);
  CHECK((e0.addr == 0 && e0.size == kEbdaStart && e0.type == 1));
  CHECK((e1.addr == kEbdaStart && e1.addr + e1.size == 0x100000 && e1.type == 2));
  CHECK((e2.addr == 0x100000 && e2.size == 63 * kMiB && e2.type == 1));
  // The ACPI tables sit in the reserved hole.
  CHECK((kRsdpAddr >= e1.addr && kAcpiEnd <= e1.addr + e1.size));
}

TEST_CASE("linux boot: no initramfs") {
  GuestMemory mem = test::make_ram(64 * kMiB);
  auto k = load_linux(mem, fake_bzimage(), "", "quiet");
  REQUIRE(k.ok());
  CHECK(k->initrd_addr == 0);
  CHECK(k->initrd_size == 0);
  CHECK(zp<uint32_t>(mem, 0x218) == 0);
  CHECK(zp<uint32_t>(mem, 0x21c) == 0);
}

TEST_CASE("linux boot: RAM above 4 GiB gets its e820 entry, the initramfs stays below initrd_addr_max") {
  GuestMemory mem = test::make_ram(kMmioStart + 64 * kMiB);
  auto k = load_linux(mem, fake_bzimage(), initrd_bytes(5000), "x");
  REQUIRE(k.ok());
  CHECK(k->initrd_addr == ((0x80000000ull - 5000) & ~0xfffull));
  REQUIRE(zp<uint8_t>(mem, 0x1e8) == 4);
  E820 e2 = e820(mem, 2), e3 = e820(mem, 3);
  CHECK((e2.addr == 0x100000 && e2.addr + e2.size == kMmioStart && e2.type == 1));
  CHECK((e3.addr == kHighStart && e3.size == 64 * kMiB && e3.type == 1));
}

TEST_CASE("linux boot: load address follows pref_address, alignment and relocatability") {
  GuestMemory mem = test::make_ram(64 * kMiB);
  std::string img = fake_bzimage();
  put<uint64_t>(img, 0x258, 0x1100000);  // not 2 MiB aligned: a relocatable kernel is moved up
  auto k = load_linux(mem, img, "", "");
  REQUIRE(k.ok());
  CHECK(k->load_addr == 0x1200000);
  put<uint8_t>(img, 0x234, 0);  // not relocatable: exactly pref_address
  k = load_linux(mem, img, "", "");
  REQUIRE(k.ok());
  CHECK(k->load_addr == 0x1100000);
  put<uint64_t>(img, 0x258, 0);  // no preference: 16 MiB
  k = load_linux(mem, img, "", "");
  REQUIRE(k.ok());
  CHECK(k->load_addr == 0x1000000);
  put<uint8_t>(img, 0x1f1, 0);  // setup_sects 0 means 4
  k = load_linux(mem, img, "", "");
  REQUIRE(k.ok());
  CHECK(std::memcmp(mem.span(k->load_addr, 16), img.data() + kSetupSize, 16) == 0);
}

TEST_CASE("linux boot: images that are not 64-bit bzImages are rejected") {
  GuestMemory mem = test::make_ram(64 * kMiB);
  auto rejected = [&](std::string img) {
    auto k = load_linux(mem, img, "", "");
    return !k.ok() && k.error().kind() == ErrorKind::kInvalid;
  };
  CHECK(!rejected(fake_bzimage()));
  CHECK(rejected(fake_bzimage().substr(0, 0xfff)));  // too small
  CHECK(rejected(""));
  std::string img = fake_bzimage();
  put<uint16_t>(img, 0x1fe, 0x55aa);
  CHECK(rejected(img));
  img = fake_bzimage();
  std::memcpy(img.data() + 0x202, "HdrT", 4);
  CHECK(rejected(img));
  img = fake_bzimage();
  put<uint16_t>(img, 0x206, 0x020b);  // 2.11: no 64-bit entry
  CHECK(rejected(img));
  img = fake_bzimage();
  put<uint16_t>(img, 0x236, 0x0002);  // no XLF_KERNEL_64
  CHECK(rejected(img));
  img = fake_bzimage();
  put<uint8_t>(img, 0x211, 0x00);  // not LOADED_HIGH
  CHECK(rejected(img));
  img = fake_bzimage(0x1000);
  put<uint8_t>(img, 0x1f1, 0xff);  // setup larger than the file
  CHECK(rejected(img));
}

TEST_CASE("linux boot: the command line is limited by cmdline_size") {
  GuestMemory mem = test::make_ram(64 * kMiB);
  std::string img = fake_bzimage();
  CHECK(load_linux(mem, img, "", std::string(2047, 'a')).ok());
  CHECK(std::string(reinterpret_cast<const char*>(mem.span(kCmdlineAddr, 2048))) == std::string(2047, 'a'));
  auto k = load_linux(mem, img, "", std::string(2048, 'a'));
  REQUIRE(!k.ok());
  CHECK(k.error().kind() == ErrorKind::kInvalid);
  put<uint32_t>(img, 0x238, 0xffffffff);  // a huge cmdline_size is capped below 64 KiB
  CHECK(load_linux(mem, img, "", std::string(kCmdlineMax - 1, 'b')).ok());
  CHECK(!load_linux(mem, img, "", std::string(kCmdlineMax, 'b')).ok());
}

TEST_CASE("linux boot: a kernel or initramfs that does not fit is rejected") {
  GuestMemory mem = test::make_ram(64 * kMiB);
  std::string img = fake_bzimage();
  put<uint32_t>(img, 0x260, 48 * kMiB);  // 16 + 48 = exactly 64 MiB
  CHECK(load_linux(mem, img, "", "").ok());
  put<uint32_t>(img, 0x260, 48 * kMiB + 4096);
  CHECK(!load_linux(mem, img, "", "").ok());
  img = fake_bzimage();
  put<uint64_t>(img, 0x258, 0x4000000);  // preferred address at the end of RAM
  put<uint8_t>(img, 0x234, 0);
  CHECK(!load_linux(mem, img, "", "").ok());

  img = fake_bzimage();
  CHECK(!load_linux(mem, img, initrd_bytes(41 * kMiB), "").ok());  // would overlap the kernel's 24 MiB
  CHECK(load_linux(mem, img, initrd_bytes(40 * kMiB), "").ok());
  CHECK(!load_linux(mem, img, initrd_bytes(65 * kMiB), "").ok());  // larger than RAM
  put<uint32_t>(img, 0x22c, 0x1ffffff);  // initrd_addr_max 32 MiB: only 8 MiB above the kernel
  CHECK(!load_linux(mem, img, initrd_bytes(9 * kMiB), "").ok());
  auto k = load_linux(mem, img, initrd_bytes(8 * kMiB), "");
  REQUIRE(k.ok());
  CHECK(k->initrd_addr == 24 * kMiB);
}

// Regression: a relocatable kernel's pref_address was aligned up without
// an overflow check, so 0xffffffffffe00001 wrapped to load address 0 and
// the kernel was written over the zero page and page tables' area.
TEST_CASE("linux boot: a pref_address that wraps when aligned is rejected") {
  GuestMemory mem = test::make_ram(64 * kMiB);
  std::string img = fake_bzimage();
  put<uint64_t>(img, 0x258, 0xffffffffffe00001ull);
  CHECK(!load_linux(mem, img, "", "").ok());
  put<uint64_t>(img, 0x258, 0xfffffffffff00000ull);  // load + init_size wraps
  put<uint8_t>(img, 0x234, 0);
  CHECK(!load_linux(mem, img, "", "").ok());
}

// Regression: a non-relocatable kernel was put at its pref_address even
// below 1 MiB, over the zero page, command line and page tables.
TEST_CASE("linux boot: a kernel that must load below 1 MiB is rejected") {
  GuestMemory mem = test::make_ram(64 * kMiB);
  std::string img = fake_bzimage();
  put<uint8_t>(img, 0x234, 0);
  put<uint64_t>(img, 0x258, 0x7000);
  CHECK(!load_linux(mem, img, "", "").ok());
  put<uint8_t>(img, 0x234, 1);  // relocatable: moved to 1 MiB and aligned
  auto k = load_linux(mem, img, "", "");
  REQUIRE(k.ok());
  CHECK(k->load_addr == 0x200000);
}

TEST_CASE("linux boot: page tables identity-map 4 GiB with 2 MiB pages") {
  GuestMemory mem = test::make_ram(16 * kMiB);
  std::memset(mem.span(kPml4, 6 * 4096), 0xee, 6 * 4096);
  REQUIRE(write_long_mode_tables(mem).ok());
  const uint64_t pdpt = kPml4 + 0x1000;
  CHECK(at<uint64_t>(mem, kPml4) == (pdpt | 0x03));
  for (int i = 1; i < 512; ++i) REQUIRE(at<uint64_t>(mem, kPml4 + 8ull * i) == 0);
  for (uint64_t i = 0; i < 4; ++i) CHECK(at<uint64_t>(mem, pdpt + 8 * i) == ((kPml4 + 0x2000 + i * 0x1000) | 0x03));
  for (int i = 4; i < 512; ++i) REQUIRE(at<uint64_t>(mem, pdpt + 8ull * i) == 0);

  // A walk of the tables gives back every address it is asked about.
  auto walk = [&](uint64_t va) -> uint64_t {
    uint64_t e4 = at<uint64_t>(mem, kPml4 + 8 * ((va >> 39) & 511));
    REQUIRE((e4 & 1) != 0);
    uint64_t e3 = at<uint64_t>(mem, (e4 & ~0xfffull) + 8 * ((va >> 30) & 511));
    REQUIRE((e3 & 1) != 0);
    REQUIRE((e3 & 0x80) == 0);
    uint64_t e2 = at<uint64_t>(mem, (e3 & ~0xfffull) + 8 * ((va >> 21) & 511));
    REQUIRE((e2 & 0x83) == 0x83);  // present, writable, 2 MiB page
    return (e2 & ~0x1fffffull) + (va & 0x1fffff);
  };
  for (uint64_t va : {0ull, 0x7000ull, 0x1000200ull, 0x3fffffffull, 0x40000000ull, 0xbfffffffull, 0xd0000000ull,
                      0xfee00000ull, 0xffffffffull})
    CHECK(walk(va) == va);
  for (uint64_t p = 0; p < 2048; ++p) REQUIRE(walk(p << 21) == p << 21);

  // GDT: null, 64-bit code, data, TSS.
  uint64_t code = at<uint64_t>(mem, kGdtAddr + 8), data = at<uint64_t>(mem, kGdtAddr + 16);
  CHECK(at<uint64_t>(mem, kGdtAddr) == 0);
  CHECK(((code >> 53) & 1) == 1);    // L
  CHECK(((code >> 54) & 1) == 0);    // D must be clear with L
  CHECK(((code >> 47) & 1) == 1);    // present
  CHECK(((code >> 40) & 0xf) == 0xb);
  CHECK(((data >> 40) & 0xf) == 0x3);
  CHECK(((data >> 47) & 1) == 1);
}

TEST_CASE("linux boot: boot registers start the vCPU in long mode") {
  kvm_sregs s{};
  boot_sregs(&s);
  CHECK((s.efer & 0x100) != 0);  // LME
  CHECK((s.efer & 0x400) != 0);  // LMA
  CHECK((s.cr0 & (1ull << 31)) != 0);  // PG
  CHECK((s.cr0 & 1) != 0);             // PE
  CHECK((s.cr4 & 0x20) != 0);          // PAE
  CHECK(s.cr3 == kPml4);
  CHECK(s.cs.l == 1);
  CHECK(s.cs.db == 0);
  CHECK(s.cs.present == 1);
  CHECK(s.cs.selector == 0x08);  // GDT entry 1
  CHECK(s.ds.selector == 0x10);
  CHECK(s.ss.selector == 0x10);
  CHECK(s.tr.selector == 0x18);
  CHECK(s.gdt.base == kGdtAddr);
  CHECK(s.gdt.limit == 31);
  kvm_regs r = boot_regs(0x1000200);
  CHECK(r.rip == 0x1000200);
  CHECK(r.rsi == kZeroPage);
  CHECK((r.rflags & 2) != 0);
}
