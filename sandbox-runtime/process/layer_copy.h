// A sandbox's writable layer, copied out as a template layer (docs/templates.md).
//
// copy_layer(src, dst, shift) copies the overlay upper directory src into
// dst (which must not exist) as an overlay lower layer for later
// sandboxes: directories, regular files (copy_file_range), symlinks,
// FIFOs, overlay whiteouts (0:0 character devices) and hard links (linked
// again), with modes, times and extended attributes (overlay's opaque
// marks among them). Ownership is shifted: a file owned by host id
// shift.base + n (the sandbox's user namespace range) becomes n, the id a
// template's files have; ids outside the range become 65534 (nobody). With
// shift.base 0 and shift.count 0, ids are copied as they are. Sockets and
// devices other than whiteouts are left out (a sandbox cannot make
// devices; a socket is nothing without its process).
//
// dst is written as dst.partial and renamed when complete, so dst either
// is a whole layer or does not exist. Bounded: at most kMaxLayerEntries
// entries and kMaxLayerDepth levels (kInvalid beyond: the caller's limit
// on a build).
#pragma once

#include <cstdint>
#include <string>

#include "base/status.h"

namespace sg::process {

inline constexpr uint64_t kMaxLayerEntries = 4'000'000;
inline constexpr int kMaxLayerDepth = 256;

struct IdShift {
  uint32_t base = 0;
  uint32_t count = 0;  // 0: no shift
};

struct LayerStats {
  uint64_t entries = 0;
  uint64_t bytes = 0;  // regular files' sizes
};

Result<LayerStats> copy_layer(const std::string& src, const std::string& dst, IdShift shift);

}  // namespace sg::process
