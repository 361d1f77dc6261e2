// ACPI tables read back from guest memory: RSDP checksums, the XSDT's
// entries, every table's checksum, the MADT's LAPICs and I/O APIC, the
// FADT's flags and X_DSDT, and the DSDT's AML decoded far enough to check
// each virtio-mmio Device's PkgLength, _HID, Memory32Fixed and interrupt.
#include <doctest/doctest.h>

#include <cstring>
#include <string>
#include <vector>

#include "sandbox-runtime/vmm/boot/acpi.h"
#include "tests/sandbox-runtime/vmm/vmm_harness.h"

using namespace sg;
using namespace sg::vmm;
using namespace sg::vmm::boot;

namespace {

template <typename T>
T at(const uint8_t* p) {
  T v{};
  std::memcpy(&v, p, sizeof v);
  return v;
}

uint8_t sum(const uint8_t* p, size_t n) {
  uint8_t s = 0;
  for (size_t i = 0; i < n; ++i) s = static_cast<uint8_t>(s + p[i]);
  return s;
}

// A table in guest memory: checks it lies in the ACPI area and sums to 0.
const uint8_t* table(const GuestMemory& m, uint64_t gpa, const char* sig) {
  REQUIRE(gpa >= kRsdpAddr);
  const uint8_t* h = m.span(gpa, 36);
  REQUIRE(h != nullptr);
  REQUIRE(std::string(reinterpret_cast<const char*>(h), 4) == sig);
  uint32_t len = at<uint32_t>(h + 4);
  REQUIRE(len >= 36);
  REQUIRE(gpa + len <= kAcpiEnd);
  CHECK(sum(h, len) == 0);
  return h;
}

// AML PkgLength (ACPI 6.4, 20.2.4): returns the encoded length (which
// counts the PkgLength bytes themselves) and sets *n to their count.
uint32_t pkg_length(const uint8_t* p, size_t* n) {
  uint8_t lead = p[0];
  size_t follow = lead >> 6;
  *n = 1 + follow;
  if (follow == 0) return lead & 0x3f;
  uint32_t len = lead & 0x0f;
  for (size_t i = 0; i < follow; ++i) len |= static_cast<uint32_t>(p[1 + i]) << (4 + 8 * i);
  return len;
}

size_t count(const std::vector<uint8_t>& hay, const std::string& needle) {
  size_t c = 0;
  for (size_t i = 0; i + needle.size() <= hay.size(); ++i)
    if (std::memcmp(hay.data() + i, needle.data(), needle.size()) == 0) ++c;
  return c;
}

// Walks Scope(\_SB) { Device(VRnn) {...} ... } and checks each device.
void check_aml(const std::vector<uint8_t>& aml, const std::vector<MmioDeviceInfo>& devs) {
  REQUIRE(aml.size() > 6);
  REQUIRE(aml[0] == 0x10);  // ScopeOp
  size_t n = 0;
  uint32_t scope_len = pkg_length(&aml[1], &n);
  CHECK(1 + scope_len == aml.size());  // the scope spans the whole body
  size_t pos = 1 + n;
  REQUIRE(std::memcmp(&aml[pos], "\\_SB_", 5) == 0);
  pos += 5;
  CHECK(count(aml, "LNRO0005") == devs.size());
  for (size_t i = 0; i < devs.size(); ++i) {
    REQUIRE(pos + 2 < aml.size());
    REQUIRE(aml[pos] == 0x5b);  // DeviceOp
    REQUIRE(aml[pos + 1] == 0x82);
    size_t pn = 0;
    uint32_t len = pkg_length(&aml[pos + 2], &pn);
    size_t start = pos + 2, end = start + len;
    REQUIRE(end <= aml.size());
    std::vector<uint8_t> dev(aml.begin() + static_cast<long>(start + pn), aml.begin() + static_cast<long>(end));
    char name[24];
    std::snprintf(name, sizeof name, "VR%02zu", i);
    CHECK(std::memcmp(dev.data(), name, 4) == 0);
    CHECK(count(dev, "LNRO0005") == 1);  // exactly one _HID inside exactly this span
    CHECK(count(dev, "_HID") == 1);
    CHECK(count(dev, "_CRS") == 1);
    // Memory32Fixed: tag 0x86, length 9, read-write, base, size.
    std::vector<uint8_t> mem32{0x86, 0x09, 0x00, 0x01};
    for (int b = 0; b < 4; ++b) mem32.push_back(static_cast<uint8_t>(devs[i].base >> (8 * b)));
    for (int b = 0; b < 4; ++b) mem32.push_back(static_cast<uint8_t>(devs[i].size >> (8 * b)));
    CHECK(count(dev, std::string(mem32.begin(), mem32.end())) == 1);
    // Extended Interrupt: tag 0x89, length 6, consumer|edge, one interrupt.
    std::vector<uint8_t> irq{0x89, 0x06, 0x00, 0x03, 0x01};
    for (int b = 0; b < 4; ++b) irq.push_back(static_cast<uint8_t>(devs[i].irq >> (8 * b)));
    CHECK(count(dev, std::string(irq.begin(), irq.end())) == 1);
    // _CRS: Name(_CRS, Buffer(PkgLength, ByteConst size, bytes)) ends the device.
    size_t crs = 0;
    while (crs + 4 <= dev.size() && std::memcmp(&dev[crs], "_CRS", 4) != 0) ++crs;
    REQUIRE(dev[crs + 4] == 0x11);  // BufferOp
    size_t bn = 0;
    uint32_t blen = pkg_length(&dev[crs + 5], &bn);
    CHECK(crs + 5 + blen == dev.size());
    REQUIRE(dev[crs + 5 + bn] == 0x0a);
    uint8_t bsize = dev[crs + 5 + bn + 1];
    CHECK(crs + 5 + bn + 2 + bsize == dev.size());
    CHECK(dev[dev.size() - 2] == 0x79);  // End Tag
    pos = end;
  }
  CHECK(pos == aml.size());  // nothing after the last device
}

struct Tables {
  const uint8_t* rsdp;
  const uint8_t* xsdt;
  const uint8_t* fadt;
  const uint8_t* madt;
  const uint8_t* dsdt;
};

Tables read_tables(const GuestMemory& m) {
  Tables t{};
  t.rsdp = m.span(kRsdpAddr, 36);
  REQUIRE(t.rsdp != nullptr);
  REQUIRE(std::memcmp(t.rsdp, "RSD PTR ", 8) == 0);
  CHECK(sum(t.rsdp, 20) == 0);
  CHECK(sum(t.rsdp, 36) == 0);
  CHECK(t.rsdp[15] == 2);
  CHECK(at<uint32_t>(t.rsdp + 16) == 0);  // no RSDT
  CHECK(at<uint32_t>(t.rsdp + 20) == 36);
  t.xsdt = table(m, at<uint64_t>(t.rsdp + 24), "XSDT");
  uint32_t xlen = at<uint32_t>(t.xsdt + 4);
  REQUIRE(xlen == 36 + 16);
  uint64_t e0 = at<uint64_t>(t.xsdt + 36), e1 = at<uint64_t>(t.xsdt + 44);
  CHECK(e0 % 8 == 0);
  CHECK(e1 % 8 == 0);
  t.fadt = table(m, e0, "FACP");
  t.madt = table(m, e1, "APIC");
  CHECK(at<uint32_t>(t.fadt + 4) == 276);
  CHECK(t.fadt[8] == 6);
  uint64_t x_dsdt = at<uint64_t>(t.fadt + 140);
  CHECK(at<uint32_t>(t.fadt + 40) == x_dsdt);
  t.dsdt = table(m, x_dsdt, "DSDT");
  return t;
}

}  // namespace

