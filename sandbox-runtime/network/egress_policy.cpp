// Egress policy parsing and decisions (egress_policy.h).
#include "sandbox-runtime/network/egress_policy.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cctype>
#include <cstring>

namespace sg::network {

namespace {

constexpr size_t kMaxEntries = 64;
constexpr size_t kMaxName = 253;

bool valid_name(const std::string& n) {
  // Labels of [a-z0-9-], not starting or ending with '-', 1..63 long.
  if (n.empty() || n.size() > kMaxName) return false;
  size_t label = 0;
  for (size_t i = 0; i < n.size(); ++i) {
    char c = n[i];
    if (c == '.') {
      if (label == 0 || n[i - 1] == '-') return false;
      label = 0;
      continue;
    }
    if (!(std::islower(static_cast<unsigned char>(c)) || std::isdigit(static_cast<unsigned char>(c)) || c == '-'))
      return false;
    if (c == '-' && label == 0) return false;
    if (++label > 63) return false;
  }
  return label > 0 && n.back() != '-';
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

bool name_matches(const std::string& pattern, const std::string& host) {
  if (pattern.rfind("*.", 0) == 0) {
    std::string suffix = pattern.substr(1);  // ".example.com"
    return host.size() > suffix.size() && host.compare(host.size() - suffix.size(), suffix.size(), suffix) == 0;
  }
  return pattern == host;
}

IpNet net(const char* text) { return *parse_ip_net(text); }

// "host:port" / "[v6]:port"; default_port when there is no port.
std::optional<EgressRequest> parse_authority(std::string_view a, uint16_t default_port) {
  EgressRequest t;
  std::string_view port;
  if (!a.empty() && a[0] == '[') {
    size_t close = a.find(']');
    if (close == std::string_view::npos) return std::nullopt;
    t.host = std::string(a.substr(1, close - 1));
    std::string_view after = a.substr(close + 1);
    if (!after.empty()) {
      if (after[0] != ':') return std::nullopt;
      port = after.substr(1);
    }
  } else {
    size_t colon = a.rfind(':');
    t.host = std::string(a.substr(0, colon));
    if (colon != std::string_view::npos) port = a.substr(colon + 1);
  }
  if (t.host.empty() || t.host.size() > 253) return std::nullopt;
  for (char c : t.host)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == ':' || c == '_')) return std::nullopt;
  if (port.empty()) {
    if (default_port == 0) return std::nullopt;
    t.port = default_port;
  } else {
    if (port.size() > 5 || !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; }))
      return std::nullopt;
    unsigned long v = std::stoul(std::string(port));
    if (v == 0 || v > 65535) return std::nullopt;
    t.port = static_cast<uint16_t>(v);
  }
  return t;
}

}  // namespace

bool IpNet::contains(const std::array<uint8_t, 16>& a) const {
  int full = prefix / 8, rest = prefix % 8;
  if (std::memcmp(addr.data(), a.data(), static_cast<size_t>(full)) != 0) return false;
  if (rest == 0) return true;
  uint8_t mask = static_cast<uint8_t>(0xff << (8 - rest));
  return (addr[static_cast<size_t>(full)] & mask) == (a[static_cast<size_t>(full)] & mask);
}

std::array<uint8_t, 16> v4_mapped(const void* v4) {
  std::array<uint8_t, 16> a{};
  a[10] = a[11] = 0xff;
  std::memcpy(a.data() + 12, v4, 4);
  return a;
}

bool is_v4_mapped(const std::array<uint8_t, 16>& a) {
  return a[10] == 0xff && a[11] == 0xff && std::all_of(a.begin(), a.begin() + 10, [](uint8_t b) { return b == 0; });
}

std::optional<std::array<uint8_t, 16>> parse_ip(const std::string& text) {
  std::array<uint8_t, 16> a{};
  in_addr v4{};
  if (::inet_pton(AF_INET, text.c_str(), &v4) == 1) return v4_mapped(&v4);
  in6_addr v6{};
  if (::inet_pton(AF_INET6, text.c_str(), &v6) == 1) {
    std::memcpy(a.data(), &v6, 16);
    return a;
  }
  return std::nullopt;
}

