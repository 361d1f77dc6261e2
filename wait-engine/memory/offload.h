// MemoryEngine: offloads a paused microVM's guest RAM into the pool and
// restores it through userfaultfd (issue 6, docs/memory-offload.md).
//
// offload() runs with the sandbox's vCPUs paused:
//  1. reads the VMM's page map (/proc/PID/pagemap) for the RAM range and
//     picks the resident pages (every page on a first offload of memfd
//     RAM, whose holes the page map cannot tell from data);
//  2. reads them out of the VMM with process_vm_readv, 256 at a time, and
//     encodes each against the template page at the same address (the
//     clone's snapshot memory file); a page equal to its base (the template
//     page, or zeros without a template) is not stored at all: the fault
//     source gives the base for any page the pool lacks;
//  3. checks the cancel flag between pages: a tool call or a response that
//     arrives stops the offload within one page, with nothing released;
//  4. only when every page is stored, asks the VMM to release RAM
//     (Sandbox::release_guest_memory: the first time it hands over the
//     userfaultfd, which a FaultServer then serves for the VMM's life).
// prefetch() runs before the vCPUs resume: installs the predicted pages
// (history and cohort hot set, prefetch.h) and keeps each one's checksum,
// so the next offload, which reads every resident page anyway, can tell
// which of them the guest wrote (used) and report that to the throttle.
//
// A page that cannot be given back (a corrupt record) is poisoned where the
// kernel can (the vCPU gets a memory error) and on_lost is called: the
// sandbox is lost and must be killed.
//
// Thread safety: every method may be called from any thread; calls for one
// sandbox are serialised. forget() must come after the VMM is dead: it
// stops the fault server, and a live VMM would then read zeros.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "wait-engine/memory/dictionary.h"
#include "wait-engine/memory/pool.h"
#include "wait-engine/memory/prefetch.h"
#include "wait-engine/memory/uffd.h"
#include "base/fd.h"
#include "base/status.h"
#include "sandbox-runtime/lifecycle/guest_memory.h"

namespace sg::memory {

struct MemoryEngineConfig {
  PoolConfig pool;
  int zstd_level = 3;
  size_t prefetch_pages = 4096;  // pages installed before a resume, at most
  PredictorConfig predictor;
  // Cohort dictionaries (dictionary.h), or null for none. A sandbox takes
  // its cohort's newest dictionary at its first offload; a cohort without
  // one trains it from the pages of a completed offload (kept as a sample
  // of at most train_sample_pages), after the release, and publishes it
  // only if it pays on held-out pages, on the engine's trainer thread (so
  // neither the offload nor a resume waits for it). Used from that
  // sandbox's next offload on, and by siblings that start offloading
  // afterwards.
  DictionaryRegistry* dictionaries = nullptr;
  TrainOptions train;
  size_t train_sample_pages = 1024;
  // A sandbox whose memory cannot be restored (called once, from a fault
  // server thread: must only queue the kill). Optional: the same sandboxes
  // are listed by take_lost(), which is what the lifecycle core polls.
  std::function<void(const std::string& sandbox, const std::string& why)> on_lost;
};

// One sandbox's guest RAM, as the runtime reports it (runtime.h).
struct OffloadTarget {
  std::string cohort;           // (tenant, template): whose hot sets it shares
  CohortKey cohort_key;         // the same, for dictionaries (tenant_id must be set to use one)
  int pid = -1;                 // the VMM
  uint64_t base = 0;            // RAM mapping in the VMM's address space
  uint64_t size = 0;
  std::string backing;          // "memfd", "file", "userfaultfd"
  std::string template_memory;  // the clone's snapshot memory file, or ""
  // Drops guest RAM in the VMM; the first call returns the userfaultfd.
  std::function<Result<std::pair<UniqueFd, uint64_t>>()> release;
};

struct OffloadReport {
  uint64_t pages_read = 0;    // pages read out of the VMM and encoded
  uint64_t pages_stored = 0;  // put into the pool
  uint64_t pages_base = 0;    // equal to the template (or zero): nothing stored
  uint64_t bytes_stored = 0;  // encoded bytes put
  uint64_t pool_bytes = 0;    // the sandbox's pool RAM afterwards (M(t)'s share)
  uint64_t ns = 0;
  uint32_t dictionary = 0;    // the dictionary id the records used (0: none)
  bool trained = false;       // this offload's pages were queued to train the cohort's dictionary
};

struct SandboxMemoryStats {
  PoolStats pool;
  FaultStats faults;
  PrefetchOutcomeStats prefetch;
  uint64_t offloads = 0;
  bool released = false;  // RAM is out now (offloaded, not yet resumed)
};

struct MemoryEngineTotals {
  uint64_t offloads = 0, offloads_cancelled = 0, offloads_failed = 0;
  uint64_t pages_read = 0, pages_stored = 0, pages_base = 0, bytes_stored = 0;
  uint64_t faults = 0, prefetched = 0, prefetch_used = 0, prefetch_wasted = 0;
  uint64_t lost = 0;
  uint64_t offload_ns = 0;
  uint64_t dictionaries_trained = 0, dictionaries_published = 0;
  PoolTotals pool;
};

// The lifecycle core reaches it as a lifecycle::GuestMemoryStore.
class MemoryEngine final : public lifecycle::GuestMemoryStore {
 public:
  static Result<std::unique_ptr<MemoryEngine>> open(MemoryEngineConfig cfg);
  ~MemoryEngine();  // stops every fault server: only once the VMMs are gone
  MemoryEngine(const MemoryEngine&) = delete;
  MemoryEngine& operator=(const MemoryEngine&) = delete;

