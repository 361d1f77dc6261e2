// Pause packing: a microVM paused to disk keeps its guest RAM as only the
// pages that differ from the memory it was restored from, each one through
// the page codecs (page_codec.h: template delta, zero, runs, zstd) with the
// CRC32C of the decoded page, in one file (docs/vmm.md, "Pause memory").
//
// A pause's snapshot directory holds, once packed:
//   memory.sgm   the packed RAM (format below)
//   memory.base  a hard link to the base: the memory file the sandbox was
//                restored from (a template's snapshot, or the base of the
//                pause it was resumed from: packs never chain)
//   vm.state     as the VMM wrote it
// and, after unpack() and while the resumed sandbox runs from it, memory.
//
// memory.sgm (little-endian):
//   header, 64 bytes:
//     0  "SGPMEM01"        8  u32 version (1)    12 u32 page size (4096)
//     16 u64 RAM bytes     24 u64 base bytes     32 u32 base CRC32C
//     36 u32 zero          40 u64 record count   48 u64 body bytes
//     56 u32 body CRC32C   60 u32 CRC32C of bytes 0..59
//   body: per stored page, page index ascending:
//     u64 page index, u16 record length, the page codec's record
// A page without a record equals the base page at the same address (zero
// past the base's end). The base's CRC covers its whole content (holes as
// zero bytes), so a base that changed is refused, as is any page whose
// decoded bytes fail its own CRC, a body that fails its CRC, or a record
// out of order or out of range: damage is an error, never guest memory.
#pragma once

#include <cstdint>
#include <string>

#include "base/os.h"
#include "base/status.h"
#include "sandbox-runtime/lifecycle/guest_memory.h"

namespace sg::memory {

inline constexpr char kPackedMemoryFile[] = "memory.sgm";
inline constexpr char kPackBaseFile[] = "memory.base";
inline constexpr size_t kPackHeaderSize = 64;
// The largest guest RAM a packed file may claim (a corrupt length is not a size).
inline constexpr uint64_t kMaxPackedMemory = uint64_t(1) << 40;

struct PackStats {
  uint64_t mem_bytes = 0;
  uint64_t stored_bytes = 0;  // memory.sgm's size
  uint64_t pages_same = 0;    // equal to the base page: nothing stored
  uint64_t pages_stored = 0;  // records
  uint64_t ms = 0;
};

class PausePacker : public lifecycle::PauseMemoryPacker {
 public:
  // os: the seam for the calls that change the host (fault tests); level:
  // zstd's level for pages the base does not explain.
  explicit PausePacker(sys::Os& os = sys::Os::real(), int level = 3) : os_(os), level_(level) {}

  Result<std::string> pack(const std::string& dir, const std::string& base) override;
  Status unpack(const std::string& dir) override;

  // pack() with its numbers (the benchmark's).
  Result<PackStats> pack_stats(const std::string& dir, const std::string& base);

 private:
  sys::Os& os_;
  const int level_;
};

}  // namespace sg::memory
