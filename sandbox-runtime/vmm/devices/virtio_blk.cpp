// VirtioBlk: request validation and synchronous I/O.
#include "sandbox-runtime/vmm/devices/virtio_blk.h"

#include <unistd.h>

#include <cstring>

namespace sg::vmm {

namespace {
constexpr uint64_t kFSegMax = 1ull << 2, kFRo = 1ull << 5, kFBlkSize = 1ull << 6, kFFlush = 1ull << 9;
constexpr uint32_t kTypeIn = 0, kTypeOut = 1, kTypeFlush = 4, kTypeGetId = 8;
constexpr uint8_t kStatusOk = 0, kStatusIoErr = 1, kStatusUnsupp = 2;
constexpr uint32_t kSegMax = 126;
constexpr uint64_t kSector = 512;

struct Header {
  uint32_t type;
  uint32_t reserved;
  uint64_t sector;
};
}  // namespace

VirtioBlk::VirtioBlk(int fd, uint64_t size_bytes, bool read_only, std::string id)
    : fd_(fd), sectors_(size_bytes / kSector), read_only_(read_only), id_(std::move(id)) {}

uint64_t VirtioBlk::device_features() const {
  return kVirtioFVersion1 | kFSegMax | kFBlkSize | kFFlush | (read_only_ ? kFRo : 0);
}

void VirtioBlk::read_config(uint64_t offset, uint8_t* data, size_t len) {
  uint8_t cfg[24] = {};
  std::memcpy(cfg + 0x00, &sectors_, 8);
  std::memcpy(cfg + 0x0c, &kSegMax, 4);
  uint32_t bs = kSector;
  std::memcpy(cfg + 0x14, &bs, 4);
  for (size_t i = 0; i < len; ++i) data[i] = offset + i < sizeof cfg ? cfg[offset + i] : 0;
}

uint8_t VirtioBlk::serve(VirtioMmio& t, const Chain& c, uint32_t* written) {
  const GuestMemory& mem = t.memory();
  const Descriptor& hd = c.descs.front();
  Header h{};
  if (hd.write || hd.len < sizeof h || !mem.read_obj(hd.addr, &h)) return kStatusIoErr;
  size_t first = 1, last = c.descs.size() - 1;  // data descriptors are [first, last)
  uint64_t total = 0;
  for (size_t i = first; i < last; ++i) total += c.descs[i].len;
  switch (h.type) {
    case kTypeIn:
    case kTypeOut: {
      bool in = h.type == kTypeIn;
      if (!in && read_only_) return kStatusIoErr;
      if (total % kSector != 0 || h.sector > sectors_ || total / kSector > sectors_ - h.sector) return kStatusIoErr;
      // Every buffer's direction is checked before any I/O: a bad one
      // later in the chain must not leave earlier ones half done (an OUT
      // writing the disk, an IN filling guest memory, then IOERR).
      for (size_t i = first; i < last; ++i)
        if (c.descs[i].write != in) return kStatusIoErr;
      uint64_t off = h.sector * kSector;
      for (size_t i = first; i < last; ++i) {
        const Descriptor& d = c.descs[i];
        uint8_t* p = mem.span(d.addr, d.len);
        if (!p) return kStatusIoErr;
        uint64_t done = 0;
        while (done < d.len) {
          ssize_t n = in ? ::pread(fd_, p + done, d.len - done, static_cast<off_t>(off + done))
                         : ::pwrite(fd_, p + done, d.len - done, static_cast<off_t>(off + done));
          if (n < 0 && errno == EINTR) continue;
          if (n <= 0) {
            if (in && n == 0) {  // past the file's end (a shrunk image): zeros
              std::memset(p + done, 0, d.len - done);
              done = d.len;
              break;
            }
            return kStatusIoErr;
          }
          done += static_cast<uint64_t>(n);
        }
        off += d.len;
        if (in) *written += d.len;
      }
      return kStatusOk;
    }
    case kTypeFlush:
      if (!read_only_ && ::fdatasync(fd_) != 0) return kStatusIoErr;
      return kStatusOk;
    case kTypeGetId: {
      if (last != first + 1 || !c.descs[first].write) return kStatusIoErr;
      const Descriptor& d = c.descs[first];
      char id[20] = {};
      std::memcpy(id, id_.data(), id_.size() < sizeof id ? id_.size() : sizeof id);
      uint32_t n = d.len < sizeof id ? d.len : static_cast<uint32_t>(sizeof id);
      if (!mem.write(d.addr, id, n)) return kStatusIoErr;
      *written += n;
      return kStatusOk;
    }
    default: return kStatusUnsupp;
  }
}

void VirtioBlk::queue_notify(VirtioMmio& t, size_t queue) {
  if (queue != 0) return;
  Virtqueue& q = t.queue(0);
  const GuestMemory& mem = t.memory();
  bool any = false;
  while (auto c = q.pop(mem)) {
    any = true;
    ++requests_;
    if (!c->valid || c->descs.size() < 2 || !c->descs.back().write || c->descs.back().len < 1) {
      ++errors_;
      q.add_used(mem, c->head, 0);
      continue;
    }
    uint32_t written = 0;
    uint8_t status = serve(t, *c, &written);
    if (status != kStatusOk) {
      ++errors_;
      written = 0;
    }
    const Descriptor& sd = c->descs.back();
    mem.write_obj(sd.addr + sd.len - 1, status);
    q.add_used(mem, c->head, written + 1);
  }
  if (q.broken()) t.needs_reset();
  if (any) t.signal_used(0);
}

}  // namespace sg::vmm
