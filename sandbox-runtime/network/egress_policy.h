// A sandbox's network egress policy (docs/egress.md): E2B's create fields
// `allow_internet_access` and `network.allowOut` / `network.denyOut`,
// decided per connection by the gateway's egress proxy on the host.
//
// Entries are IPv4 or IPv6 addresses, CIDRs, or (allowOut only) domain
// names, where "example.com" matches that name and "*.example.com" its
// subdomains. A destination is allowed when its name or address is in
// allowOut (allowOut wins over denyOut), else denied when its address is in
// denyOut or internet access is off, else allowed. Whatever the sandbox
// asks, addresses internal to the host's networks (loopback, RFC 1918,
// link-local, CGNAT, unique-local, multicast, unspecified) are refused
// unless the server opens them (--egress-allow-private).
//
// Pure: parsed from hostile input, bounded (64 entries per list).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace sg::network {

// An address as 16 bytes (IPv4 as ::ffff:a.b.c.d) and a prefix length
// over those 128 bits.
struct IpNet {
  std::array<uint8_t, 16> addr{};
  int prefix = 128;
  bool contains(const std::array<uint8_t, 16>& a) const;
};

// IPv4 as ::ffff:a.b.c.d (v4 holds 4 bytes in network order), and the test.
std::array<uint8_t, 16> v4_mapped(const void* v4);
bool is_v4_mapped(const std::array<uint8_t, 16>& a);

// "a.b.c.d", "a.b.c.d/n", "v6", "v6/n" (an IPv4 prefix counts over the
// IPv4 part): nullopt when the text is none of these.
std::optional<IpNet> parse_ip_net(const std::string& text);
// An address (no prefix) as 16 bytes; nullopt when it is not one.
std::optional<std::array<uint8_t, 16>> parse_ip(const std::string& text);
// Loopback, private, link-local, CGNAT, unique-local, multicast,
// unspecified, broadcast: the host's internal networks.
bool is_internal(const std::array<uint8_t, 16>& a);

struct EgressPolicy {
  bool internet = true;  // allow_internet_access
  std::vector<IpNet> allow_nets, deny_nets;
  std::vector<std::string> allow_names;  // lower case; "*.x" for subdomains of x
};

// The policy of a create's fields (or an update's: field_prefix is how
// errors name the lists, "network." in a create); kInvalid naming the bad
// entry.
Result<EgressPolicy> parse_egress_policy(const std::vector<std::string>& allow_out,
                                         const std::vector<std::string>& deny_out, std::optional<bool> internet,
                                         const std::string& field_prefix = "network.");

struct EgressDecision {
  bool allowed = false;
  std::string why;  // for a refusal: shown to the sandbox's client
};
// Whether the sandbox may connect to address `a`, reached as `host` (the
// name it asked for, or the address's text).
EgressDecision decide_egress(const EgressPolicy& p, const std::string& host, const std::array<uint8_t, 16>& a,
                             bool allow_internal);

// Whether host (a name) is one of p's allowOut names or under one of its
// "*." wildcards.
bool name_in_allow_out(const EgressPolicy& p, const std::string& host);

// One request head to the egress proxy, through its blank line (the
// sandbox wrote it: hostile). CONNECT host:port is a tunnel; an
// absolute-form http:// request gets origin_head, the head to send the
// origin (origin-form target, no Proxy-* or Connection headers, then
// "Connection: close": one request per connection).
inline constexpr size_t kMaxEgressHead = 16 * 1024;
struct EgressRequest {
  bool tunnel = false;
  std::string host;  // a name or an address (IPv6 without brackets)
  uint16_t port = 0;
  std::string origin_head;
};
Result<EgressRequest> parse_egress_request(std::string_view head);

}  // namespace sg::network
