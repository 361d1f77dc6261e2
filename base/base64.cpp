// Base64 (RFC 4648): see base64.h.
#include "base/base64.h"

#include <cstdint>

namespace sg {

namespace {
const char kB64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
}  // namespace

std::string base64_encode(std::string_view in, bool pad) {
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  size_t i = 0;
  auto u = [&](size_t k) { return static_cast<uint8_t>(in[k]); };
  for (; i + 3 <= in.size(); i += 3) {
    uint32_t v = (u(i) << 16) | (u(i + 1) << 8) | u(i + 2);
    out += kB64[v >> 18];
    out += kB64[(v >> 12) & 63];
    out += kB64[(v >> 6) & 63];
    out += kB64[v & 63];
  }
  size_t rem = in.size() - i;
  if (rem == 1) {
    uint32_t v = u(i) << 16;
    out += kB64[v >> 18];
    out += kB64[(v >> 12) & 63];
    if (pad) out += "==";
  } else if (rem == 2) {
    uint32_t v = (u(i) << 16) | (u(i + 1) << 8);
    out += kB64[v >> 18];
    out += kB64[(v >> 12) & 63];
    out += kB64[(v >> 6) & 63];
    if (pad) out += '=';
  }
  return out;
}

std::optional<std::string> base64_decode(std::string_view in) {
  while (!in.empty() && in.back() == '=') in.remove_suffix(1);
  std::string out;
  out.reserve(in.size() * 3 / 4);
  uint32_t acc = 0;
  int bits = 0;
  for (char ch : in) {
    int v;
    if (ch >= 'A' && ch <= 'Z') v = ch - 'A';
    else if (ch >= 'a' && ch <= 'z') v = ch - 'a' + 26;
    else if (ch >= '0' && ch <= '9') v = ch - '0' + 52;
    else if (ch == '+' || ch == '-') v = 62;
    else if (ch == '/' || ch == '_') v = 63;
    else return std::nullopt;
    acc = (acc << 6) | uint32_t(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((acc >> bits) & 0xff);
    }
  }
  if (bits >= 6) return std::nullopt;  // a lone trailing character
  return out;
}

}  // namespace sg
