// RateLimiter: a token bucket per key (tenant), in memory.
//
// Thread-safe. The clock is injected so tests need no sleeping.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <unordered_map>

namespace sg::tenancy {

class RateLimiter {
 public:
  using Clock = std::function<uint64_t()>;  // monotonic nanoseconds
  // rate: tokens per second; burst: bucket size. rate <= 0 disables limiting.
  RateLimiter(double rate, double burst, Clock clock);

  // Takes one token for key. Returns 0 when allowed, else the whole seconds
  // (>= 1) after which a token will be available, for Retry-After.
  int64_t acquire(const std::string& key);

 private:
  struct Bucket {
    double tokens;
    uint64_t last_ns;
  };
  const double rate_;
  const double burst_;
  Clock clock_;
  std::mutex mu_;
  std::unordered_map<std::string, Bucket> buckets_;  // GUARDED_BY(mu_)
};

}  // namespace sg::tenancy
