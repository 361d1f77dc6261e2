// Cohort dictionaries: training, the held-out check and the registry over
// the Store (docs/memory-codecs.md).
#define ZDICT_STATIC_LINKING_ONLY
#include "wait-engine/memory/dictionary.h"

#include <zdict.h>
#include <zstd.h>

#include <cmath>
#include <cstdio>

#include "wait-engine/memory/page_codec.h"
#include "storage/store.h"

namespace sg::memory {

Dictionary::Impl::~Impl() {
  if (cdict) ZSTD_freeCDict(cdict);
  if (ddict) ZSTD_freeDDict(ddict);
}

Result<Dictionary> Dictionary::prepare(uint32_t id, std::string tenant_id, std::string bytes, int level) {
  if (bytes.size() < 8) return invalid_error("memory dictionary " + std::to_string(id) + ": too short");
  auto impl = std::make_shared<Impl>();
  impl->id = id;
  impl->tenant_id = std::move(tenant_id);
  impl->bytes = std::move(bytes);
  impl->level = level;
  // Both tables copy the bytes they need (the byCopy variants), so the Impl
  // owns everything it points to.
  impl->cdict = ZSTD_createCDict(impl->bytes.data(), impl->bytes.size(), level);
  impl->ddict = ZSTD_createDDict(impl->bytes.data(), impl->bytes.size());
  if (!impl->cdict || !impl->ddict)
    return internal_error("memory dictionary " + std::to_string(id) + ": zstd could not prepare it");
  return Dictionary(std::move(impl));
}

std::string CohortKey::key() const {
  return std::to_string(template_id.size()) + ":" + template_id + "/" + std::to_string(request_group.size()) + ":" +
         request_group;
}

Result<std::optional<Dictionary>> train_dictionary(const std::vector<const uint8_t*>& pages,
                                                   const std::string& tenant_id, const TrainOptions& opt,
                                                   TrainReport* report) {
  TrainReport local;
  TrainReport& rep = report ? *report : local;
  rep = TrainReport{};

  // An even sample of at most max_samples pages, then every holdout_every-th
  // of those held out.
  const size_t take = std::min(pages.size(), opt.max_samples);
  std::string train;
  std::vector<size_t> sizes;
  std::vector<const uint8_t*> eval;
  const size_t every = opt.holdout_every < 2 ? 2 : opt.holdout_every;
  for (size_t i = 0; i < take; ++i) {
    const uint8_t* p = pages[take == pages.size() ? i : i * pages.size() / take];
    if (i % every == every - 1) {
      eval.push_back(p);
    } else {
      train.append(reinterpret_cast<const char*>(p), kCodecPageSize);
      sizes.push_back(kCodecPageSize);
    }
  }
  rep.train_pages = sizes.size();
  rep.eval_pages = eval.size();
  if (sizes.size() < opt.min_train_pages || eval.empty()) {
    rep.reason = "too few pages (" + std::to_string(pages.size()) + ")";
    return std::optional<Dictionary>();
  }

  std::string dict(opt.dict_bytes, '\0');
  size_t n = ZDICT_trainFromBuffer(dict.data(), dict.size(), train.data(), sizes.data(),
                                   static_cast<unsigned>(sizes.size()));
  if (ZDICT_isError(n)) {
    // Training refuses content it cannot find structure in (random pages):
    // that is a dictionary that does not pay, not a failure.
    rep.reason = std::string("zstd training: ") + ZDICT_getErrorName(n);
    return std::optional<Dictionary>();
  }
  dict.resize(n);
  Result<Dictionary> d = Dictionary::prepare(0, tenant_id, std::move(dict), opt.level);
  if (!d) return d.error();

  // Compare like with like: whole records through the page codec, once
  // forced to plain zstd, once offered the dictionary.
  CodecContext cc;
  if (!cc.ok()) return internal_error("memory dictionary training: zstd contexts could not be allocated");
  std::string rec;
  for (const uint8_t* p : eval) {
    rec.clear();
    rep.eval_plain_bytes += encode_page(cc, p, EncodeOptions{nullptr, nullptr, opt.level}, rec).bytes;
    rec.clear();
    rep.eval_dict_bytes += encode_page(cc, p, EncodeOptions{nullptr, &*d, opt.level}, rec).bytes;
  }
  rep.saved = rep.eval_plain_bytes == 0
                  ? 0
                  : 1.0 - static_cast<double>(rep.eval_dict_bytes) / static_cast<double>(rep.eval_plain_bytes);
  if (rep.saved < opt.min_saving) {
    char buf[96];
    std::snprintf(buf, sizeof buf, "saves %.1f%% < %.1f%% on %zu held-out pages", rep.saved * 100,
                  opt.min_saving * 100, eval.size());
    rep.reason = buf;
    return std::optional<Dictionary>();
  }
  rep.published = true;
  return std::optional<Dictionary>(std::move(*d));
}

Result<Dictionary> DictionaryRegistry::prepared(uint32_t id, const std::string& tenant_id, std::string bytes,
                                                int level) {
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = cache_.find(id);
    if (it != cache_.end() && it->second.tenant_id() == tenant_id) return it->second;
  }
  Result<Dictionary> d = Dictionary::prepare(id, tenant_id, std::move(bytes), level);
  if (!d) return d;
  std::lock_guard<std::mutex> g(mu_);
  return cache_.emplace(id, *d).first->second;
}

