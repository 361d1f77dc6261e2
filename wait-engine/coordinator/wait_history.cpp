// WaitHistory: EWMA per key with a bounded key set.
#include "wait-engine/coordinator/wait_history.h"

namespace sg::wait {

void WaitHistory::record(const std::string& tenant, const std::string& model, uint64_t duration_ns) {
  std::string k = key(tenant, model);
  auto it = map_.find(k);
  if (it == map_.end()) {
    if (map_.size() >= max_keys_ && !lru_.empty()) {
      map_.erase(lru_.back());
      lru_.pop_back();
    }
    lru_.push_front(k);
    it = map_.emplace(k, Entry{static_cast<double>(duration_ns), 0, lru_.begin()}).first;
  } else {
    lru_.splice(lru_.begin(), lru_, it->second.lru);
  }
  Entry& e = it->second;
  e.mean = e.samples == 0 ? static_cast<double>(duration_ns) : alpha_ * static_cast<double>(duration_ns) + (1 - alpha_) * e.mean;
  ++e.samples;
}

std::optional<uint64_t> WaitHistory::mean_ns(const std::string& tenant, const std::string& model) const {
  auto it = map_.find(key(tenant, model));
  if (it == map_.end() || it->second.samples < min_samples_) return std::nullopt;
  return static_cast<uint64_t>(it->second.mean);
}

std::optional<uint64_t> WaitHistory::expected_remaining_ns(const std::string& tenant, const std::string& model,
                                                           uint64_t elapsed_ns) const {
  auto m = mean_ns(tenant, model);
  if (!m) return std::nullopt;
  return *m > elapsed_ns ? *m - elapsed_ns : 0;
}

}  // namespace sg::wait
