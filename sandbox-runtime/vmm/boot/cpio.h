// Cpio: writes "newc" cpio archives (the initramfs format, see the kernel's
// Documentation/driver-api/early-userspace/buffer-format.rst). The VMM
// appends one holding the agent binary to the guest image's initramfs, so
// the image never has to be rebuilt when the agent changes.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace sg::vmm::boot {

class CpioWriter {
 public:
  // name without a leading '/'; mode includes the file type bits.
  void add_file(std::string_view name, uint32_t mode, std::string_view data);
  void add_dir(std::string_view name, uint32_t mode);
  // Appends the trailer and returns the archive (a multiple of 4 bytes).
  std::string finish();

 private:
  void entry(std::string_view name, uint32_t mode, std::string_view data);
  std::string out_;
  uint32_t ino_ = 1;
};

}  // namespace sg::vmm::boot
