// Memory offload for process sandboxes (issue 25, docs/process-backend.md,
// "Offload to swap"): while a sandbox is wait-paused (frozen), its private
// anonymous memory is pushed out to compressed swap with
// process_madvise(MADV_PAGEOUT), and what it touched in its previous run
// is read back with MADV_WILLNEED before the thaw; the rest faults back on
// demand. What was read back and not touched is put back out at the next
// page-out (it would sit in the swap cache, in RAM, out of MADV_PAGEOUT's
// reach).
//
// SwapDevice is the swap it goes to: a zram device sandgate makes (the
// kernel's zram, its best compressor, swapped on above the host's other
// swap) or the host's active swap. page_out() and page_in() act on a
// frozen sandbox's processes; they take pids (the sandbox's cgroup) and
// never follow anything a sandbox could name.
//
// Thread safety: SwapDevice is immutable after open(); stats() reads
// sysfs; compact() runs one call at a time and skips the others. page_out/page_in may run for different sandboxes at once.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "sandbox-runtime/runtime.h"

namespace sg::process {

struct SwapConfig {
  // "zram": make a zram device and swap on it; "host": use the host's
  // active swap (none: kUnavailable).
  std::string mode = "zram";
  // zram: its uncompressed capacity; 0: half of the host's RAM.
  uint64_t zram_bytes = 0;
  // zram: a file naming the device made, so that the next open() removes
  // what a crash left behind. Required for "zram".
  std::string record;
  // zram: swap priority (0..32767), above the host's swap so that pages go
  // to the compressed device first.
  int priority = 32767;
  // host: the swap table read (a test names its own).
  std::string proc_swaps = "/proc/swaps";
};

struct SwapStats {
  uint64_t used_bytes = 0;    // data swapped out (uncompressed), every user of the swap
  uint64_t stored_bytes = 0;  // zram: compressed size; host swap: used_bytes
  uint64_t memory_bytes = 0;  // zram: RAM it takes now; host swap: 0
  uint64_t compacted_pages = 0;  // zram: pages its compactions have freed
};

class SwapDevice {
 public:
  // Makes (zram) or finds (host) the swap. kUnavailable with the reason
  // when there is none to be had (no zram in the kernel, no permission,
  // no host swap); nothing is left behind then.
  static Result<std::unique_ptr<SwapDevice>> open(const SwapConfig& cfg);
  // zram: swapoff (pages still out come back into RAM), reset, remove.
  ~SwapDevice();
  SwapDevice(const SwapDevice&) = delete;
  SwapDevice& operator=(const SwapDevice&) = delete;

  // One line for the log and /health: "zram3 (lzo-rle, 12288 MiB, priority 32767)".
  const std::string& describe() const { return describe_; }
  Result<SwapStats> stats() const;

  // zram keeps compressed pages in pages of its own and frees one only
  // when every object in it is gone: as sandboxes fault their pages back,
  // it keeps the RAM they freed (the kernel compacts it only under memory
  // pressure). compact() moves the objects together and frees the rest
  // when more than an eighth of its RAM, and at least min_waste, is
  // free space. Returns whether it compacted; false for host swap or while
  // another call compacts.
  Result<bool> compact(uint64_t min_waste = 4u << 20) const;

 private:
  SwapDevice() = default;
  std::string describe_;
  int zram_ = -1;      // zram device number; -1: host swap
  std::string node_;   // zram: the block device swapped on
  std::string record_;
  std::string proc_swaps_;  // host swap: the table stats() reads
  mutable std::atomic<bool> compacting_{false};
};

// A page-aligned address range in one process.
struct PageRange {
  uint64_t start = 0;
  uint64_t pages = 0;
};
struct ProcessPages {
  int pid = -1;
  std::vector<PageRange> ranges;
};

struct PageOutResult {
  uint64_t resident_pages = 0;  // private anonymous pages resident before
  uint64_t out_pages = 0;       // of those, in swap after
  // The runs that were resident: touched since the previous page-out
  // (MADV_WILLNEED reads pages back into the swap cache without mapping
  // them, so a page read back but not used is not resident at the next
  // page-out).
  std::vector<ProcessPages> hot;
  // Pages of read_back not resident (not touched since), put back out.
  uint64_t unused_pages = 0;
};

// Pushes the private anonymous memory of pids (a frozen sandbox's
// processes) out to swap. A process that exits meanwhile is skipped.
// kConflict when cancel is set before the end (what went out stays out and
// faults back), other errors when a process cannot be read or advised.
// observer (may be null) sees each process's resident runs before the
// advice and which of their pages went out after it.
//
// read_back (may be null): what the last page_in asked for. A page read
// back and never touched is in the swap cache, unmapped: in RAM and
// charged to the sandbox, and MADV_PAGEOUT, which walks the page tables,
// never sees it. Those of its pages that are not resident now are mapped
// again by reading them (process_vm_readv: a minor fault on the swap
// cache) and paged out with the rest; being clean copies of what swap
// holds, they are freed without being written again.
Result<PageOutResult> page_out(const std::vector<int>& pids, const std::atomic<bool>& cancel,
                               runtime::SwapObserver* observer = nullptr,
                               const std::vector<ProcessPages>* read_back = nullptr);

// The pages in both a and b: per process (pid in both), the overlap of its
// runs (each list sorted by start, as page_out returns them). What was
// resident at two page-outs in a row is what the sandbox touched in both
// run periods, the prefetch's guess at what it touches in the next.
std::vector<ProcessPages> overlap(const std::vector<ProcessPages>& a, const std::vector<ProcessPages>& b);
uint64_t page_count(const std::vector<ProcessPages>& p);

// MADV_WILLNEED over hot (still the same processes): reads those pages
// back from swap before the thaw. Returns the pages asked for; a process
// that is gone is skipped.
Result<uint64_t> page_in(const std::vector<ProcessPages>& hot);

}  // namespace sg::process
