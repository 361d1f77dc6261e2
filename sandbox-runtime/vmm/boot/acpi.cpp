// ACPI table writer and the few AML encodings the DSDT needs.
#include "sandbox-runtime/vmm/boot/acpi.h"

#include <cstring>

namespace sg::vmm::boot {

namespace {

class Bytes {
 public:
  template <typename T>
  void put(T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    b.insert(b.end(), p, p + sizeof(T));
  }
  void str(const char* s, size_t n) {
    for (size_t i = 0; i < n; ++i) b.push_back(static_cast<uint8_t>(s[i]));
  }
  void append(const std::vector<uint8_t>& o) { b.insert(b.end(), o.begin(), o.end()); }
  void zeros(size_t n) { b.insert(b.end(), n, 0); }
  std::vector<uint8_t> b;
};

// The 36-byte header every system description table starts with; length
// and checksum are patched by finish().
void sdt_header(Bytes& t, const char* sig, uint8_t revision) {
  t.str(sig, 4);
  t.put<uint32_t>(0);  // length
  t.put<uint8_t>(revision);
  t.put<uint8_t>(0);   // checksum
  t.str("SGATE ", 6);
  t.str("SANDGATE", 8);
  t.put<uint32_t>(1);
  t.str("SGVM", 4);
  t.put<uint32_t>(1);
}

void finish(Bytes& t) {
  uint32_t len = static_cast<uint32_t>(t.b.size());
  std::memcpy(t.b.data() + 4, &len, 4);
  t.b[9] = 0;
  t.b[9] = acpi_checksum(t.b.data(), t.b.size());
}

// AML PkgLength for a package whose content (after the PkgLength) is n bytes.
std::vector<uint8_t> pkg_length(size_t n) {
  if (n + 1 < 0x40) return {static_cast<uint8_t>(n + 1)};
  size_t t = n + 2;
  if (t < 0x1000) return {static_cast<uint8_t>(0x40 | (t & 0xf)), static_cast<uint8_t>(t >> 4)};
  t = n + 3;
  return {static_cast<uint8_t>(0x80 | (t & 0xf)), static_cast<uint8_t>(t >> 4), static_cast<uint8_t>(t >> 12)};
}

// Generic Address Structure (12 bytes), all zero: "not present".
void gas_none(Bytes& t) { t.zeros(12); }

}  // namespace

uint8_t acpi_checksum(const uint8_t* p, size_t n) {
  uint8_t s = 0;
  for (size_t i = 0; i < n; ++i) s = static_cast<uint8_t>(s + p[i]);
  return static_cast<uint8_t>(0 - s);
}

std::vector<uint8_t> virtio_mmio_aml(const std::vector<MmioDeviceInfo>& devices) {
  Bytes body;  // the TermList of Scope(\_SB)
  for (size_t i = 0; i < devices.size(); ++i) {
    const MmioDeviceInfo& d = devices[i];
    Bytes crs;  // resource template bytes
    crs.put<uint8_t>(0x86);  // Memory32Fixed
    crs.put<uint16_t>(9);
    crs.put<uint8_t>(1);     // read-write
    crs.put<uint32_t>(static_cast<uint32_t>(d.base));
    crs.put<uint32_t>(d.size);
    crs.put<uint8_t>(0x89);  // Extended Interrupt
    crs.put<uint16_t>(6);
    crs.put<uint8_t>(0x03);  // consumer, edge, active high, exclusive
    crs.put<uint8_t>(1);
    crs.put<uint32_t>(d.irq);
    crs.put<uint8_t>(0x79);  // End Tag
    crs.put<uint8_t>(0);
    Bytes buf;  // BufferOp content: BufferSize then bytes
    buf.put<uint8_t>(0x0a);
    buf.put<uint8_t>(static_cast<uint8_t>(crs.b.size()));
    buf.append(crs.b);

    Bytes dev;  // Device TermList
    dev.put<uint8_t>(0x08);  // Name(_HID, "LNRO0005")
    dev.str("_HID", 4);
    dev.put<uint8_t>(0x0d);
    dev.str("LNRO0005", 8);
    dev.put<uint8_t>(0);
    dev.put<uint8_t>(0x08);  // Name(_UID, i)
    dev.str("_UID", 4);
    dev.put<uint8_t>(0x0a);
    dev.put<uint8_t>(static_cast<uint8_t>(i));
    dev.put<uint8_t>(0x08);  // Name(_CRS, Buffer)
    dev.str("_CRS", 4);
    dev.put<uint8_t>(0x11);
    dev.append(pkg_length(buf.b.size()));
    dev.append(buf.b);

    char name[5];
    std::snprintf(name, sizeof name, "VR%02zu", i);
    Bytes content;
    content.str(name, 4);
    content.append(dev.b);
    body.put<uint8_t>(0x5b);  // DeviceOp
    body.put<uint8_t>(0x82);
    body.append(pkg_length(content.b.size()));
    body.append(content.b);
  }
  Bytes scope_content;
  scope_content.put<uint8_t>(0x5c);  // root prefix '\'
  scope_content.str("_SB_", 4);
  scope_content.append(body.b);
  Bytes aml;
  aml.put<uint8_t>(0x10);  // ScopeOp
  aml.append(pkg_length(scope_content.b.size()));
  aml.append(scope_content.b);
  return aml.b;
}

Status write_acpi_tables(const GuestMemory& mem, uint32_t cpus, const std::vector<MmioDeviceInfo>& devices) {
  if (cpus == 0 || cpus > kMaxCpus) return invalid_error("vCPU count must be 1.." + std::to_string(kMaxCpus));
  const uint64_t xsdt_addr = kRsdpAddr + 0x40;

  Bytes dsdt;
  sdt_header(dsdt, "DSDT", 2);
  dsdt.append(virtio_mmio_aml(devices));
  finish(dsdt);

  Bytes madt;
  sdt_header(madt, "APIC", 5);
  madt.put<uint32_t>(kLapicAddr);
  madt.put<uint32_t>(1);  // PCAT_COMPAT: the 8259 PICs exist (KVM's in-kernel PIC)
  for (uint32_t i = 0; i < cpus; ++i) {
    madt.put<uint8_t>(0);  // Processor Local APIC
    madt.put<uint8_t>(8);
    madt.put<uint8_t>(static_cast<uint8_t>(i));  // ACPI processor UID
    madt.put<uint8_t>(static_cast<uint8_t>(i));  // APIC ID
    madt.put<uint32_t>(1);                       // enabled
  }
  madt.put<uint8_t>(1);  // I/O APIC
  madt.put<uint8_t>(12);
  madt.put<uint8_t>(static_cast<uint8_t>(cpus));  // its ID, after the LAPICs
  madt.put<uint8_t>(0);
  madt.put<uint32_t>(kIoapicAddr);
  madt.put<uint32_t>(0);  // GSI base
  finish(madt);

  // Addresses: XSDT, then FADT, MADT, DSDT, each 8-byte aligned.
  auto align8 = [](uint64_t v) { return (v + 7) & ~7ull; };
  const uint64_t xsdt_len = 36 + 2 * 8;
  const uint64_t fadt_addr = align8(xsdt_addr + xsdt_len);
  const uint64_t fadt_len = 276;
  const uint64_t madt_addr = align8(fadt_addr + fadt_len);
  const uint64_t dsdt_addr = align8(madt_addr + madt.b.size());
  if (dsdt_addr + dsdt.b.size() > kAcpiEnd) return internal_error("ACPI tables do not fit below 1 MiB");

  Bytes fadt;
  sdt_header(fadt, "FACP", 6);
  fadt.put<uint32_t>(0);                                  // 36 FIRMWARE_CTRL
  fadt.put<uint32_t>(static_cast<uint32_t>(dsdt_addr));   // 40 DSDT
  fadt.zeros(109 - 44);                                   // 44..108: no PM/GPE blocks
  fadt.put<uint16_t>(1u << 2);                            // 109 IAPC_BOOT_ARCH: no VGA
  fadt.put<uint8_t>(0);                                   // 111
  fadt.put<uint32_t>(1u << 20);                           // 112 flags: HW_REDUCED_ACPI
  gas_none(fadt);                                         // 116 RESET_REG
  fadt.put<uint8_t>(0);                                   // 128 RESET_VALUE
  fadt.put<uint16_t>(0);                                  // 129 ARM_BOOT_ARCH
  fadt.put<uint8_t>(4);                                   // 131 minor version (6.4)
  fadt.put<uint64_t>(0);                                  // 132 X_FIRMWARE_CTRL
  fadt.put<uint64_t>(dsdt_addr);                          // 140 X_DSDT
  for (int i = 0; i < 8; ++i) gas_none(fadt);             // 148..243 X_PM*/X_GPE*
  gas_none(fadt);                                         // 244 SLEEP_CONTROL_REG
  gas_none(fadt);                                         // 256 SLEEP_STATUS_REG
  fadt.str("SANDGATE", 8);                                // 268 hypervisor vendor
  if (fadt.b.size() != fadt_len) return internal_error("FADT layout is wrong");
  finish(fadt);

  Bytes xsdt;
  sdt_header(xsdt, "XSDT", 1);
  xsdt.put<uint64_t>(fadt_addr);
  xsdt.put<uint64_t>(madt_addr);
  finish(xsdt);

  Bytes rsdp;
  rsdp.str("RSD PTR ", 8);
  rsdp.put<uint8_t>(0);  // checksum of the first 20 bytes
  rsdp.str("SGATE ", 6);
  rsdp.put<uint8_t>(2);  // revision: ACPI 2.0+
  rsdp.put<uint32_t>(0); // RSDT: none, XSDT only
  rsdp.put<uint32_t>(36);
  rsdp.put<uint64_t>(xsdt_addr);
  rsdp.put<uint8_t>(0);  // extended checksum
  rsdp.zeros(3);
  rsdp.b[8] = acpi_checksum(rsdp.b.data(), 20);
  rsdp.b[32] = acpi_checksum(rsdp.b.data(), 36);

  if (!mem.write(kRsdpAddr, rsdp.b.data(), rsdp.b.size()) || !mem.write(xsdt_addr, xsdt.b.data(), xsdt.b.size()) ||
      !mem.write(fadt_addr, fadt.b.data(), fadt.b.size()) || !mem.write(madt_addr, madt.b.data(), madt.b.size()) ||
      !mem.write(dsdt_addr, dsdt.b.data(), dsdt.b.size()))
    return internal_error("guest RAM too small for the ACPI tables");
  return {};
}

}  // namespace sg::vmm::boot
