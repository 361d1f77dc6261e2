// eventually(): polls a condition until it holds or a deadline passes, for
// waiting on a server's periodic sweep, which has no event a test can wait
// on from outside. Not a way to synchronise with anything that has one.
#pragma once

#include <time.h>

#include <cstdint>

#include "base/sys.h"

namespace sg::test {

template <typename F>
bool eventually(F cond, int seconds = 20) {
  uint64_t deadline = sys::monotonic_ns() + static_cast<uint64_t>(seconds) * 1000000000ull;
  while (sys::monotonic_ns() < deadline) {
    if (cond()) return true;
    struct timespec ts = {0, 20 * 1000 * 1000};
    nanosleep(&ts, nullptr);
  }
  return cond();
}

}  // namespace sg::test
