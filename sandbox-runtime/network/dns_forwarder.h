// DnsForwarder: the DNS server sandboxes with a network of their own use
// (docs/networking.md). Each sandbox's resolv.conf names its gateway; the
// host's nftables redirect port 53 there to this forwarder's port, so the
// source address of every query names the sandbox that sent it.
//
// A query is answered by the host's upstream resolver when the sandbox's
// policy lets the name out (internet access, or the name in allowOut),
// else REFUSED. When an allowed name is one of allowOut's, the IPv4
// addresses of the answer are handed to on_allowed (the host network adds
// them to the sandbox's allowed set for the answer's TTL): that is how
// names in allowOut hold in the kernel, for TCP, UDP and ICMP alike.
//
// UDP and TCP on the same port (RFC 7766): a resolver that gets a
// truncated UDP answer (the upstream's TC bit, relayed as is) asks again
// over TCP, and the forwarder asks the upstream over TCP in turn. Queries
// are hostile: bounded (4096 bytes), one question, every label and
// pointer checked (dns_message.h). At most kMaxPending UDP queries wait
// on the upstream at once (64 per sandbox), and at most kMaxTcp TCP
// connections are open (8 per sandbox), each answering one query at a
// time, closed after 10 s without one; each query waits at most 5 s for
// the upstream, then SERVFAIL. A TCP answer may be up to 65535 bytes.
//
// Thread model: one thread of its own polls the listening socket and the
// upstream sockets; the callbacks run on it and must not block for long.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "base/fd.h"
#include "base/status.h"
#include "sandbox-runtime/network/egress_policy.h"

namespace sg::network {

struct DnsForwarderConfig {
  // The upstream resolver (IPv4, port 53); 0: the first IPv4 nameserver
  // of /etc/resolv.conf.
  uint32_t upstream = 0;  // host byte order
  // The policy of the sandbox at a source address (host byte order);
  // nullopt: no sandbox there (the query is dropped).
  std::function<std::optional<EgressPolicy>(uint32_t source)> policy_of;
  // An allowOut name's IPv4 answers for the sandbox at source, with the
  // answer's smallest TTL in seconds.
  std::function<void(uint32_t source, const std::vector<uint32_t>& addrs, uint32_t ttl_s)> on_allowed;
};

class DnsForwarder {
 public:
  static constexpr size_t kMaxPending = 1024;
  static constexpr size_t kMaxTcp = 256;

  // Listens on 0.0.0.0:port, UDP and TCP (0: a port free for both), and
  // starts its thread.
  static Result<std::unique_ptr<DnsForwarder>> start(DnsForwarderConfig cfg, uint16_t port = 0);
  ~DnsForwarder();
  DnsForwarder(const DnsForwarder&) = delete;
  DnsForwarder& operator=(const DnsForwarder&) = delete;

  uint16_t port() const { return port_; }
  struct Counters {
    uint64_t queries = 0, forwarded = 0, refused = 0, malformed = 0, upstream_failures = 0, dropped = 0;
  };
  Counters counters() const;

 private:
  DnsForwarder(DnsForwarderConfig cfg, UniqueFd sock, UniqueFd tcp, uint16_t port, UniqueFd wake);
  void run();

  const DnsForwarderConfig cfg_;
  UniqueFd sock_;
  UniqueFd tcp_;  // listening
  const uint16_t port_;
  UniqueFd wake_;  // an eventfd: the destructor's stop
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> queries_{0}, forwarded_{0}, refused_{0}, malformed_{0}, upstream_failures_{0}, dropped_{0};
  std::thread thread_;
};

// The first IPv4 "nameserver" of a resolv.conf text (host byte order).
std::optional<uint32_t> resolv_conf_nameserver(const std::string& text);

}  // namespace sg::network