  // Errors: kConflict when cancelled (nothing released), kUnavailable when
  // the pool or the VMM refused (nothing released: the sandbox stays
  // paused and whole), kInternal when RAM was released but cannot be
  // served (on_lost was called), kInvalid for a target that does not match
  // the sandbox's earlier one.
  Result<OffloadReport> offload(const std::string& sandbox, const OffloadTarget& t, const std::atomic<bool>& cancel);
  // The lifecycle core's form: the target from the request (cohort =
  // tenant/template), the report as one log line.
  Result<std::string> offload(const std::string& sandbox, const lifecycle::OffloadRequest& r,
                              const std::atomic<bool>& cancel) override;
  // Before the vCPUs resume. Returns the pages installed (0 when the
  // sandbox is not offloaded).
  Result<uint64_t> prefetch(const std::string& sandbox) override;
  void forget(const std::string& sandbox) override;
  // The sandboxes whose memory was lost since the last call, with why
  // (each once). Any thread; does not block on a fault server.
  std::vector<std::pair<std::string, std::string>> take_lost() override;

  std::optional<SandboxMemoryStats> stats(const std::string& sandbox);
  // The sandbox's pool RAM (0 if unknown): cheap, for M(t) sampling.
  uint64_t pool_bytes(const std::string& sandbox) const override;
  MemoryEngineTotals totals();
  // Blocks until every dictionary training queued so far has finished
  // (tests; training runs on the engine's trainer thread).
  void wait_for_training();
  // Appends the engine's series in Prometheus text format.
  void render_metrics(std::string& out);

 private:
  struct Sandbox;
  explicit MemoryEngine(MemoryEngineConfig cfg, std::unique_ptr<Pool> pool);
  std::shared_ptr<Sandbox> find(const std::string& id);
  Status attach(Sandbox& s, const std::string& id, const OffloadTarget& t);
  // The parts of offload(), in its order (offload.cpp).
  struct Pass;
  Status encode_pages(const std::string& id, Sandbox& s, const std::vector<uint64_t>& pages, const Dictionary* dict,
                      bool want_sample, Pass& p, const std::atomic<bool>& cancel);
  void report_last_resume(const std::string& id, Sandbox& s, const std::vector<uint64_t>& used);
  Status serve_released(const std::string& id, const std::shared_ptr<Sandbox>& sp, UniqueFd uffd, uint64_t features);

  MemoryEngineConfig cfg_;
  std::unique_ptr<Pool> pool_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<Sandbox>> sandboxes_;  // GUARDED_BY(mu_)
  std::mutex pred_mu_;
  Predictor predictor_;  // GUARDED_BY(pred_mu_)
  std::mutex lost_mu_;
  std::vector<std::pair<std::string, std::string>> lost_list_;  // GUARDED_BY(lost_mu_)
  // Dictionary training, one job at a time on its own thread (at most one
  // core): samples of a completed offload, for cohorts without a dictionary.
  struct TrainJob {
    std::string id;
    std::shared_ptr<Sandbox> sandbox;
    std::vector<std::string> sample;
  };
  void train_loop();
  std::mutex train_mu_;
  std::condition_variable train_cv_;
  std::deque<TrainJob> train_queue_;  // GUARDED_BY(train_mu_)
  bool train_stop_ = false;           // GUARDED_BY(train_mu_)
  uint64_t trains_queued_ = 0, trains_done_ = 0;  // GUARDED_BY(train_mu_)
  std::thread trainer_;
  std::atomic<uint64_t> offloads_{0}, cancelled_{0}, failed_{0}, pages_read_{0}, pages_stored_{0}, pages_base_{0},
      bytes_stored_{0}, lost_{0}, offload_ns_{0}, faults_retired_{0}, prefetched_retired_{0}, used_{0}, wasted_{0},
      trained_{0}, published_{0};
};

}  // namespace sg::memory
