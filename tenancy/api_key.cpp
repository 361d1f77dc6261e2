// API key helpers over OpenSSL's SHA-256.
#include "tenancy/api_key.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include "base/sys.h"

namespace sg::tenancy {

std::string generate_api_key() { return std::string(kKeyPrefix) + sys::random_hex(kKeyHexDigits / 2); }

bool is_prefixed_hex(std::string_view key, std::string_view prefix, size_t hex_digits) {
  if (key.size() != prefix.size() + hex_digits || key.substr(0, prefix.size()) != prefix) return false;
  for (char c : key.substr(prefix.size()))
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

bool is_well_formed_api_key(std::string_view key) { return is_prefixed_hex(key, kKeyPrefix, kKeyHexDigits); }

std::string hash_api_key(std::string_view key) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  // SAFETY: EVP_Digest reads key.size() bytes from key.data() and writes at most EVP_MAX_MD_SIZE.
  EVP_Digest(key.data(), key.size(), md, &len, EVP_sha256(), nullptr);
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(len * 2);
  for (unsigned i = 0; i < len; ++i) {
    out += kHex[md[i] >> 4];
    out += kHex[md[i] & 15];
  }
  return out;
}

std::string key_display_prefix(std::string_view key) {
  return std::string(key.substr(0, kKeyPrefix.size() + 6)) + "...";
}

bool secrets_equal(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace sg::tenancy
