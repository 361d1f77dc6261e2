// VirtioBlk: a virtio block device (VIRTIO 1.2, section 5.2) over a host
// file or block device, one request queue, requests served synchronously
// on the vCPU thread that notified (pread/pwrite straight into guest
// memory). In sandgate it carries a template's root filesystem image,
// opened read-only and shared by every sandbox of the template.
//
// Config space (offset from 0x100 of the transport window):
//   0x00 capacity (u64, 512-byte sectors)   0x08 size_max (u32, unused)
//   0x0c seg_max (u32)   0x14 blk_size (u32, 512)
// Features: VERSION_1, SEG_MAX, BLK_SIZE, FLUSH, and RO when read-only.
// Requests: header (type u32, reserved u32, sector u64), data buffers,
// one status byte (0 OK, 1 IOERR, 2 UNSUPP). Types: IN 0, OUT 1, FLUSH 4,
// GET_ID 8. A request whose buffers are too short, of the wrong direction,
// not a multiple of 512 bytes, or past the end of the disk fails with
// IOERR and touches nothing; a chain without a status byte is completed
// with length 0.
#pragma once

#include <cstdint>
#include <string>

#include "sandbox-runtime/vmm/devices/virtio_mmio.h"

namespace sg::vmm {

class VirtioBlk final : public VirtioDevice {
 public:
  static constexpr uint32_t kDeviceId = 2;
  // fd is borrowed; size_bytes is the disk size (rounded down to sectors).
  VirtioBlk(int fd, uint64_t size_bytes, bool read_only, std::string id);

  uint32_t device_id() const override { return kDeviceId; }
  uint64_t device_features() const override;
  size_t num_queues() const override { return 1; }
  void read_config(uint64_t offset, uint8_t* data, size_t len) override;
  void activate(VirtioMmio&) override {}
  void queue_notify(VirtioMmio& t, size_t queue) override;
  void reset() override {}

  uint64_t requests() const { return requests_; }
  uint64_t errors() const { return errors_; }

 private:
  uint8_t serve(VirtioMmio& t, const Chain& c, uint32_t* written);

  int fd_;
  uint64_t sectors_;
  bool read_only_;
  std::string id_;
  uint64_t requests_ = 0, errors_ = 0;
};

}  // namespace sg::vmm
