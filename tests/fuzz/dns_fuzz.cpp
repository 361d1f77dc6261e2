// Fuzzes the DNS forwarder's message parsing with arbitrary bytes, as a
// sandbox (queries) or an upstream (answers) may send them: no crash, no
// read outside the message, and an error reply always echoes the id.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "sandbox-runtime/network/dns_message.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view m(reinterpret_cast<const char*>(data), size);
  auto q = sg::network::parse_dns_query(m);
  if (q) {
    std::string r = sg::network::dns_error_reply(m, 5);
    if (r.size() < sg::network::kDnsHeader || r.size() > m.size() || r.compare(0, 2, m.substr(0, 2)) != 0) std::abort();
    auto back = sg::network::parse_dns_answers(r);
    if (!back || back->rcode != 5 || !back->a.empty()) std::abort();
  }
  (void)sg::network::parse_dns_answers(m);
  return 0;
}
