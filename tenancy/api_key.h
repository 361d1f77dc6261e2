// API keys: generation, format check and hashing.
//
// A key is "e2b_" followed by 40 lowercase hex digits (the format the Python
// SDK validates). Only its SHA-256 is stored; the key itself is shown once,
// when it is created.
#pragma once

#include <string>
#include <string_view>

namespace sg::tenancy {

inline constexpr std::string_view kKeyPrefix = "e2b_";
inline constexpr size_t kKeyHexDigits = 40;

// A fresh random key (160 bits from getrandom).
std::string generate_api_key();
bool is_well_formed_api_key(std::string_view key);
// True when key is prefix followed by exactly hex_digits lowercase hex
// digits (the shape of both E2B and model-proxy keys).
bool is_prefixed_hex(std::string_view key, std::string_view prefix, size_t hex_digits);
// Lowercase hex SHA-256 of the key.
std::string hash_api_key(std::string_view key);
// What listings show of a key: "e2b_1a2b3c…".
std::string key_display_prefix(std::string_view key);

// Constant-time comparison of two secrets.
bool secrets_equal(std::string_view a, std::string_view b);

}  // namespace sg::tenancy
