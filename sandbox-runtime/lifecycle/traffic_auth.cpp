// Credentials for traffic to paused or private sandboxes (traffic_auth.h).
#include "sandbox-runtime/lifecycle/traffic_auth.h"

#include <openssl/evp.h>

#include <cstdlib>
#include <vector>

#include "base/sys.h"
#include "tenancy/api_key.h"

namespace sg::lifecycle {

namespace {

std::string base64_unpadded(const unsigned char* p, size_t n) {
  static const char k[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  size_t i = 0;
  for (; i + 3 <= n; i += 3) {
    uint32_t v = (uint32_t{p[i]} << 16) | (uint32_t{p[i + 1]} << 8) | p[i + 2];
    out += k[v >> 18];
    out += k[(v >> 12) & 63];
    out += k[(v >> 6) & 63];
    out += k[v & 63];
  }
  if (n - i == 1) {
    uint32_t v = uint32_t{p[i]} << 16;
    out += k[v >> 18];
    out += k[(v >> 12) & 63];
  } else if (n - i == 2) {
    uint32_t v = (uint32_t{p[i]} << 16) | (uint32_t{p[i + 1]} << 8);
    out += k[v >> 18];
    out += k[(v >> 12) & 63];
    out += k[(v >> 6) & 63];
  }
  return out;
}

}  // namespace

std::string file_signature(const std::string& path, const std::string& operation, const std::string& username,
                           const std::string& token, std::optional<int64_t> expiration) {
  std::string s = path + ":" + operation + ":" + username + ":" + token;
  if (expiration) s += ":" + std::to_string(*expiration);
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  // SAFETY: EVP_Digest reads s.size() bytes and writes at most EVP_MAX_MD_SIZE.
  EVP_Digest(s.data(), s.size(), md, &len, EVP_sha256(), nullptr);
  return "v1_" + base64_unpadded(md, len);
}

bool envd_credentials_ok(const http::HttpRequest& head, const std::string& envd_token, int64_t now) {
  if (envd_token.empty()) return true;  // an unsecured sandbox: envd asks for nothing
  auto tok = head.headers.find("x-access-token");
  if (tok != head.headers.end()) return tenancy::secrets_equal(tok->second, envd_token);
  if (head.path != "/files") return false;
  std::vector<std::pair<std::string, std::string>> q;
  if (!http::parse_query(head.query, q)) return false;
  auto find = [&](const char* k) -> const std::string* {
    for (const auto& [n, v] : q)
      if (n == k) return &v;
    return nullptr;
  };
  const std::string* sig = find("signature");
  if (!sig) return false;
  std::optional<int64_t> exp;
  if (const std::string* e = find("signature_expiration")) {
    char* end = nullptr;
    long long v = std::strtoll(e->c_str(), &end, 10);
    if (e->empty() || *end) return false;
    if (v < now) return false;
    exp = v;
  }
  const std::string* path = find("path");
  const std::string* user = find("username");
  std::string want = file_signature(path ? *path : "", head.method == "POST" ? "write" : "read", user ? *user : "",
                                    envd_token, exp);
  return tenancy::secrets_equal(*sig, want);
}

bool traffic_token_ok(const http::HttpRequest& head, const std::string& token) {
  auto it = head.headers.find("e2b-traffic-access-token");
  return it != head.headers.end() && tenancy::secrets_equal(it->second, token);
}

std::optional<bool> port_listening(int64_t pid, uint16_t port) {
  bool read_any = false;
  for (const char* f : {"tcp", "tcp6"}) {
    Result<std::string> t = sys::read_file("/proc/" + std::to_string(pid) + "/net/" + f, 4 << 20);
    if (!t) continue;
    read_any = true;
    // "  sl  local_address rem_address   st ...": local "ADDR:PORT" in hex,
    // state 0A is LISTEN.
    size_t at = t->find('\n');
    while (at != std::string::npos && at + 1 < t->size()) {
      size_t end = t->find('\n', at + 1);
      std::string_view line(t->data() + at + 1, (end == std::string::npos ? t->size() : end) - at - 1);
      at = end;
      size_t colon = line.find(':');  // after the slot number
      if (colon == std::string_view::npos) continue;
      size_t local = line.find_first_not_of(' ', colon + 1);
      if (local == std::string_view::npos) continue;
      size_t sp = line.find(' ', local);
      if (sp == std::string_view::npos) continue;
      std::string_view addr = line.substr(local, sp - local);
      size_t pc = addr.rfind(':');
      if (pc == std::string_view::npos) continue;
      unsigned long p = std::strtoul(std::string(addr.substr(pc + 1)).c_str(), nullptr, 16);
      size_t rem = line.find_first_not_of(' ', sp);
      if (rem == std::string_view::npos) continue;
      size_t rem_end = line.find(' ', rem);
      if (rem_end == std::string_view::npos) continue;
      size_t st = line.find_first_not_of(' ', rem_end);
      if (st == std::string_view::npos || st + 2 > line.size()) continue;
      if (p == port && line.substr(st, 2) == "0A") return true;
    }
  }
  if (!read_any) return std::nullopt;
  return false;
}

}  // namespace sg::lifecycle
