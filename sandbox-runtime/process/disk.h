// The size-limited writable layer of a process sandbox: a sparse ext4 image
// in the sandbox's state directory, attached to a loop device and mounted
// by the sandbox's child in its own mount namespace (never in the host's),
// with the overlay's upper and work directories inside it. A write past the
// size fails with ENOSPC in that sandbox only; deleting files gives the
// blocks back to the host (the filesystem is mounted with discard, which the
// loop device turns into hole punching).
//
// The loop device is attached with autoclear: it detaches itself when the
// last of (the host's descriptor, the sandbox's mount) goes, so a killed
// sandbox or a crashed sandgate leaves no device behind; the image is an
// ordinary file removed with the state directory.
//
// Thread safety: the functions are safe to call from several threads at
// once (attaching retries when another thread took the same free device).
#pragma once

#include <cstdint>
#include <string>

#include "base/fd.h"
#include "base/os.h"
#include "base/status.h"

namespace sg::process {

// Whether limited disks can be made here: /dev/loop-control opens and
// mkfs.ext4 is found. Otherwise kUnavailable saying what is missing.
Status writable_disk_available();

struct WritableDisk {
  UniqueFd loop;     // the loop device; keep it open until the sandbox has mounted it
  std::string node;  // a block device node for it, in the state directory
  std::string image; // the ext4 image file
};

// Creates dir/disk.img of size_mb MiB: a sparse copy of an ext4 image (no
// journal, no reserved blocks) made once per size in cache_dir with
// mkfs.ext4, so a create pays for copying well under 1 MiB, not for mkfs.
// Attaches it to a free loop device and makes dir/disk.dev for the child
// to mount. On failure nothing is left attached (files in dir go with the
// state directory). Every sandbox's filesystem has the same UUID, which
// ext4 does not mind: each is mounted in its own mount namespace only.
Result<WritableDisk> make_writable_disk(const std::string& dir, const std::string& cache_dir, uint64_t size_mb,
                                        sys::Os& os = sys::Os::real());

// Sizes make_writable_disk accepts: 1 MiB to this.
inline constexpr uint64_t kMaxWritableDiskMb = 1ull << 24;

// The image make_writable_disk(dir, ...) makes: dir/disk.img.
std::string writable_disk_image(const std::string& dir);

// Host bytes the image holds (allocated blocks): the writable layer's use.
uint64_t writable_disk_used_bytes(const std::string& image);

}  // namespace sg::process
