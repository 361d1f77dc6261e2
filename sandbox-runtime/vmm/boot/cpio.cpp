// Cpio newc writer.
#include "sandbox-runtime/vmm/boot/cpio.h"

#include <cstdio>

namespace sg::vmm::boot {

namespace {
void pad4(std::string& s) {
  while (s.size() % 4) s.push_back('\0');
}
}  // namespace

void CpioWriter::entry(std::string_view name, uint32_t mode, std::string_view data) {
  char hdr[111];
  std::snprintf(hdr, sizeof hdr, "070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X", ino_++, mode, 0u, 0u, 1u,
                0u, static_cast<uint32_t>(data.size()), 0u, 0u, 0u, 0u, static_cast<uint32_t>(name.size() + 1), 0u);
  out_.append(hdr, 110);
  out_.append(name);
  out_.push_back('\0');
  pad4(out_);
  out_.append(data);
  pad4(out_);
}

void CpioWriter::add_file(std::string_view name, uint32_t mode, std::string_view data) { entry(name, 0100000 | (mode & 07777), data); }
void CpioWriter::add_dir(std::string_view name, uint32_t mode) { entry(name, 0040000 | (mode & 07777), {}); }

std::string CpioWriter::finish() {
  entry("TRAILER!!!", 0, {});
  return std::move(out_);
}

}  // namespace sg::vmm::boot