TEST_CASE("acpi: checksum helper") {
  const uint8_t b[] = {1, 2, 3};
  CHECK(acpi_checksum(b, 3) == 0xfa);
  CHECK(acpi_checksum(b, 0) == 0);
}

TEST_CASE("acpi: tables for 2 vCPUs and two virtio-mmio devices") {
  GuestMemory mem = test::make_ram(16u << 20);
  std::vector<MmioDeviceInfo> devs{{0xd0000000, 0x1000, 5}, {0xd0001000, 0x1000, 6}};
  REQUIRE(write_acpi_tables(mem, 2, devs).ok());
  Tables t = read_tables(mem);

  // FADT: hardware-reduced, no PM blocks, no VGA.
  uint32_t flags = at<uint32_t>(t.fadt + 112);
  CHECK((flags & (1u << 20)) != 0);
  CHECK(at<uint16_t>(t.fadt + 109) == 4);
  for (size_t off = 44; off < 109; ++off) REQUIRE(t.fadt[off] == 0);

  // MADT: the local APIC address, one LAPIC per vCPU, one I/O APIC.
  CHECK(at<uint32_t>(t.madt + 36) == kLapicAddr);
  uint32_t len = at<uint32_t>(t.madt + 4);
  int lapics = 0, ioapics = 0;
  for (size_t off = 44; off < len;) {
    uint8_t type = t.madt[off], elen = t.madt[off + 1];
    REQUIRE(elen >= 2);
    REQUIRE(off + elen <= len);
    if (type == 0) {
      CHECK(elen == 8);
      CHECK(t.madt[off + 2] == lapics);  // processor UID
      CHECK(t.madt[off + 3] == lapics);  // APIC ID
      CHECK(at<uint32_t>(t.madt + off + 4) == 1);  // enabled
      ++lapics;
    } else if (type == 1) {
      CHECK(elen == 12);
      CHECK(t.madt[off + 2] == 2);  // I/O APIC ID after the LAPICs
      CHECK(at<uint32_t>(t.madt + off + 4) == kIoapicAddr);
      CHECK(at<uint32_t>(t.madt + off + 8) == 0);
      ++ioapics;
    }
    off += elen;
  }
  CHECK(lapics == 2);
  CHECK(ioapics == 1);

  uint32_t dlen = at<uint32_t>(t.dsdt + 4);
  std::vector<uint8_t> aml(t.dsdt + 36, t.dsdt + dlen);
  CHECK(aml == virtio_mmio_aml(devs));
  check_aml(aml, devs);
}

