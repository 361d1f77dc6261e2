// Free-space admission for process sandboxes' writable layers (issue 17
// item 5). A size-limited layer is a sparse image of the template's disk
// size (disk.h): it takes almost nothing at create and grows as the sandbox
// writes, so without admission N sandboxes each inside its own limit could
// together fill the filesystem of the state root, the host's data directory.
// A create therefore reserves its disk's full size against that filesystem:
//
//   available = free (statvfs f_bavail)
//             - promised (what live sandboxes' images could still grow by:
//                         reserved size minus the blocks each already holds)
//             - kDiskFreeMargin
//
// and is refused (kQuota) when its size does not fit. An unlimited layer
// (disk limits off, or a template without a disk size) cannot be bounded;
// such a create is refused only when available < 0. The bookkeeping covers
// this Runtime's sandboxes: another sandgate, or anything else, writing to
// the same filesystem shows up only through the free space it takes.
//
// Thread safety: DiskSpace is internally synchronised; admission is atomic
// (two creates never both take the last free bytes). A Reservation is
// owned by one sandbox.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "base/status.h"

namespace sg::process {

// Kept free on the state root's filesystem whatever the sandboxes' disks:
// room for the host's own writes (logs, the database, templates) and for
// what the estimate misses (ext4 metadata written at mount, directories).
inline constexpr uint64_t kDiskFreeMargin = 256ull << 20;

// The decision alone, on numbers (bytes): OK, or kQuota naming the free
// space, the promised space, the margin, the size asked for and what to do.
Status admit_disk(uint64_t free, uint64_t promised, uint64_t need);

class DiskSpace : public std::enable_shared_from_this<DiskSpace> {
 public:
  // root: a directory on the filesystem to account (the state root).
  static std::shared_ptr<DiskSpace> make(std::string root);

  // Holds a sandbox's share until destroyed (move-only; an empty one holds
  // nothing).
  class Reservation {
   public:
    Reservation() = default;
    Reservation(Reservation&& o) noexcept { *this = std::move(o); }
    Reservation& operator=(Reservation&& o) noexcept;
    ~Reservation() { reset(); }
    void reset();

   private:
    friend class DiskSpace;
    std::shared_ptr<DiskSpace> owner_;
    uint64_t key_ = 0;
  };

  // Reserves bytes for a disk whose image will be the sparse file image
  // (absent until made; its allocated blocks count against the reservation
  // once it exists). bytes 0: an unlimited layer, admitted while the
  // margin is free. kQuota when it does not fit; nothing is reserved then.
  Result<Reservation> reserve(uint64_t bytes, std::string image);
  // Counts a disk that exists already (a sandbox a previous run of sandgate
  // left running, taken back): never refused, as its bytes are the host's
  // already.
  Reservation adopt(uint64_t bytes, std::string image);

 private:
  explicit DiskSpace(std::string root) : root_(std::move(root)) {}
  void release(uint64_t key);
  // What live disks could still grow by; mu_ held.
  uint64_t promised_locked() const;

  struct Disk {
    uint64_t bytes;
    std::string image;
  };
  const std::string root_;
  std::mutex mu_;
  uint64_t next_key_ = 1;              // GUARDED_BY(mu_)
  std::map<uint64_t, Disk> disks_;     // GUARDED_BY(mu_)
};

}  // namespace sg::process