Result<std::optional<Dictionary>> DictionaryRegistry::train_and_maybe_publish(
    const CohortKey& cohort, const std::vector<const uint8_t*>& pages, const TrainOptions& opt, int64_t now,
    TrainReport* report) {
  TrainReport local;
  TrainReport& rep = report ? *report : local;
  Result<std::optional<Dictionary>> t = train_dictionary(pages, cohort.tenant_id, opt, &rep);
  if (!t || !*t) return t;
  storage::MemoryDictionaryRow row;
  row.tenant_id = cohort.tenant_id;
  row.cohort_key = cohort.key();
  row.bytes = (*t)->bytes();
  row.level = opt.level;
  row.created_at = now;
  row.refcount = 1;
  row.saved_ppm = static_cast<int64_t>(std::llround(rep.saved * 1e6));
  Result<int64_t> id = store_.insert_memory_dictionary(row);
  if (!id) {
    rep.published = false;
    return id.error().with_context("publish memory dictionary for tenant " + cohort.tenant_id);
  }
  if (*id <= 0 || *id > static_cast<int64_t>(UINT32_MAX))
    return internal_error("memory dictionary id " + std::to_string(*id) + " does not fit a page record");
  Result<Dictionary> d = prepared(static_cast<uint32_t>(*id), cohort.tenant_id, std::move(row.bytes), opt.level);
  if (!d) return d.error();
  return std::optional<Dictionary>(*d);
}

Result<std::optional<Dictionary>> DictionaryRegistry::acquire(const CohortKey& cohort) {
  Result<std::optional<storage::MemoryDictionaryRow>> r =
      store_.acquire_memory_dictionary(cohort.tenant_id, cohort.key());
  if (!r) return r.error();
  if (!*r) return std::optional<Dictionary>();
  storage::MemoryDictionaryRow& row = **r;
  Result<Dictionary> d =
      prepared(static_cast<uint32_t>(row.id), row.tenant_id, std::move(row.bytes), static_cast<int>(row.level));
  if (!d) {
    // Keep the count honest: the caller got no reference.
    (void)store_.release_memory_dictionary(cohort.tenant_id, row.id);
    return d.error();
  }
  return std::optional<Dictionary>(*d);
}

Result<std::optional<Dictionary>> DictionaryRegistry::find(const std::string& tenant_id, uint32_t id) {
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = cache_.find(id);
    if (it != cache_.end()) {
      if (it->second.tenant_id() != tenant_id) return std::optional<Dictionary>();
      return std::optional<Dictionary>(it->second);
    }
  }
  Result<std::optional<storage::MemoryDictionaryRow>> r = store_.get_memory_dictionary(tenant_id, id);
  if (!r) return r.error();
  if (!*r) return std::optional<Dictionary>();
  Result<Dictionary> d = prepared(id, tenant_id, std::move((*r)->bytes), static_cast<int>((*r)->level));
  if (!d) return d.error();
  return std::optional<Dictionary>(*d);
}

Result<int64_t> DictionaryRegistry::release(const std::string& tenant_id, uint32_t id) {
  Result<std::optional<int64_t>> r = store_.release_memory_dictionary(tenant_id, id);
  if (!r) return r.error();
  if (!*r)
    return not_found_error("memory dictionary " + std::to_string(id) + " not found for tenant " + tenant_id);
  if (**r == 0) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = cache_.find(id);
    if (it != cache_.end() && it->second.tenant_id() == tenant_id) cache_.erase(it);
  }
  return **r;
}

size_t DictionaryRegistry::cached() const {
  std::lock_guard<std::mutex> g(mu_);
  return cache_.size();
}

}  // namespace sg::memory
