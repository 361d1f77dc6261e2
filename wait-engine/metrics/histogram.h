// Histogram and counters for /metrics (Prometheus text format 0.0.4).
//
// Fixed upper bounds chosen at construction; observe() is lock-free
// (relaxed atomics), so the hot paths (proxy, coordinator) pay a few
// atomic adds. render() writes the _bucket/_sum/_count series.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace sg::metrics {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), buckets_(bounds_.size() + 1) {}
  void observe(double v) {
    size_t i = 0;
    while (i < bounds_.size() && v > bounds_[i]) ++i;
    buckets_[i].fetch_add(1, std::memory_order_relaxed);
    count_.fetch_add(1, std::memory_order_relaxed);
    // Sum in nanounits keeps it an integer atomic.
    sum_nano_.fetch_add(static_cast<uint64_t>(v * 1e9 + 0.5), std::memory_order_relaxed);
  }
  uint64_t count() const { return count_.load(std::memory_order_relaxed); }
  // Appends "# HELP", "# TYPE" and the series for `name`.
  void render(std::string& out, const std::string& name, const std::string& help) const;

 private:
  std::vector<double> bounds_;
  std::vector<std::atomic<uint64_t>> buckets_;
  std::atomic<uint64_t> count_{0};
  std::atomic<uint64_t> sum_nano_{0};
};

// Latency buckets in seconds, 100 us .. 10 s.
std::vector<double> latency_bounds();

// One "# HELP/# TYPE" header plus a sample line; labels is "" or
// `a="b",c="d"` (values already escaped with escape_label).
void render_header(std::string& out, const std::string& name, const char* type, const std::string& help);
void render_sample(std::string& out, const std::string& name, const std::string& labels, double value);
// A whole series with one unlabelled integer sample, written exactly (byte
// and page counts pass 2^53 and %.9g's nine digits).
void render_count(std::string& out, const std::string& name, const char* type, const std::string& help,
                  uint64_t value);
std::string escape_label(const std::string& v);

}  // namespace sg::metrics