std::optional<IpNet> parse_ip_net(const std::string& text) {
  if (text.size() > 64) return std::nullopt;
  size_t slash = text.find('/');
  std::string ip = text.substr(0, slash);
  auto a = parse_ip(ip);
  if (!a) return std::nullopt;
  bool v4 = ip.find(':') == std::string::npos;
  IpNet n;
  n.addr = *a;
  n.prefix = 128;
  if (slash != std::string::npos) {
    std::string p = text.substr(slash + 1);
    if (p.empty() || p.size() > 3 || !std::all_of(p.begin(), p.end(), [](char c) { return c >= '0' && c <= '9'; }))
      return std::nullopt;
    int bits = std::stoi(p);
    if (bits > (v4 ? 32 : 128)) return std::nullopt;
    n.prefix = v4 ? 96 + bits : bits;
  }
  // E2B's ALL_TRAFFIC is "0.0.0.0/0": every destination, IPv6 ones too.
  if (v4 && n.prefix == 96 && *a == parse_ip("0.0.0.0")) n.prefix = 0;
  // Host bits set below the prefix are cleared, so "10.1.2.3/8" is 10/8.
  for (int bit = n.prefix; bit < 128; ++bit) n.addr[static_cast<size_t>(bit / 8)] &= static_cast<uint8_t>(~(0x80 >> (bit % 8)));
  return n;
}

bool is_internal(const std::array<uint8_t, 16>& a) {
  static const std::vector<IpNet> internal = {
      net("0.0.0.0/8"),     net("10.0.0.0/8"),   net("100.64.0.0/10"), net("127.0.0.0/8"),
      net("169.254.0.0/16"), net("172.16.0.0/12"), net("192.0.0.0/24"), net("192.168.0.0/16"),
      net("198.18.0.0/15"),  net("224.0.0.0/3"),  // multicast, reserved and broadcast
      net("::/128"),         net("::1/128"),      net("fc00::/7"),      net("fe80::/10"), net("ff00::/8"),
      net("64:ff9b::/96"),  // NAT64 to anything, internal addresses too
  };
  return std::any_of(internal.begin(), internal.end(), [&](const IpNet& n) { return n.contains(a); });
}

Result<EgressPolicy> parse_egress_policy(const std::vector<std::string>& allow_out,
                                         const std::vector<std::string>& deny_out, std::optional<bool> internet,
                                         const std::string& field_prefix) {
  if (allow_out.size() > kMaxEntries || deny_out.size() > kMaxEntries)
    return invalid_error("fields '" + field_prefix + "allowOut' and '" + field_prefix + "denyOut': at most " +
                         std::to_string(kMaxEntries) + " entries each");
  EgressPolicy p;
  p.internet = internet.value_or(true);
  for (const std::string& e : allow_out) {
    if (auto n = parse_ip_net(e)) {
      p.allow_nets.push_back(*n);
      continue;
    }
    std::string name = lower(e);
    std::string bare = name.rfind("*.", 0) == 0 ? name.substr(2) : name;
    if (!valid_name(bare))
      return invalid_error("field '" + field_prefix + "allowOut': '" + e.substr(0, 80) +
                           "' is not an IP address, a CIDR or a domain name");
    p.allow_names.push_back(name);
  }
  for (const std::string& e : deny_out) {
    auto n = parse_ip_net(e);
    if (!n)
      return invalid_error("field '" + field_prefix + "denyOut': '" + e.substr(0, 80) + "' is not an IP address or a CIDR");
    p.deny_nets.push_back(*n);
  }
  return p;
}

