// Cohort dictionaries: zstd dictionaries trained on the pages of one cohort
// (tenant, template, request group), published only when they pay, stored
// in SQLite, reference-counted and never shared across tenants
// (docs/memory-codecs.md).
//
// Sibling sandboxes of one cohort hold similar content at different
// addresses (the same interpreter's objects, the same libraries' data), so a
// dictionary trained on a sample of their pages shrinks a page that the
// template delta cannot. Training costs seconds of CPU and a dictionary
// costs memory in every pool that uses it, hence the held-out check before
// publishing.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"

struct ZSTD_CDict_s;
struct ZSTD_DDict_s;

namespace sg::storage {
class Store;
}

namespace sg::memory {

// A prepared dictionary: its bytes plus the zstd compression and
// decompression tables built once. Copies share the tables (cheap);
// immutable, so any number of threads may encode and decode with it.
class Dictionary {
 public:
  // Prepares bytes for compression at level. id goes into every record that
  // uses it (0: an unpublished dictionary, used only while evaluating).
  static Result<Dictionary> prepare(uint32_t id, std::string tenant_id, std::string bytes, int level);

  uint32_t id() const { return impl_->id; }
  const std::string& tenant_id() const { return impl_->tenant_id; }
  const std::string& bytes() const { return impl_->bytes; }
  int level() const { return impl_->level; }
  const ZSTD_CDict_s* cdict() const { return impl_->cdict; }
  const ZSTD_DDict_s* ddict() const { return impl_->ddict; }

 private:
  struct Impl {
    uint32_t id = 0;
    std::string tenant_id;
    std::string bytes;
    int level = 3;
    ZSTD_CDict_s* cdict = nullptr;
    ZSTD_DDict_s* ddict = nullptr;
    ~Impl();
  };
  explicit Dictionary(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

// A cohort: whose pages a dictionary is trained on and used for.
struct CohortKey {
  std::string tenant_id;
  std::string template_id;
  std::string request_group;  // e.g. the agent/tool profile; "" for none
  // The stored key: template_id and request_group, length-prefixed so no
  // two cohorts share a key. The tenant is a column of its own.
  std::string key() const;
};

struct TrainOptions {
  size_t dict_bytes = 32 * 1024;   // dictionary capacity
  size_t max_samples = 4096;       // pages used, sampled evenly when more are given
  size_t holdout_every = 5;        // every Nth sampled page is held out for evaluation
  double min_saving = 0.05;        // publish only if the held-out pages shrink by this fraction vs plain zstd
  int level = 3;                   // zstd level for both sides of the comparison
  size_t min_train_pages = 64;     // fewer: not trained (zstd needs samples well above the dictionary size)
};

struct TrainReport {
  size_t train_pages = 0;
  size_t eval_pages = 0;
  uint64_t eval_plain_bytes = 0;  // held-out pages as plain zstd records
  uint64_t eval_dict_bytes = 0;   // the same pages with the dictionary
  double saved = 0;               // 1 - dict/plain on the held-out pages
  bool published = false;
  std::string reason;             // why not published ("", "too few pages", "saves 1.2% < 5%", zstd's error)
};

// Trains on pages (kCodecPageSize bytes each; callers pass pages that are
// neither template-same nor zero) and evaluates on the held-out part.
// Returns the dictionary (id 0) when it saves at least min_saving, nullopt
// when it does not pay or there are too few pages (report says which). An
// error only for a failure of the environment (allocation).
Result<std::optional<Dictionary>> train_dictionary(const std::vector<const uint8_t*>& pages,
                                                   const std::string& tenant_id, const TrainOptions& opt,
                                                   TrainReport* report);

// The engine's view of published dictionaries: training and publishing,
// acquire and release, over the Store (storage/store_memory.cpp) with a
// cache of prepared dictionaries.
//
// Reference counts live in SQLite: publishing stores the row with one
// reference (the publisher's), acquire adds one, release drops one and
// deletes the row at zero. Every holder of a reference (a pool whose
// records use the dictionary) releases it exactly once. Lookups are always
// by tenant: another tenant's dictionary is indistinguishable from a
// missing one. Thread-safe; every call blocks on SQLite (worker threads).
class DictionaryRegistry {
 public:
  explicit DictionaryRegistry(storage::Store& store) : store_(store) {}

  // Trains on pages (see train_dictionary) and publishes the dictionary for
  // cohort when it pays; the caller then holds one reference.
  Result<std::optional<Dictionary>> train_and_maybe_publish(const CohortKey& cohort,
                                                            const std::vector<const uint8_t*>& pages,
                                                            const TrainOptions& opt, int64_t now,
                                                            TrainReport* report = nullptr);
  // The cohort's newest dictionary with one more reference, or nullopt.
  Result<std::optional<Dictionary>> acquire(const CohortKey& cohort);
  // A dictionary by id without a new reference (decoding a record whose
  // holder already has one); nullopt when missing or another tenant's.
  Result<std::optional<Dictionary>> find(const std::string& tenant_id, uint32_t id);
  // Drops one reference; returns the references left (0: deleted).
  // kNotFound when the tenant has no dictionary with that id.
  Result<int64_t> release(const std::string& tenant_id, uint32_t id);

  size_t cached() const;

 private:
  Result<Dictionary> prepared(uint32_t id, const std::string& tenant_id, std::string bytes, int level);

  storage::Store& store_;
  mutable std::mutex mu_;
  std::map<uint32_t, Dictionary> cache_;  // GUARDED_BY(mu_); by row id (ids are never reused)
};

}  // namespace sg::memory
