// HttpRequest / HttpResponse: plain request and response values.
//
// Handlers (api-e2b, later wait-engine) see these instead of Beast types, so
// only gateway/http compiles Beast. Header names are lowercase.
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/status.h"

namespace sg::http {

struct HttpRequest {
  std::string method;  // "GET", "POST", ...
  std::string target;  // as received: path plus optional "?query"
  std::string path;    // target up to '?', not decoded
  std::string query;   // after '?', not decoded
  std::map<std::string, std::string> headers;  // lowercase names; repeated headers joined with ", "
  std::string body;
  std::string remote;  // peer address, for logs
  // Set by the server on connections that arrive over a sandbox's channel
  // (the in-sandbox model proxy address): the sandbox they come from.
  std::string bound_sandbox;

  // Header value or empty.
  std::string header(const std::string& lower_name) const {
    auto it = headers.find(lower_name);
    return it == headers.end() ? std::string() : it->second;
  }
};

struct HttpResponse {
  int status = 200;
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;
  std::string content_type;  // empty: none (no body)

  HttpResponse& header(std::string name, std::string value) {
    headers.emplace_back(std::move(name), std::move(value));
    return *this;
  }
};

// E2B's error shape: {"code": status, "message": text}.
HttpResponse json_error(int status, std::string_view message);
HttpResponse json_body(int status, std::string body);
HttpResponse no_content(int status = 204);

// The message framing rules of RFC 9112 section 6 that a parser may leave
// to its caller, checked on a request head (headers as HttpRequest joins
// them) before any body byte is read: a Transfer-Encoding whose last coding
// is not chunked (identity, xchunked, "chunked, identity"), chunked named
// twice, Transfer-Encoding with Content-Length, Transfer-Encoding in an
// HTTP/1.0 request, and a Content-Length that is not one decimal number
// (repeated values that differ). Any of these would let the body run as a
// second request on the connection (smuggling). Returns the reason, for a
// 400 after which the connection is closed, or "" when the framing is sound.
// version: 10 or 11.
std::string framing_error(const HttpRequest& head, unsigned version);

// What a client may read of an error: its message, except for kInternal,
// whose message names internals (SQL, host paths, syscalls): that one is
// logged under a fresh reference and the client gets "internal error
// (reference R)...".
std::string client_message(const Error& e);

// Percent-decodes s once ('+' is kept as '+' unless plus_as_space).
// Returns false on a malformed escape.
bool percent_decode(std::string_view s, std::string& out, bool plus_as_space = false);

// Splits "a=1&b=2" into decoded pairs. False on a malformed escape.
bool parse_query(std::string_view query, std::vector<std::pair<std::string, std::string>>& out);

}  // namespace sg::http
