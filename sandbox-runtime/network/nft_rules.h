// The nftables rules of sandboxes' networks (docs/networking.md): one
// table per sandgate server, one chain per sandbox holding its policy, as
// nft script text (pure: built and checked without the kernel) and the
// one object that hands scripts to the kernel (libnftables, one atomic
// transaction per script).
//
// The table, for a server whose sandbox links are named PFX<n>:
//   forward: a packet from a sandbox's link jumps to that sandbox's chain
//            (a verdict map by link name); a link with no chain drops;
//            toward sandboxes only replies (ct established) pass, so no
//            sandbox and no outside host opens a connection into one.
//   input:   from sandbox links only the DNS forwarder's port; the host's
//            own services (the gateway's API included) are closed.
//   prerouting (nat): DNS sent to the sandbox's gateway address is
//            redirected to the forwarder.
//   postrouting (nat): the sandbox range masqueraded out of the host.
//   sb_<n>:  source address must be the sandbox's (no spoofing); then the
//            E2B policy in egress_policy.h's order: the host's internal
//            networks and other sandboxes refused (unless the operator
//            opens internal networks), allowOut addresses and the
//            addresses the DNS forwarder answered for allowOut names
//            accepted, denyOut refused, everything refused without
//            internet access, else accepted. Every packet is judged, not
//            only a connection's first, so a narrowed policy cuts
//            connections already open (TCP with a reset).
// IPv4 only: sandboxes get no IPv6 address, and IPv6 from their links is
// dropped.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "base/thread_annotations.h"
#include "sandbox-runtime/network/egress_policy.h"

struct nft_ctx;

namespace sg::network {

struct Ipv4Net {
  uint32_t addr = 0;  // host byte order
  int prefix = 32;
};
std::string ipv4_text(uint32_t addr);  // host byte order
std::string ipv4_net_text(const Ipv4Net& n);
// "a.b.c.d/n" with the host bits zero; nullopt otherwise.
std::optional<Ipv4Net> parse_ipv4_net(const std::string& text);

struct NftConfig {
  std::string table;      // unique per server on a host
  std::string if_prefix;  // the sandbox links' name prefix, unique per server
  Ipv4Net range;          // the sandboxes' addresses
  bool allow_internal = false;
  uint16_t dns_port = 0;  // the DNS forwarder's port on the host; 0: none
  // Per sandbox and direction: packets over this rate are dropped (a
  // policer: TCP backs off to it); 0: no limit.
  uint64_t rate_bytes_per_s = 0;
  // Per sandbox: new connections (TCP, UDP flows, ICMP) beyond this many
  // open ones are refused; 0: no limit.
  uint32_t max_connections = 0;
};

// The whole table, replacing whatever the server left before.
std::string nft_table_script(const NftConfig& c);
// The table deleted (the server stops and leaves no sandboxes behind).
std::string nft_delete_table_script(const NftConfig& c);

struct NftSandbox {
  uint32_t index = 0;
  std::string link;      // the host end of its veth
  uint32_t address = 0;  // the sandbox's, host byte order
};
// A sandbox's sets and chain, written whole (create) or rewritten in one
// transaction (a policy update; `exists`: flush before rewriting).
std::string nft_sandbox_script(const NftConfig& c, const NftSandbox& s, const EgressPolicy& p, bool exists);
std::string nft_remove_sandbox_script(const NftConfig& c, const NftSandbox& s);
// A sandbox's named counters: "<chain>_tx" (bytes and packets it sent
// out), "_rx" (received), "_refused" (packets its policy or limits
// refused), "_limited" (packets over its rate, dropped).
std::string nft_counter_prefix(const NftSandbox& s);

// Addresses the DNS forwarder answered for an allowOut name, allowed for
// ttl_s seconds.
std::string nft_allow_names_script(const NftConfig& c, const NftSandbox& s, const std::vector<uint32_t>& addrs,
                                   uint32_t ttl_s);

// libnftables: scripts run as one transaction each. Thread-safe.
class Nftables {
 public:
  static Result<std::unique_ptr<Nftables>> open();
  ~Nftables();
  Nftables(const Nftables&) = delete;
  Nftables& operator=(const Nftables&) = delete;
  // kInternal with nft's own error text when the kernel refuses.
  Status run(const std::string& script);
  // A command's output as JSON (`list counters table inet T`).
  Result<std::string> run_json(const std::string& command);

 private:
  explicit Nftables(nft_ctx* ctx) : ctx_(ctx) {}
  Mutex mu_;
  nft_ctx* ctx_ GUARDED_BY(mu_);
};

}  // namespace sg::network
