// libFuzzer target: the Connect envelope parser of envd (the one request
// envelope of a server-streaming call) and the base64 decoder used for
// process input. Invariants: no crash; a parsed envelope fits its body.
#include <cassert>
#include <cstdint>
#include <string>

#include "sandbox-runtime/agent/envd/rpc.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view in(reinterpret_cast<const char*>(data), size);
  auto env = sg::envd::parse_single_envelope(in);
  (void)env;
  auto b = sg::envd::base64_decode(in);
  if (b) {
    std::string again = sg::envd::base64_encode(*b);
    assert(sg::envd::base64_decode(again) == b);
  }
  return 0;
}
