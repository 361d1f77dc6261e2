// BatchWriter: model usage rows and events written to SQLite in batches,
// on a thread of its own, so the paths that produce them (model requests
// on io threads, wait transitions on the coordinator's threads) never wait
// for SQLite.
//
// Rows wait at most 20 ms, or until 512 are queued, for one transaction.
// At most 100000 rows queue; beyond that a row is dropped with a warning
// (SQLite cannot keep up; usage is then undercounted, never blocking).
// The destructor writes what is queued and joins the thread.
//
// Thread-safe.
#pragma once

#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "storage/store.h"

namespace sg::storage {

class BatchWriter {
 public:
  explicit BatchWriter(Store& store);
  ~BatchWriter();
  BatchWriter(const BatchWriter&) = delete;
  BatchWriter& operator=(const BatchWriter&) = delete;

  void add_usage(LlmUsageRow row);
  void add_event(EventRow row);

 private:
  void loop();
  // Queued rows of both kinds; the writer is woken at the first and at a
  // full batch. REQUIRES(mu_).
  bool wake_now() const;

  Store& store_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<LlmUsageRow> usage_;  // GUARDED_BY(mu_)
  std::vector<EventRow> events_;    // GUARDED_BY(mu_)
  bool stop_ = false;               // GUARDED_BY(mu_)
  std::thread thread_;
};

}  // namespace sg::storage
