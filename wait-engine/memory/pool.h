// Pool: where offloaded guest pages live, one encoded record per page,
// keyed by (sandbox id, guest page index).
//
// Two tiers. The memory tier holds records in RAM up to a byte budget that
// counts the pool's own metadata (index nodes, headers), not only payloads,
// because those bytes are host memory the offload was meant to free. Past
// the budget the least recently used records spill, in batches, to the file
// tier: one append-only file per sandbox in PoolConfig::dir, written and
// read with io_uring (liburing; pread/pwrite when the ring cannot be set
// up), indexed in RAM by page. Both tiers hold the same record bytes
// (record.h), and every read checks them; the on-disk format and the
// recovery rule are in docs/memory-pool.md.
//
// Payloads are opaque (the page codecs' output); `kind` is stored beside
// them for the codec to dispatch on.
//
// Thread safety: every method may be called from any thread; one mutex
// serialises them, and file I/O runs under it, so callers are worker
// threads, never an io_context. Errors: Status/Result, never exceptions.
#pragma once

#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "wait-engine/memory/record.h"
#include "base/fd.h"
#include "base/os.h"
#include "base/status.h"

namespace sg::memory {

struct PoolConfig {
  // Bytes of RAM the memory tier may use, metadata included. 0: every
  // record goes straight to the file tier.
  uint64_t memory_budget = 64ull << 20;
  // Directory of the file tier (created if missing).
  std::string dir;
  // true: index the *.pool files already in dir (a torn tail is cut off);
  // false: delete them (they belong to sandboxes that no longer exist).
  bool recover = false;
  // false forces the pread/pwrite path (tests of the fallback).
  bool use_io_uring = true;
  unsigned ring_entries = 64;
  // Test seam (fault injection): called before each file read or write is
  // issued; a nonzero errno fails that operation without doing it.
  std::function<int(bool write, uint64_t offset, uint32_t len)> inject_io_error;
  // The host's syscalls for creating, cutting and removing a sandbox's
  // file (base/os.h); null: the real host.
  sys::Os* os = nullptr;
};

// Per sandbox, or over the pool (totals()).
struct PoolStats {
  uint64_t records = 0;             // live records, both tiers
  uint64_t memory_records = 0;
  uint64_t file_records = 0;
  uint64_t payload_bytes = 0;       // sum of live payload lengths, both tiers
  uint64_t memory_record_bytes = 0; // header + payload bytes held in RAM (heap capacity)
  uint64_t metadata_bytes = 0;      // estimated index/LRU/bookkeeping RAM, both tiers
  uint64_t file_bytes = 0;          // bytes on disk, superseded records included
  uint64_t dead_file_bytes = 0;     // superseded records still in the file
  // What the pool costs in host RAM: the "pool bytes" of M(t).
  uint64_t memory_bytes() const { return memory_record_bytes + metadata_bytes; }
};

struct PoolTotals {
  PoolStats bytes;
  uint64_t sandboxes = 0;
  uint64_t spills = 0;            // spill batches written
  uint64_t spilled_records = 0;
  uint64_t spill_errors = 0;
  uint64_t read_errors = 0;       // corrupt, truncated or unreadable records
  bool io_uring = false;          // false: the pread/pwrite fallback is in use
};

class Pool {
 public:
  // Creates dir, sets up the ring (falling back to pread/pwrite with one
  // log line) and, with recover, indexes the files found there.
  static Result<std::unique_ptr<Pool>> open(PoolConfig config);
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // Stores (replaces) the record for a page. An error means nothing was
  // stored (payload too large, or over budget and the spill failed): keep
  // the page resident.
  Status put(const std::string& sandbox, uint64_t page_index, uint8_t kind, std::string_view payload);
  // The verified record. kNotFound when there is none; kInternal naming the
  // file, offset and check when it is corrupt or unreadable.
  Result<Record> get(const std::string& sandbox, uint64_t page_index);
  // One result per page, in order; file-tier reads are submitted together
  // (prefetch). A bad record fails only its own entry.
  std::vector<Result<Record>> get_batch(const std::string& sandbox, std::span<const uint64_t> pages);
  bool contains(const std::string& sandbox, uint64_t page_index) const;
  // Forgets one page (restored for good); its file bytes become dead.
  void erase(const std::string& sandbox, uint64_t page_index);
  // Moves every memory record of the sandbox to its file (before a long
  // wait, or in tests).
  Status spill_all(const std::string& sandbox);
  // Forgets the sandbox: its records, index and file (unlinked).
  void drop(const std::string& sandbox);

  PoolStats stats(const std::string& sandbox) const;
  PoolTotals totals() const;
  const PoolConfig& config() const { return config_; }

  // The estimates behind metadata_bytes (docs/memory-pool.md).
  static uint64_t memory_entry_overhead();
  static uint64_t file_entry_overhead();
  static uint64_t sandbox_overhead();

  // Implementation types (pool.cpp).
  struct Sandbox;
  class FileIo;
  struct LruItem {
    Sandbox* sandbox;
    uint64_t page;
  };

 private:
  explicit Pool(PoolConfig config);
  Status recover_dir();
  Sandbox* find(const std::string& id) const;
  Sandbox& get_or_create(const std::string& id);
  Status open_file(Sandbox& s);
  Status spill_until(uint64_t target);                        // mu_ held
  Status spill_pages(Sandbox& s, std::vector<uint64_t> pages);  // mu_ held
  void erase_memory(Sandbox& s, uint64_t page);                // mu_ held
  void erase_file(Sandbox& s, uint64_t page);                  // mu_ held
  PoolStats stats_locked(const Sandbox& s) const;

  sys::Os& os() const { return config_.os ? *config_.os : sys::Os::real(); }
  PoolConfig config_;
  std::unique_ptr<FileIo> io_;                                      // GUARDED_BY(mu_)
  mutable std::mutex mu_;
  std::unordered_map<std::string, std::unique_ptr<Sandbox>> sandboxes_;  // GUARDED_BY(mu_)
  std::list<LruItem> lru_;                                           // GUARDED_BY(mu_): front = oldest
  uint64_t memory_bytes_ = 0;                                        // GUARDED_BY(mu_)
  uint64_t spills_ = 0, spilled_records_ = 0, spill_errors_ = 0;     // GUARDED_BY(mu_)
  mutable uint64_t read_errors_ = 0;                                 // GUARDED_BY(mu_)
};

// File-tier file header (16 bytes, docs/memory-pool.md).
inline constexpr char kPoolFileMagic[8] = {'S', 'G', 'P', 'O', 'O', 'L', 'F', '\0'};
inline constexpr uint32_t kPoolFileVersion = 1;
inline constexpr size_t kPoolFileHeaderSize = 16;
// dir/<hex of sandbox id>.pool
std::string pool_file_name(const std::string& sandbox);

}  // namespace sg::memory
