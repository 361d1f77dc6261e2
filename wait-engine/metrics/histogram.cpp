#include "wait-engine/metrics/histogram.h"

#include <cmath>
#include <cstdio>

namespace sg::metrics {

namespace {
std::string num(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}
}  // namespace

std::vector<double> latency_bounds() {
  return {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
}

void render_header(std::string& out, const std::string& name, const char* type, const std::string& help) {
  out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

void render_sample(std::string& out, const std::string& name, const std::string& labels, double value) {
  out += name;
  if (!labels.empty()) out += "{" + labels + "}";
  out += " " + num(value) + "\n";
}

void render_count(std::string& out, const std::string& name, const char* type, const std::string& help,
                  uint64_t value) {
  render_header(out, name, type, help);
  out += name + " " + std::to_string(value) + "\n";
}

std::string escape_label(const std::string& v) {
  std::string o;
  for (char c : v) {
    if (c == '\\') o += "\\\\";
    else if (c == '"') o += "\\\"";
    else if (c == '\n') o += "\\n";
    else o += c;
  }
  return o;
}

void Histogram::render(std::string& out, const std::string& name, const std::string& help) const {
  render_header(out, name, "histogram", help);
  uint64_t cum = 0;
  for (size_t i = 0; i < buckets_.size(); ++i) {
    cum += buckets_[i].load(std::memory_order_relaxed);
    double le = i < bounds_.size() ? bounds_[i] : INFINITY;
    out += name + "_bucket{le=\"" + num(le) + "\"} " + std::to_string(cum) + "\n";
  }
  out += name + "_sum " + num(static_cast<double>(sum_nano_.load(std::memory_order_relaxed)) / 1e9) + "\n";
  out += name + "_count " + std::to_string(count_.load(std::memory_order_relaxed)) + "\n";
}

}  // namespace sg::metrics
