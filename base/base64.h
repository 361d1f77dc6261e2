// Base64 (RFC 4648): the standard alphabet out; in, the standard and the
// URL-safe alphabets, with or without padding. Pure functions.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace sg {

std::string base64_encode(std::string_view in, bool pad = true);
// nullopt on a character outside both alphabets or a lone trailing one.
std::optional<std::string> base64_decode(std::string_view in);

}  // namespace sg
