// Logging: one line per event to stderr, with level and time. Thread-safe.
// Secrets (API keys, access tokens, provider keys) are never passed here.
#pragma once

#include <sstream>
#include <string>

namespace sg::log {

enum class Level { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

void set_level(Level l);
bool enabled(Level l);
void write(Level l, const std::string& line);

}  // namespace sg::log

#define SG_LOG(level, expr)                                             \
  do {                                                                   \
    if (::sg::log::enabled(::sg::log::Level::level)) {                   \
      std::ostringstream sg_log_os_;                                     \
      sg_log_os_ << expr;                                                \
      ::sg::log::write(::sg::log::Level::level, sg_log_os_.str());       \
    }                                                                    \
  } while (0)
#define LOG_DEBUG(expr) SG_LOG(kDebug, expr)
#define LOG_INFO(expr) SG_LOG(kInfo, expr)
#define LOG_WARN(expr) SG_LOG(kWarn, expr)
#define LOG_ERROR(expr) SG_LOG(kError, expr)
