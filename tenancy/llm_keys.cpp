// Model-proxy keys and upstream validation (tenancy/llm_keys.h).
#include "tenancy/llm_keys.h"

#include <arpa/inet.h>

#include "base/sys.h"
#include "tenancy/api_key.h"
#include "tenancy/tenants.h"

namespace sg::tenancy {

namespace {

constexpr size_t kMaxLabel = 64;
constexpr size_t kMaxBaseUrl = 2048;
constexpr size_t kMaxHost = 253;
constexpr size_t kMaxHostLabel = 63;

bool is_alnum(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'); }

char lower(char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; }

std::string lowercase(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = lower(c);
  return out;
}

// RFC 3986 pchar without pct-encoded: unreserved, sub-delims, ':' and '@'.
bool is_path_char(char c) {
  if (is_alnum(c)) return true;
  for (char o : std::string_view("-._~!$&'()*+,;=:@"))
    if (c == o) return true;
  return false;
}

Error bad_url(const std::string& why) {
  return invalid_error("invalid base URL: " + why + " (want http[s]://HOST[:PORT][/PATH])");
}

// A DNS name or IPv4 literal: labels of letters, digits, '-' and '_', not
// empty and not starting or ending with '-'.
Status check_reg_name(std::string_view host) {
  if (host.size() > kMaxHost) return bad_url("host is longer than 253 characters");
  size_t start = 0;
  for (;;) {
    size_t dot = host.find('.', start);
    std::string_view label = host.substr(start, dot == std::string_view::npos ? std::string_view::npos : dot - start);
    if (label.empty()) return bad_url("host '" + std::string(host) + "' has an empty label");
    if (label.size() > kMaxHostLabel) return bad_url("host '" + std::string(host) + "' has a label over 63 characters");
    if (label.front() == '-' || label.back() == '-')
      return bad_url("host '" + std::string(host) + "' has a label starting or ending with '-'");
    for (char c : label)
      if (!is_alnum(c) && c != '-' && c != '_')
        return bad_url("host '" + std::string(host) + "' may hold only letters, digits, '-', '_' and '.'");
    if (dot == std::string_view::npos) return Status::Ok();
    start = dot + 1;
  }
}

Result<uint16_t> parse_port(std::string_view text) {
  if (text.empty()) return bad_url("empty port after ':'");
  if (text.size() > 5) return bad_url("port is not in 1-65535");
  uint32_t v = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return bad_url("port '" + std::string(text) + "' is not a number");
    v = v * 10 + static_cast<uint32_t>(c - '0');
  }
  if (v < 1 || v > 65535) return bad_url("port " + std::to_string(v) + " is not in 1-65535");
  return static_cast<uint16_t>(v);
}

// "" or "/seg/seg" with trailing '/' removed; every segment non-empty, not
// "." or "..", and of pchar characters only.
Result<std::string> parse_path(std::string_view path) {
  while (!path.empty() && path.back() == '/') path.remove_suffix(1);
  if (path.empty()) return std::string();
  size_t start = 1;
  for (;;) {
    size_t slash = path.find('/', start);
    std::string_view seg = path.substr(start, slash == std::string_view::npos ? std::string_view::npos : slash - start);
    if (seg.empty()) return bad_url("the path has an empty segment ('//')");
    if (seg == "." || seg == "..") return bad_url("the path has a '.' or '..' segment");
    for (char c : seg) {
      if (c == '%') return bad_url("percent-encoding is not supported in the path");
      if (!is_path_char(c)) return bad_url(std::string("the path has the character '") + c + "'");
    }
    if (slash == std::string_view::npos) return std::string(path);
    start = slash + 1;
  }
}

}  // namespace

std::string generate_llm_key() { return std::string(kLlmKeyPrefix) + sys::random_hex(kLlmKeyHexDigits / 2); }

bool is_well_formed_llm_key(std::string_view key) { return is_prefixed_hex(key, kLlmKeyPrefix, kLlmKeyHexDigits); }

std::string llm_key_display_prefix(std::string_view key) {
  return std::string(key.substr(0, kLlmKeyPrefix.size() + 6)) + "...";
}

Result<CreatedLlmKey> make_llm_key(const std::string& tenant_id, const std::string& label) {
  if (label.size() > kMaxLabel) return invalid_error("key name is longer than 64 characters");
  for (char c : label)
    if (c < 0x20 || c > 0x7e) return invalid_error("key name may hold only printable ASCII characters");
  CreatedLlmKey k;
  k.key = generate_llm_key();
  k.row.id = "lk_" + sys::random_hex(8);
  k.row.tenant_id = tenant_id;
  k.row.key_hash = hash_api_key(k.key);
  k.row.key_prefix = llm_key_display_prefix(k.key);
  k.row.name = label;
  k.row.created_at = sys::unix_seconds();
  return k;
}

Result<CreatedLlmKey> LlmKeys::create(const std::string& tenant_name, const std::string& label) {
  Result<storage::TenantRow> t = Tenants(store_).by_name(tenant_name);
  if (!t) return t.error();
  if (t->disabled) return conflict_error("tenant '" + tenant_name + "' is revoked");
  Result<CreatedLlmKey> k = make_llm_key(t->id, label);
  if (!k) return k.error();
  if (Status s = store_.insert_llm_key(k->row); !s) return s.error();
  return k;
}

Result<storage::TenantRow> LlmKeys::authenticate(std::string_view presented) {
  const Error unauthorized(ErrorKind::kUnauthorized,
                           "invalid model API key: use a sandgate key (sk-sg-...) from `sandgate llm key create`");
  if (!is_well_formed_llm_key(presented)) return unauthorized;
  Result<std::optional<storage::TenantRow>> t = store_.tenant_for_llm_key_hash(hash_api_key(presented));
  if (!t) return t.error();
  if (!*t) return unauthorized;
  return **t;
}

bool valid_provider(std::string_view provider) {
  return provider == kProviderOpenAI || provider == kProviderAnthropic;
}

Result<BaseUrl> parse_base_url(std::string_view url) {
  if (url.size() > kMaxBaseUrl) return bad_url("longer than 2048 bytes");
  for (char c : url)
    if (static_cast<unsigned char>(c) <= 0x20 || static_cast<unsigned char>(c) >= 0x7f)
      return bad_url("it holds whitespace, control or non-ASCII characters");
  if (url.find('?') != std::string_view::npos) return bad_url("it has a query string");
  if (url.find('#') != std::string_view::npos) return bad_url("it has a fragment");
  size_t sep = url.find("://");
  std::string scheme = lowercase(url.substr(0, sep == std::string_view::npos ? 0 : sep));
  if (sep == std::string_view::npos || (scheme != "http" && scheme != "https"))
    return bad_url("the scheme must be http or https");
  BaseUrl u;
  u.tls = scheme == "https";
  std::string_view rest = url.substr(sep + 3);
  std::string_view authority = rest.substr(0, rest.find('/'));
  std::string_view path = rest.substr(authority.size());
  // Never echo the authority from here on until userinfo is ruled out: it
  // may hold a credential.
  if (authority.find('@') != std::string_view::npos)
    return bad_url("it has userinfo (user@host); give the provider key in a key file instead");
  if (authority.find('\\') != std::string_view::npos) return bad_url("the host has a '\\'");
  std::string_view host, port_text;
  bool has_port = false;
  if (!authority.empty() && authority.front() == '[') {
    size_t close = authority.find(']');
    if (close == std::string_view::npos) return bad_url("unterminated IPv6 literal");
    host = authority.substr(1, close - 1);
    std::string_view after = authority.substr(close + 1);
    if (!after.empty()) {
      if (after.front() != ':') return bad_url("unexpected characters after the IPv6 literal");
      has_port = true;
      port_text = after.substr(1);
    }
    if (host.empty()) return bad_url("no host");
    std::string h(host);
    in6_addr addr{};
    if (::inet_pton(AF_INET6, h.c_str(), &addr) != 1) return bad_url("'[" + h + "]' is not an IPv6 address");
  } else {
    size_t colon = authority.find(':');
    host = authority.substr(0, colon);
    if (colon != std::string_view::npos) {
      has_port = true;
      port_text = authority.substr(colon + 1);
    }
    if (host.empty()) return bad_url("no host");
    if (Status s = check_reg_name(host); !s) return s.error();
  }
  u.host = lowercase(host);
  if (has_port) {
    Result<uint16_t> p = parse_port(port_text);
    if (!p) return p.error();
    u.port = *p;
  } else {
    u.port = u.tls ? 443 : 80;
  }
  Result<std::string> p = parse_path(path);
  if (!p) return p.error();
  u.path_prefix = std::move(*p);
  return u;
}

std::string host_header(const BaseUrl& u) {
  std::string h = u.host.find(':') != std::string::npos ? "[" + u.host + "]" : u.host;
  if (u.port != (u.tls ? 443 : 80)) h += ":" + std::to_string(u.port);
  return h;
}

std::string format_base_url(const BaseUrl& u) {
  return std::string(u.tls ? "https://" : "http://") + host_header(u) + u.path_prefix;
}

Result<std::string> check_upstream(const std::string& provider, const std::string& base_url) {
  if (!valid_provider(provider))
    return invalid_error("unknown model provider '" + provider + "': use openai or anthropic");
  Result<BaseUrl> u = parse_base_url(base_url);
  if (!u) return u.error();
  return format_base_url(*u);
}

Result<std::string> read_secret_file(const std::string& path, std::string_view what) {
  // Room for surrounding whitespace; the trimmed key is checked below.
  Result<std::string> raw = sys::read_file(path, 4 * kMaxUpstreamKeyBytes);
  if (!raw) {
    if (raw.error().message().find("larger than limit") != std::string::npos)
      return invalid_error("key file " + path + " is larger than 4096 bytes: it should hold only " + std::string(what));
    return raw.error().with_context("read key file");
  }
  std::string_view k = *raw;
  auto space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; };
  while (!k.empty() && space(k.front())) k.remove_prefix(1);
  while (!k.empty() && space(k.back())) k.remove_suffix(1);
  if (k.empty()) return invalid_error("key file " + path + " is empty: write " + std::string(what) + " into it");
  if (k.size() > kMaxUpstreamKeyBytes)
    return invalid_error("key file " + path + " holds more than 4096 bytes: it should hold only " + std::string(what));
  for (char c : k)
    if (static_cast<unsigned char>(c) <= 0x20 || static_cast<unsigned char>(c) >= 0x7f)
      return invalid_error("key file " + path +
                           " holds whitespace, control or non-ASCII characters inside the key: it should hold only " +
                           std::string(what) + ", on one line");
  return std::string(k);
}

std::string upstream_key_hint(std::string_view key) {
  if (key.empty()) return "";
  if (key.size() < 16) return "(set)";
  return "..." + std::string(key.substr(key.size() - 4));
}

}  // namespace sg::tenancy
