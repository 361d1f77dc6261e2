// Logging backend: a line-atomic write to stderr.
#include "base/log.h"

#include <unistd.h>

#include <atomic>
#include <ctime>

namespace sg::log {

namespace {
// The one process-wide knob; set once at start-up by main.
std::atomic<int> g_level{static_cast<int>(Level::kInfo)};
const char* name(Level l) {
  switch (l) {
    case Level::kDebug: return "debug";
    case Level::kInfo: return "info";
    case Level::kWarn: return "warn";
    case Level::kError: return "error";
  }
  return "?";
}
}  // namespace

void set_level(Level l) { g_level.store(static_cast<int>(l)); }
bool enabled(Level l) { return static_cast<int>(l) >= g_level.load(std::memory_order_relaxed); }

void write(Level l, const std::string& line) {
  struct timespec ts;
  ::clock_gettime(CLOCK_REALTIME, &ts);
  struct tm tm;
  ::gmtime_r(&ts.tv_sec, &tm);
  char head[64];
  size_t n = ::strftime(head, sizeof head, "%Y-%m-%dT%H:%M:%S", &tm);
  std::string out(head, n);
  char ms[16];
  ::snprintf(ms, sizeof ms, ".%03dZ", static_cast<int>(ts.tv_nsec / 1000000));
  out += ms;
  out += ' ';
  out += name(l);
  out += ' ';
  out += line;
  out += '\n';
  // One write() per line keeps lines from interleaving between threads.
  ssize_t r = ::write(2, out.data(), out.size());
  (void)r;
}

}  // namespace sg::log
