// Helpers for plain HTTP values: JSON errors and query decoding.
#include "base/http/message.h"

#include <cctype>

#include <nlohmann/json.hpp>

#include "base/log.h"
#include "base/sys.h"

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


std::string client_message(const Error& e) {
  if (e.kind() != ErrorKind::kInternal) return e.message();
  std::string ref = sys::random_hex(6);
  LOG_ERROR("internal error " << ref << ": " << e.message());
  return "internal error (reference " + ref + "); the server's log has the details";
}

namespace {

std::string_view trim_ows(std::string_view v) {
  while (!v.empty() && (v.front() == ' ' || v.front() == '\t')) v.remove_prefix(1);
  while (!v.empty() && (v.back() == ' ' || v.back() == '\t')) v.remove_suffix(1);
  return v;
}

bool iequal(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(a[i])) != std::tolower(static_cast<unsigned char>(b[i]))) return false;
  return true;
}

}  // namespace

std::string framing_error(const HttpRequest& head, unsigned version) {
  auto te = head.headers.find("transfer-encoding");
  auto cl = head.headers.find("content-length");
  if (te != head.headers.end()) {
    if (version < 11) return "Transfer-Encoding in an HTTP/1.0 request (RFC 9112 6.1)";
    if (cl != head.headers.end()) return "both Transfer-Encoding and Content-Length (RFC 9112 6.1)";
    // The codings, comma-separated (repeated headers were joined with ", ").
    std::string_view rest(te->second);
    size_t chunked = 0;
    std::string_view last;
    bool any = false;
    while (true) {
      size_t c = rest.find(',');
      std::string_view coding = trim_ows(rest.substr(0, c));
      // Empty list elements are allowed and ignored (RFC 9110 5.6.1).
      if (!coding.empty()) {
        size_t semi = coding.find(';');  // transfer parameters
        std::string_view name = trim_ows(coding.substr(0, semi));
        if (iequal(name, "chunked")) {
          if (semi != std::string_view::npos) return "chunked takes no parameters (RFC 9112 7)";
          ++chunked;
        }
        last = name;
        any = true;
      }
      if (c == std::string_view::npos) break;
      rest.remove_prefix(c + 1);
    }
    if (!any) return "an empty Transfer-Encoding (RFC 9112 6.1)";
    if (chunked > 1) return "chunked applied more than once (RFC 9112 6.1)";
    if (!iequal(last, "chunked")) return "a Transfer-Encoding whose final coding is not chunked (RFC 9112 6.1)";
    return "";
  }
  if (cl != head.headers.end()) {
    // Repeated headers (or a list) must all carry one and the same value.
    std::string_view rest(cl->second);
    std::string_view first;
    bool seen = false;
    while (true) {
      size_t c = rest.find(',');
      std::string_view v = trim_ows(rest.substr(0, c));
      if (v.empty() || v.size() > 19) return "an invalid Content-Length (RFC 9112 6.3)";
      for (char ch : v)
        if (ch < '0' || ch > '9') return "an invalid Content-Length (RFC 9112 6.3)";
      if (seen && v != first) return "Content-Length values that differ (RFC 9112 6.3)";
      first = v;
      seen = true;
      if (c == std::string_view::npos) break;
      rest.remove_prefix(c + 1);
    }
  }
  return "";
}

}  // namespace sg::http
