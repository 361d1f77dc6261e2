// Host memory pressure with hysteresis, for the offload decision (issue 6,
// "hysteresis on host memory so sandboxes do not flap"). Offloading turns
// on when available memory falls below start_below (a fraction of total)
// and turns off only once it is back above stop_above, so a host hovering
// near one threshold does not offload and restore sandboxes on every wait.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

#include "base/status.h"

namespace sg::memory {

class PressureGate {
 public:
  // 0 <= start_below <= stop_above <= 1.
  PressureGate(double start_below, double stop_above) : start_(start_below), stop_(stop_above) {}
  // Feeds one reading; returns whether offloading is on after it.
  bool update(uint64_t available, uint64_t total) {
    if (total == 0) return on_.load();
    double frac = static_cast<double>(available) / static_cast<double>(total);
    bool on = on_.load();
    if (!on && frac < start_) on = true;
    else if (on && frac > stop_) on = false;
    on_.store(on);
    return on;
  }
  bool on() const { return on_.load(); }

 private:
  double start_, stop_;
  std::atomic<bool> on_{false};
};

struct HostMemory {
  uint64_t available = 0;  // MemAvailable
  uint64_t total = 0;      // MemTotal
};
// Parses /proc/meminfo text (a test seam) or reads the host's.
Result<HostMemory> parse_meminfo(const std::string& text);
Result<HostMemory> read_host_memory();

}  // namespace sg::memory
