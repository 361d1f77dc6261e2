// Helpers for plain HTTP values: JSON errors and query decoding.
#include "gateway/http/message.h"

#include <nlohmann/json.hpp>

namespace sg::http {

HttpResponse json_error(int status, std::string_view message) {
  nlohmann::json j = {{"code", status}, {"message", std::string(message)}};
  return json_body(status, j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
}

HttpResponse json_body(int status, std::string body) {
  HttpResponse r;
  r.status = status;
  r.body = std::move(body);
  r.content_type = "application/json";
  return r;
}

HttpResponse no_content(int status) {
  HttpResponse r;
  r.status = status;
  return r;
}

static int hexval(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

bool percent_decode(std::string_view s, std::string& out, bool plus_as_space) {
  out.clear();
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    char c = s[i];
    if (c == '%') {
      if (i + 2 >= s.size()) return false;
      int h = hexval(s[i + 1]), l = hexval(s[i + 2]);
      if (h < 0 || l < 0) return false;
      out += static_cast<char>(h * 16 + l);
      i += 2;
    } else if (c == '+' && plus_as_space) {
      out += ' ';
    } else {
      out += c;
    }
  }
  return true;
}

bool parse_query(std::string_view query, std::vector<std::pair<std::string, std::string>>& out) {
  out.clear();
  while (!query.empty()) {
    size_t amp = query.find('&');
    std::string_view part = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    if (part.empty()) continue;
    size_t eq = part.find('=');
    std::string k, v;
    if (!percent_decode(part.substr(0, eq), k, true)) return false;
    if (eq != std::string_view::npos && !percent_decode(part.substr(eq + 1), v, true)) return false;
    out.emplace_back(std::move(k), std::move(v));
  }
  return true;
}


}  // namespace sg::http
