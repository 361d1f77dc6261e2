// The codec comparison of issue 25 (docs/process-backend.md, "The engine's
// codecs on the same pages"): while process sandboxes offload into the
// kernel's compressed swap, SwapCodecAudit reads every page a page-out is
// about to push out (the sandbox is frozen) and encodes it with the memory
// engine's page codecs, then, once the page-out is done, counts the pages
// that did go out. Next to that it reads what the swap device stored for
// the same page-out (zram's compressed size before and after). A
// measurement, switched on by `sandgate serve --swap-codec-audit`: it adds
// CPU time to every offload (a zstd pass per page, twice), so a replay run
// with it is not a timing run.
//
// Two engine figures per page:
//   plain:  page_codec with neither template page nor dictionary (zero, runs,
//           zstd at level 3): what the engine stores for a page it knows
//           nothing about;
//   cohort: the sandbox-aware codecs. Sibling process sandboxes of one
//           template do not share pages (no fork from a snapshot), so the
//           template page is the cohort's reference image: the pages of the
//           first sandbox of the cohort to offload, as they were at its
//           first offload, at the same place (process name and ordinal,
//           mapping name and ordinal, offset in the mapping: addresses
//           differ between siblings, ASLR); the dictionary is trained on
//           that image (train_dictionary, published only when it pays).
//           The reference sandbox's own pages are encoded without template.
//
// Thread safety: begin() serialises page-outs (one at a time while the
// audit is on: the device's counters before and after are then this
// page-out's); totals() and render_metrics() may run on any thread.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "sandbox-runtime/runtime.h"
#include "wait-engine/memory/dictionary.h"
#include "wait-engine/memory/page_codec.h"

namespace sg::memory {

struct SwapAuditConfig {
  // The swap device's (uncompressed, stored) byte counters, read before and
  // after each page-out; null: no kernel figure.
  std::function<std::optional<std::pair<uint64_t, uint64_t>>()> device_bytes;
  // RAM the reference images of all cohorts may take; pages past it get no
  // reference (encoded as plain).
  uint64_t reference_budget = 256ull << 20;
  int level = 3;  // zstd level, as the engine's default
};

struct SwapAuditTotals {
  uint64_t page_outs = 0;
  uint64_t pages = 0;            // pages read before a page-out that were in swap after it
  uint64_t unread_pages = 0;     // resident pages that could not be read (not counted anywhere)
  int64_t device_used = 0;       // the device's uncompressed bytes: sum of the changes over page-outs
  int64_t device_stored = 0;     // the device's stored (compressed) bytes: the same
  uint64_t plain_bytes = 0;      // engine records, no template, no dictionary
  uint64_t cohort_bytes = 0;     // engine records, the cohort's reference and dictionary
  std::array<uint64_t, kPageKindCount> plain_kinds{};   // pages per record kind
  std::array<uint64_t, kPageKindCount> cohort_kinds{};
  uint64_t reference_pages = 0;  // pages held as reference images
  uint64_t dictionaries = 0;     // cohort dictionaries trained and kept
};

class SwapCodecAudit final : public runtime::SwapObserver {
 public:
  explicit SwapCodecAudit(SwapAuditConfig cfg);
  ~SwapCodecAudit() override;

  void begin(const std::string& sandbox_id, const std::string& cohort) override;
  void before(int pid, const std::string& process, const std::vector<runtime::SwapRun>& runs) override;
  void after(int pid, const std::vector<std::vector<bool>>& in_swap) override;
  void end() override;

  SwapAuditTotals totals() const;
  // sandgate_swap_audit_* lines (Prometheus text).
  void render_metrics(std::string& out) const;

 private:
  struct Cohort {
    std::string reference_sandbox;  // the first sandbox that offloaded
    bool captured = false;          // its first offload is over: the image is complete
    std::unordered_map<uint64_t, uint32_t> index;  // place key -> page number in image
    std::string image;              // reference pages, back to back
    std::optional<Dictionary> dict;
  };
  struct PageSizes {
    uint16_t plain = 0, cohort = 0;  // record bytes; 0: not read
    uint8_t plain_kind = 0, cohort_kind = 0;
  };

  SwapAuditConfig cfg_;
  std::mutex serial_;                  // held from begin() to end()
  std::unique_lock<std::mutex> held_;  // the serial_ lock of the page-out in progress
  // The page-out in progress (under serial_).
  std::string sandbox_;
  Cohort* cohort_ = nullptr;
  bool capturing_ = false;  // this page-out is the reference sandbox's first
  std::optional<std::pair<uint64_t, uint64_t>> device_before_;
  std::map<int, std::vector<std::vector<PageSizes>>> pending_;  // pid -> per run, per page
  std::map<std::string, Cohort> cohorts_;
  uint64_t reference_bytes_ = 0;
  CodecContext cc_;
  std::string scratch_;
  std::vector<uint8_t> buf_;

  mutable std::mutex mu_;  // totals_
  SwapAuditTotals totals_;
};

}  // namespace sg::memory
