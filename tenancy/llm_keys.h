// Model-proxy credentials and upstream configuration (wait-engine/llm,
// docs/schema.md "llm_keys", "llm_upstreams").
//
// A virtual key is what a sandbox presents to the proxy instead of a
// provider key: "sk-sg-" followed by 48 lowercase hex digits (192 bits from
// getrandom). Only its SHA-256 is stored; it is shown once, when created.
// Virtual keys are separate from the tenant's E2B API keys: neither kind
// authenticates in the other's place.
//
// The upstream helpers validate operator input (base URLs, provider key
// files) before it is stored or used to connect: parse_base_url is a trust
// boundary and refuses anything it cannot represent exactly.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "storage/store.h"
#include "base/status.h"

namespace sg::tenancy {

inline constexpr std::string_view kLlmKeyPrefix = "sk-sg-";
inline constexpr size_t kLlmKeyHexDigits = 48;

std::string generate_llm_key();
bool is_well_formed_llm_key(std::string_view key);
// What listings show of a key: "sk-sg-1a2b3c...".
std::string llm_key_display_prefix(std::string_view key);

struct CreatedLlmKey {
  storage::LlmKeyRow row;
  std::string key;  // the secret, returned once
};

// A fresh model-proxy key for a tenant and its row, not stored; kInvalid
// for a label over 64 characters or not printable ASCII.
Result<CreatedLlmKey> make_llm_key(const std::string& tenant_id, const std::string& label);

// Thin service over storage::Store; blocks on SQLite, so worker threads
// only. Thread-safe (the Store serialises).
class LlmKeys {
 public:
  explicit LlmKeys(storage::Store& store) : store_(store) {}

  // A new key for the tenant. kNotFound for an unknown tenant, kConflict for
  // a revoked one, kInvalid for a label that is not 0-64 printable ASCII
  // characters (listings are tab-separated).
  Result<CreatedLlmKey> create(const std::string& tenant_name, const std::string& label);
  // The tenant for a presented key; kUnauthorized, with one message, when
  // it is missing, malformed, unknown, revoked or its tenant is disabled, so
  // keys cannot be probed. Other errors are storage failures.
  Result<storage::TenantRow> authenticate(std::string_view presented);

 private:
  storage::Store& store_;
};

inline constexpr std::string_view kProviderOpenAI = "openai";
inline constexpr std::string_view kProviderAnthropic = "anthropic";
bool valid_provider(std::string_view provider);

// An upstream base URL, parsed: http(s)://HOST[:PORT][/PATH]. host is
// lowercase, without the brackets of an IPv6 literal; path_prefix is "" or
// starts with '/' and has no trailing '/'; port is the default (80, 443)
// when the URL names none.
struct BaseUrl {
  bool tls = false;
  std::string host;
  uint16_t port = 0;
  std::string path_prefix;
};

// kInvalid, saying what is wrong, for: a scheme other than http or https;
// an empty host; userinfo ("user@"); a query or fragment; a port outside
// 1-65535; a host with characters other than letters, digits, '-', '_' and
// '.' (or an IPv6 literal inet_pton refuses); a path with percent-encoding,
// "." or ".." segments, empty segments, or characters outside RFC 3986's
// pchar set; whitespace or control characters anywhere; over 2048 bytes.
// The message never quotes the URL, which may hold a credential.
Result<BaseUrl> parse_base_url(std::string_view url);
// The canonical text of a parsed URL: lowercase scheme and host, the port
// only when not the default, no trailing '/'.
std::string format_base_url(const BaseUrl& u);
// The Host header value for requests to u: "host", "host:port", "[v6]:port".
std::string host_header(const BaseUrl& u);

// Validates an upstream's provider and base URL; returns the normalised URL
// (format_base_url of the parse) to store.
Result<std::string> check_upstream(const std::string& provider, const std::string& base_url);

inline constexpr size_t kMaxUpstreamKeyBytes = 4096;
// Reads a secret (a provider key, a token) from a file: surrounding whitespace trimmed; kInvalid
// when empty, over kMaxUpstreamKeyBytes, or holding characters outside
// printable ASCII without space (it goes into an HTTP header). The message
// names the file, never its contents. what names the secret in messages
// ("the provider key", "the metrics token").
Result<std::string> read_secret_file(const std::string& path, std::string_view what);
inline Result<std::string> read_upstream_key_file(const std::string& path) {
  return read_secret_file(path, "the provider key");
}
// What listings show of a provider key: "...abcd" (its last 4 characters)
// for keys of 16 characters or more, "(set)" for shorter ones, "" for none.
std::string upstream_key_hint(std::string_view key);

}  // namespace sg::tenancy
