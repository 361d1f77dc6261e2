// DNS messages as the forwarder reads them (RFC 1035 section 4; EDNS,
// RFC 6891, only passed through). Pure and bounded: every length, label
// and compression pointer is checked against the message, names are at
// most 255 bytes, a name follows at most 32 pointers.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace sg::network {

inline constexpr size_t kDnsHeader = 12;
inline constexpr size_t kMaxDnsMessage = 4096;  // UDP, EDNS included

struct DnsQuestion {
  uint16_t id = 0;
  std::string name;  // lower case, no trailing dot ("" for the root)
  uint16_t qtype = 0, qclass = 0;
};

// A standard query with one question, its name not compressed (kInvalid
// naming what is wrong).
Result<DnsQuestion> parse_dns_query(std::string_view msg);

struct DnsAnswers {
  uint16_t id = 0;
  int rcode = 0;
  std::vector<uint32_t> a;  // IPv4 addresses of the answer section's A records (host byte order)
  uint32_t min_ttl = 0;     // the smallest TTL of those records
};
// A response's A records (kInvalid where it is not a well-formed response).
Result<DnsAnswers> parse_dns_answers(std::string_view msg);

// A reply to query (parse_dns_query accepted it) with no records: its id
// and question, QR set, RD copied, RA set, rcode (2 SERVFAIL, 5 REFUSED).
std::string dns_error_reply(std::string_view query, int rcode);

// query with its id replaced (the upstream sees the forwarder's own).
std::string dns_with_id(std::string_view msg, uint16_t id);

}  // namespace sg::network