EgressDecision decide_egress(const EgressPolicy& p, const std::string& host, const std::array<uint8_t, 16>& a,
                             bool allow_internal) {
  char text[INET6_ADDRSTRLEN] = "?";
  bool v4 = is_v4_mapped(a);
  ::inet_ntop(v4 ? AF_INET : AF_INET6, v4 ? a.data() + 12 : a.data(), text, sizeof text);
  std::string where = host == text ? host : host + " (" + text + ")";
  if (!allow_internal && is_internal(a))
    return {false, "egress to " + where + " is refused: an address internal to the host's networks"};
  std::string h = lower(host);
  bool allowed = std::any_of(p.allow_names.begin(), p.allow_names.end(), [&](const std::string& n) { return name_matches(n, h); }) ||
                 std::any_of(p.allow_nets.begin(), p.allow_nets.end(), [&](const IpNet& n) { return n.contains(a); });
  if (allowed) return {true, ""};
  if (std::any_of(p.deny_nets.begin(), p.deny_nets.end(), [&](const IpNet& n) { return n.contains(a); }))
    return {false, "egress to " + where + " is denied by the sandbox's network.denyOut"};
  if (!p.internet) return {false, "egress to " + where + " is denied: the sandbox has no internet access (allow_internet_access is false)"};
  return {true, ""};
}

bool name_in_allow_out(const EgressPolicy& p, const std::string& host) {
  std::string h = lower(host);
  return std::any_of(p.allow_names.begin(), p.allow_names.end(), [&](const std::string& n) { return name_matches(n, h); });
}

Result<EgressRequest> parse_egress_request(std::string_view head) {
  if (head.size() > kMaxEgressHead) return invalid_error("proxy request head over 16 KiB");
  if (head.size() < 4 || head.substr(head.size() - 4) != "\r\n\r\n" || head.find('\0') != std::string_view::npos)
    return invalid_error("not an HTTP/1.x proxy request");
  // Request line: METHOD SP TARGET SP HTTP/1.x
  std::string_view line = head.substr(0, head.find("\r\n"));
  size_t sp1 = line.find(' '), sp2 = line.rfind(' ');
  if (sp1 == std::string_view::npos || sp1 == 0 || sp2 == sp1 || line.substr(sp2 + 1, 7) != "HTTP/1." ||
      line.size() != sp2 + 9)
    return invalid_error("not an HTTP/1.x proxy request");
  std::string_view method = line.substr(0, sp1), target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  for (char c : method)
    if (!std::isupper(static_cast<unsigned char>(c))) return invalid_error("not an HTTP/1.x proxy request");
  // Header lines: "name: value", nothing else (a bare CR or LF would let
  // the sandbox smuggle a second request past the rewrite).
  std::vector<std::string_view> headers;
  for (size_t pos = line.size() + 2; pos + 2 < head.size();) {
    size_t end = head.find("\r\n", pos);
    std::string_view h = head.substr(pos, end - pos);
    size_t colon = h.find(':');
    if (colon == 0 || colon == std::string_view::npos || h.find('\r') != std::string_view::npos ||
        h.find('\n') != std::string_view::npos)
      return invalid_error("malformed header line in the proxy request");
    headers.push_back(h);
    pos = end + 2;
  }
  std::optional<EgressRequest> t;
  if (method == "CONNECT") {
    t = parse_authority(target, 0);
    if (t) t->tunnel = true;
  } else if (target.substr(0, 7) == "http://") {
    std::string_view rest = target.substr(7);
    size_t slash = rest.find('/');
    t = parse_authority(rest.substr(0, slash), 80);
    std::string_view path = slash == std::string_view::npos ? std::string_view("/") : rest.substr(slash);
    if (t) {
      // Origin form, no Proxy-* headers, one request ("Connection: close").
      t->origin_head = std::string(method) + " " + std::string(path) + " HTTP/1.1\r\n";
      for (std::string_view h : headers) {
        std::string name = lower(std::string(h.substr(0, h.find(':'))));
        if (name.rfind("proxy-", 0) == 0 || name == "connection" || name == "keep-alive") continue;
        t->origin_head += std::string(h) + "\r\n";
      }
      t->origin_head += "Connection: close\r\n\r\n";
    }
  } else {
    return invalid_error("the egress proxy takes CONNECT host:port or an absolute http:// URL "
                         "(use it as HTTP_PROXY/HTTPS_PROXY)");
  }
  if (!t) return invalid_error("bad proxy target '" + std::string(target.substr(0, 200)) + "'");
  return *t;
}

}  // namespace sg::network
