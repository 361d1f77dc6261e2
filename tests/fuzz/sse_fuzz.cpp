// Fuzzes the SSE usage scanner and the JSON usage reader with arbitrary
// upstream bytes, split into chunks at fuzzer-chosen points: no crash, no
// unbounded buffering, and the same usage whatever the chunking.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "wait-engine/llm/usage.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  auto p = (data[0] & 1) ? sg::llm::Provider::kAnthropic : sg::llm::Provider::kOpenAI;
  size_t step = 1 + data[1] % 64;
  std::string_view body(reinterpret_cast<const char*>(data + 2), size - 2);
  (void)sg::llm::usage_from_json(p, body);
  sg::llm::SseUsageScanner whole(p, 4096), pieces(p, 4096);
  whole.feed(body);
  whole.finish();
  for (size_t off = 0; off < body.size(); off += step) pieces.feed(body.substr(off, step));
  pieces.finish();
  const auto &a = whole.usage(), &b = pieces.usage();
  // Lines over the bound are dropped in both, so the results agree.
  if (a.found != b.found || a.input != b.input || a.output != b.output || a.cache_read != b.cache_read ||
      a.cache_write != b.cache_write)
    std::abort();
  return 0;
}
