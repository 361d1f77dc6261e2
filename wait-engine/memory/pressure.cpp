// /proc/meminfo reading for the pressure gate (pressure.h).
#include "wait-engine/memory/pressure.h"

#include <cstdlib>

#include "base/sys.h"

namespace sg::memory {

Result<HostMemory> parse_meminfo(const std::string& text) {
  HostMemory m;
  bool have_avail = false, have_total = false;
  auto field = [&](const char* name, uint64_t& out, bool& have) {
    size_t p = text.find(name);
    if (p == std::string::npos) return;
    const char* s = text.c_str() + p + std::char_traits<char>::length(name);
    char* end = nullptr;
    unsigned long long kb = std::strtoull(s, &end, 10);
    if (end == s) return;
    out = static_cast<uint64_t>(kb) * 1024;
    have = true;
  };
  field("MemAvailable:", m.available, have_avail);
  field("MemTotal:", m.total, have_total);
  if (!have_avail || !have_total || m.total == 0) return invalid_error("/proc/meminfo without MemAvailable and MemTotal");
  return m;
}

Result<HostMemory> read_host_memory() {
  Result<std::string> t = sys::read_file("/proc/meminfo", 1 << 16);
  if (!t) return t.error();
  return parse_meminfo(*t);
}

}  // namespace sg::memory
