// DNS message parsing (dns_message.h).
#include "sandbox-runtime/network/dns_message.h"

#include <algorithm>

namespace sg::network {
namespace {

constexpr int kMaxPointers = 32;
constexpr size_t kMaxName = 255;

uint16_t u16(std::string_view m, size_t at) {
  return static_cast<uint16_t>((static_cast<uint8_t>(m[at]) << 8) | static_cast<uint8_t>(m[at + 1]));
}
uint32_t u32(std::string_view m, size_t at) { return (uint32_t{u16(m, at)} << 16) | u16(m, at + 2); }

// The name at *at (following pointers where allowed), lower case, dotted;
// *at moves past its bytes in place (a pointer ends it).
Status read_name(std::string_view m, size_t* at, std::string* out, bool pointers_allowed = true) {
  size_t pos = *at;
  bool jumped = false;
  int pointers = 0;
  size_t wire_len = 0;
  out->clear();
  for (;;) {
    if (pos >= m.size()) return invalid_error("DNS name runs past the message");
    uint8_t len = static_cast<uint8_t>(m[pos]);
    if ((len & 0xc0) == 0xc0) {
      if (!pointers_allowed) return invalid_error("DNS query name is compressed");
      if (pos + 1 >= m.size()) return invalid_error("DNS name pointer runs past the message");
      if (++pointers > kMaxPointers) return invalid_error("DNS name has too many pointers");
      size_t target = u16(m, pos) & 0x3fff;
      if (!jumped) *at = pos + 2;
      jumped = true;
      if (target >= m.size()) return invalid_error("DNS name pointer outside the message");
      pos = target;
      continue;
    }
    if ((len & 0xc0) != 0) return invalid_error("DNS label type not supported");
    if (len == 0) {
      if (!jumped) *at = pos + 1;
      return Status::Ok();
    }
    if (pos + 1 + len > m.size()) return invalid_error("DNS label runs past the message");
    wire_len += 1u + len;
    if (wire_len + 1 > kMaxName) return invalid_error("DNS name longer than 255 bytes");
    if (!out->empty()) out->push_back('.');
    for (size_t i = 0; i < len; ++i) {
      char c = m[pos + 1 + i];
      if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
      out->push_back(c);
    }
    pos += 1u + len;
  }
}

}  // namespace

Result<DnsQuestion> parse_dns_query(std::string_view m) {
  if (m.size() < kDnsHeader) return invalid_error("DNS message shorter than its header");
  if (m.size() > kMaxDnsMessage) return invalid_error("DNS message longer than 4096 bytes");
  uint16_t flags = u16(m, 2);
  if (flags & 0x8000) return invalid_error("DNS message is a response, not a query");
  if (((flags >> 11) & 0xf) != 0) return invalid_error("DNS opcode is not QUERY");
  if (u16(m, 4) != 1) return invalid_error("DNS query without exactly one question");
  if (u16(m, 6) != 0 || u16(m, 8) != 0) return invalid_error("DNS query with answer or authority records");
  if (u16(m, 10) > 1) return invalid_error("DNS query with more than one additional record");
  DnsQuestion q;
  q.id = u16(m, 0);
  size_t at = kDnsHeader;
  // A query's one name comes first: nothing before it to point at.
  if (Status s = read_name(m, &at, &q.name, false); !s) return s.error();
  if (at + 4 > m.size()) return invalid_error("DNS question runs past the message");
  q.qtype = u16(m, at);
  q.qclass = u16(m, at + 2);
  return q;
}

Result<DnsAnswers> parse_dns_answers(std::string_view m) {
  if (m.size() < kDnsHeader) return invalid_error("DNS message shorter than its header");
  if (m.size() > 65535) return invalid_error("DNS message too long");
  uint16_t flags = u16(m, 2);
  if (!(flags & 0x8000)) return invalid_error("DNS message is not a response");
  DnsAnswers out;
  out.id = u16(m, 0);
  out.rcode = flags & 0xf;
  uint16_t qd = u16(m, 4), an = u16(m, 6);
  size_t at = kDnsHeader;
  std::string name;
  for (uint16_t i = 0; i < qd; ++i) {
    if (Status s = read_name(m, &at, &name); !s) return s.error();
    if (at + 4 > m.size()) return invalid_error("DNS question runs past the message");
    at += 4;
  }
  bool any = false;
  for (uint16_t i = 0; i < an; ++i) {
    if (Status s = read_name(m, &at, &name); !s) return s.error();
    if (at + 10 > m.size()) return invalid_error("DNS record runs past the message");
    uint16_t type = u16(m, at), cls = u16(m, at + 2), rdlen = u16(m, at + 8);
    uint32_t ttl = u32(m, at + 4);
    at += 10;
    if (at + rdlen > m.size()) return invalid_error("DNS record data runs past the message");
    if (type == 1 && cls == 1 && rdlen == 4) {
      out.a.push_back(u32(m, at));
      out.min_ttl = any ? std::min(out.min_ttl, ttl) : ttl;
      any = true;
    }
    at += rdlen;
  }
  return out;
}

std::string dns_error_reply(std::string_view query, int rcode) {
  // The header and the question (up to its end), nothing else.
  size_t at = kDnsHeader;
  std::string name;
  if (!read_name(query, &at, &name, false) || at + 4 > query.size()) at = kDnsHeader;
  else at += 4;
  std::string r(query.substr(0, at));
  uint16_t qflags = u16(query, 2);
  uint16_t flags = static_cast<uint16_t>(0x8000 | (qflags & 0x0100) | 0x0080 | (rcode & 0xf));
  r[2] = static_cast<char>(flags >> 8);
  r[3] = static_cast<char>(flags & 0xff);
  r[4] = 0;
  r[5] = at > kDnsHeader ? 1 : 0;
  for (size_t i = 6; i < kDnsHeader; ++i) r[i] = 0;
  return r;
}

std::string dns_with_id(std::string_view msg, uint16_t id) {
  std::string r(msg);
  if (r.size() >= 2) {
    r[0] = static_cast<char>(id >> 8);
    r[1] = static_cast<char>(id & 0xff);
  }
  return r;
}

}  // namespace sg::network
