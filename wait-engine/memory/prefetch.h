// Prefetch predictor: which pages to install before a sandbox resumes, so
// fewer of its first touches after a model wait become userfaultfd faults
// (issue 6, docs/memory-pool.md "Prefetch").
//
// Four sources, all learned from post-resume traces (the pages a sandbox
// touched after each resume, in the order they were seen):
//  - history: the sandbox's own last post-resume trace;
//  - hot set: per (cohort, tool-call index), the pages that at least
//    `hot_min_sandboxes` *other* sandboxes of the cohort touched after the
//    resume with that tool-call index (siblings run the same agent code, so
//    what they touched at call i is what this one will touch at call i);
//  - stride: during restore, on_fault() sees demand faults; when the last
//    three have one constant stride of 1..max_stride pages, it returns the
//    next pages along it.
// A throttle per sandbox and per source scales that source's share of the
// budget by the precision of its past prefetches (report_outcome()): below
// `throttle_low` the scale halves, above `throttle_high` it doubles back
// towards 1. Per source, so a wasteful history does not starve a precise
// hot set.
//
// The predictor is pure and deterministic (no clock, no randomness, ordered
// containers where order reaches the output) and bounded: every history is
// capped and the number of sandboxes and (cohort, index) keys is capped
// with least-recently-used eviction. Not thread-safe: one owner (the
// engine's restore worker) calls it; the stride path is meant to run on a
// helper thread fed by the fault server's source, not inside the source.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

namespace sg::memory {

enum class PrefetchSource : uint8_t { kHistory = 0, kHotSet = 1, kStride = 2 };
inline constexpr size_t kPrefetchSources = 3;

struct PredictorConfig {
  bool use_history = true;
  bool use_hot_set = true;
  bool use_stride = true;
  bool throttle = true;
  uint32_t hot_min_sandboxes = 2;       // k: pages touched by >= k siblings at that index
  uint32_t max_stride = 8;              // strides of 1..max_stride pages (either direction)
  uint32_t stride_ahead = 16;           // pages returned per detected stride
  size_t max_trace_pages = 8192;        // per stored trace (history, each hot-set member)
  size_t max_sandboxes = 1024;          // per-sandbox states kept (LRU)
  size_t max_hot_keys = 1024;           // (cohort, index) keys kept (LRU)
  size_t max_hot_members = 16;          // sibling traces kept per key (newest)
  double throttle_low = 0.5;            // precision below this: scale halves
  double throttle_high = 0.8;           // precision above this: scale doubles (max 1)
  double min_scale = 1.0 / 64;
  double precision_weight = 0.5;        // EWMA weight of the newest outcome
};

// Per-sandbox prefetch accounting. 'wasted': prefetched, never touched
// before the next pause. 'missed': touched, not prefetched (a demand fault).
struct PrefetchOutcomeStats {
  uint64_t prefetched = 0;
  uint64_t used = 0;
  uint64_t wasted = 0;
  uint64_t missed = 0;
  double precision = 1.0;  // EWMA of used / prefetched, all sources
  double scale = 1.0;      // the smallest source scale
  // Indexed by PrefetchSource: EWMA precision and budget scale per source.
  std::array<double, kPrefetchSources> source_precision{1.0, 1.0, 1.0};
  std::array<double, kPrefetchSources> source_scale{1.0, 1.0, 1.0};
};

struct PredictorMemory {
  size_t sandboxes = 0;
  size_t hot_keys = 0;
  size_t stored_pages = 0;  // pages held in all traces
};

class Predictor {
 public:
  explicit Predictor(PredictorConfig cfg = {});

  // A post-resume trace: the pages sandbox touched after the resume of its
  // tool call tool_call_index, in cohort. Repeated pages are ignored after
  // their first position; at most max_trace_pages are kept.
  void record_trace(const std::string& sandbox, const std::string& cohort, uint32_t tool_call_index,
                    std::span<const uint64_t> pages);

  // Pages to install before resuming, at most budget_pages, no duplicates.
  // Each source gets at most budget_pages times its throttle scale (rounded
  // down, at least 1 when budget > 0). Order: pages both in history and in
  // the hot set (counted as hot set), then the hot set (most siblings
  // first), then the rest of the history. Starts a new outcome window: the
  // pages returned here and by on_fault() are what report_outcome() judges
  // per source.
  std::vector<uint64_t> predict(const std::string& sandbox, const std::string& cohort, uint32_t tool_call_index,
                                size_t budget_pages);

  // Start of a restore: forgets the stride window of sandbox.
  void begin_restore(const std::string& sandbox);
  // A demand fault during restore; returns the pages to prefetch next (a
  // stride continuation, none if no stride), throttled like predict().
  // Pages below 0 are cut off; callers bound them by the region size.
  std::vector<uint64_t> on_fault(const std::string& sandbox, uint64_t page);

  // After the sandbox paused again: what was prefetched for this resume and
  // what it touched. Updates the counters and the throttle. In the
  // benchmark 'touched' is the replayed trace; in production it comes from
  // the next offload (pages dirty since the resume from soft-dirty or the
  // VMM's dirty log, plus pages found accessed by idle page tracking where
  // the host has it): see docs/memory-pool.md "Prefetch".
  void report_outcome(const std::string& sandbox, std::span<const uint64_t> prefetched,
                      std::span<const uint64_t> touched);

  PrefetchOutcomeStats stats(const std::string& sandbox) const;
  double scale(const std::string& sandbox) const;  // the smallest source scale
  double scale(const std::string& sandbox, PrefetchSource source) const;
  PredictorMemory memory() const;
  void forget(const std::string& sandbox);
  const PredictorConfig& config() const { return cfg_; }

 private:
  struct SandboxState {
    std::vector<uint64_t> history;
    uint64_t last_use = 0;
    uint64_t recent[3] = {0, 0, 0};
    int n_recent = 0;
    PrefetchOutcomeStats st;
    std::map<uint64_t, PrefetchSource> issued;  // this window's pages, at most 2 * max_trace_pages
  };
  struct HotKey {
    std::map<std::string, std::vector<uint64_t>> members;  // sandbox -> its trace
    std::map<std::string, uint64_t> member_seq;             // sandbox -> when recorded
    uint64_t last_use = 0;
  };
  using Key = std::pair<std::string, uint32_t>;

  SandboxState& sandbox(const std::string& id);
  size_t budget_for(const SandboxState& s, PrefetchSource src, size_t budget) const;
  void issue(SandboxState& s, uint64_t page, PrefetchSource src) const;
  void evict();

  PredictorConfig cfg_;
  uint64_t clock_ = 0;  // logical: one tick per call
  std::map<std::string, SandboxState> sandboxes_;
  std::map<Key, HotKey> hot_;
};

}  // namespace sg::memory
