// SHA-256 (FIPS 180-4), for the /files URL signatures (docs/envd.md). The
// agent is linked -static without OpenSSL, so it carries this compact one.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

namespace sg::envd {

std::array<uint8_t, 32> sha256(std::string_view data);

}  // namespace sg::envd
