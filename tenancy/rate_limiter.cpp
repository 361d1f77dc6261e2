// Token bucket implementation.
#include "tenancy/rate_limiter.h"

#include <algorithm>
#include <cmath>

namespace sg::tenancy {

RateLimiter::RateLimiter(double rate, double burst, Clock clock)
    : rate_(rate), burst_(std::max(1.0, burst)), clock_(std::move(clock)) {}

int64_t RateLimiter::acquire(const std::string& key) {
  if (rate_ <= 0) return 0;
  uint64_t now = clock_();
  std::lock_guard<std::mutex> g(mu_);
  auto [it, fresh] = buckets_.try_emplace(key, Bucket{burst_, now});
  Bucket& b = it->second;
  if (!fresh && now > b.last_ns) {
    b.tokens = std::min(burst_, b.tokens + rate_ * static_cast<double>(now - b.last_ns) / 1e9);
    b.last_ns = now;
  }
  if (b.tokens >= 1.0) {
    b.tokens -= 1.0;
    return 0;
  }
  double wait_s = (1.0 - b.tokens) / rate_;
  return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(wait_s)));
}

}  // namespace sg::tenancy
