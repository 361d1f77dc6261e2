// Lower-case hexadecimal of bytes (digests, random ids).
#pragma once

#include <cstddef>
#include <string>

namespace sg {

inline std::string hex_lower(const unsigned char* d, size_t n) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * n);
  for (size_t i = 0; i < n; ++i) {
    out += kDigits[d[i] >> 4];
    out += kDigits[d[i] & 15];
  }
  return out;
}

}  // namespace sg
