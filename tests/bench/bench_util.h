// Shared by the benchmarks: percentiles and the machine's CPU model.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "base/sys.h"

namespace sg::bench {

// The p-th percentile (nearest rank) of v; 0 for an empty v.
inline double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t i = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(v.size())));
  i = i == 0 ? 0 : i - 1;
  return v[std::min(i, v.size() - 1)];
}

// "model name" from /proc/cpuinfo.
inline std::string cpu_model() {
  auto info = sys::read_file("/proc/cpuinfo", 4 << 20);
  if (!info) return "unknown";
  size_t at = info->find("model name");
  if (at == std::string::npos) return "unknown";
  size_t colon = info->find(':', at);
  return info->substr(colon + 2, info->find('\n', colon) - colon - 2);
}

}  // namespace sg::bench