TEST_CASE("acpi: AML PkgLength encodings of one, two and three bytes") {
  for (size_t n : {size_t{0}, size_t{1}, size_t{3}, size_t{8}, size_t{70}}) {
    std::vector<MmioDeviceInfo> devs;
    for (size_t i = 0; i < n; ++i)
      devs.push_back({0xd0000000 + 0x1000 * i, 0x1000, static_cast<uint32_t>(5 + i)});
    std::vector<uint8_t> aml = virtio_mmio_aml(devs);
    CAPTURE(n);
    check_aml(aml, devs);
    size_t pn = 0;
    pkg_length(&aml[1], &pn);
    CHECK(pn == (aml.size() < 0x40 ? 1 : aml.size() < 0x1000 ? 2 : 3));
  }
  // Large interrupt numbers and a 64-bit-looking base keep their 32 bits.
  std::vector<MmioDeviceInfo> odd{{0xfffff000, 0xffffffff, 0x12345678}};
  check_aml(virtio_mmio_aml(odd), odd);
}

TEST_CASE("acpi: 32 vCPUs and 70 devices fit; 0 and 33 vCPUs are refused") {
  GuestMemory mem = test::make_ram(16u << 20);
  std::vector<MmioDeviceInfo> devs;
  for (uint32_t i = 0; i < 70; ++i) devs.push_back({0xd0000000ull + 0x1000 * i, 0x1000, 5 + i});
  REQUIRE(write_acpi_tables(mem, kMaxCpus, devs).ok());
  Tables t = read_tables(mem);
  uint32_t len = at<uint32_t>(t.madt + 4);
  CHECK(len == 44 + 8 * kMaxCpus + 12);
  uint32_t dlen = at<uint32_t>(t.dsdt + 4);
  check_aml(std::vector<uint8_t>(t.dsdt + 36, t.dsdt + dlen), devs);

  for (uint32_t cpus : {0u, kMaxCpus + 1, 255u}) {
    Status s = write_acpi_tables(mem, cpus, devs);
    REQUIRE(!s.ok());
    CHECK(s.error().kind() == ErrorKind::kInvalid);
  }
  GuestMemory tiny = test::make_ram(1u << 20);  // the ACPI area is the last 128 KiB of 1 MiB: fits
  CHECK(write_acpi_tables(tiny, 1, {}).ok());
}
