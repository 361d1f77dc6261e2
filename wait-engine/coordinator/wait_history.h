// WaitHistory: how long model waits last, learned per (tenant, model), to
// decide whether a wait pays for an offload (issue 5: "only when the
// expected remaining wait, learned per tenant and model from history, pays
// for it"). An exponentially weighted mean of completed wait durations per
// key; the expected remaining wait of a request that has waited `elapsed`
// is the mean minus elapsed (never below zero), and unknown until a key has
// min_samples waits. At most max_keys keys: the least recently updated one
// goes first. Pure; the owner serialises calls.
#pragma once

#include <cstdint>
#include <list>
#include <optional>
#include <string>
#include <unordered_map>

namespace sg::wait {

class WaitHistory {
 public:
  explicit WaitHistory(double alpha = 0.2, uint32_t min_samples = 3, size_t max_keys = 10000)
      : alpha_(alpha), min_samples_(min_samples), max_keys_(max_keys) {}

  void record(const std::string& tenant, const std::string& model, uint64_t duration_ns);
  std::optional<uint64_t> expected_remaining_ns(const std::string& tenant, const std::string& model,
                                                uint64_t elapsed_ns) const;
  std::optional<uint64_t> mean_ns(const std::string& tenant, const std::string& model) const;
  size_t keys() const { return map_.size(); }

 private:
  struct Entry {
    double mean = 0;
    uint32_t samples = 0;
    std::list<std::string>::iterator lru;
  };
  static std::string key(const std::string& tenant, const std::string& model) { return tenant + '\n' + model; }

  double alpha_;
  uint32_t min_samples_;
  size_t max_keys_;
  std::unordered_map<std::string, Entry> map_;
  std::list<std::string> lru_;  // front: most recently updated
};

}  // namespace sg::wait
