// TokenBudget: model tokens per tenant per minute (the model proxy's token
// rate limit, docs/llm-gateway.md).
//
// A bucket per tenant that refills continuously at per_min / 60 s up to
// per_min, and may go negative: a response's usage is known only after it
// was delivered, so charge() debits what was used and admit() refuses new
// requests while the balance is not positive, saying how many whole seconds
// until it is. per_min <= 0 disables the limit. Thread-safe; the clock is
// injected so tests need no sleeping.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <unordered_map>

namespace sg::tenancy {

class TokenBudget {
 public:
  using Clock = std::function<uint64_t()>;  // monotonic nanoseconds
  TokenBudget(double per_min, Clock clock) : rate_per_ns_(per_min / 60e9), cap_(per_min), clock_(std::move(clock)) {}

  // 0: admitted; else seconds (>= 1) until the balance is positive again.
  int64_t admit(const std::string& tenant) {
    if (cap_ <= 0) return 0;
    std::lock_guard<std::mutex> g(mu_);
    double t = refill(tenant);
    if (t > 0) return 0;
    return static_cast<int64_t>((1 - t) / (rate_per_ns_ * 1e9)) + 1;
  }
  void charge(const std::string& tenant, uint64_t tokens) {
    if (cap_ <= 0) return;
    std::lock_guard<std::mutex> g(mu_);
    refill(tenant);
    buckets_[tenant].tokens -= static_cast<double>(tokens);
  }
  double balance(const std::string& tenant) {
    std::lock_guard<std::mutex> g(mu_);
    return refill(tenant);
  }

 private:
  struct Bucket {
    double tokens;
    uint64_t last;
  };
  double refill(const std::string& tenant) {
    uint64_t now = clock_();
    auto [it, fresh] = buckets_.try_emplace(tenant, Bucket{cap_, now});
    Bucket& b = it->second;
    if (!fresh && now > b.last) {
      b.tokens = std::min(cap_, b.tokens + static_cast<double>(now - b.last) * rate_per_ns_);
      b.last = now;
    }
    return b.tokens;
  }
  double rate_per_ns_;
  double cap_;
  Clock clock_;
  std::mutex mu_;
  std::unordered_map<std::string, Bucket> buckets_;  // GUARDED_BY(mu_)
};

}  // namespace sg::tenancy
