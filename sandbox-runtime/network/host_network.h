// HostNetwork: every sandbox's own network on this host
// (docs/networking.md). A sandbox gets a veth pair, its end "eth0" in the
// sandbox's network namespace (a microVM: a TAP device, the host end of
// its virtio-net), a /30 of the server's range (the host end
// .1 is its gateway and DNS server, the sandbox .2), a default route, and
// its policy as an nftables chain (nft_rules.h) kept in step with the
// EgressPolicies table: a create's policy is there before the sandbox's
// first process runs, and a PUT /sandboxes/{id}/network rewrites it live.
//
// Names are the server's own (an nft table and a link prefix made from
// NetworkConfig::instance), so several servers share a host as long as
// their ranges differ. start() replaces what a previous run of the same
// instance left (table, links); stop or destruction removes it all, but
// with NetworkConfig::keep_links (sandboxes that outlive the server) the
// links, table and range of sandboxes still there stay: the kernel goes on
// enforcing their policies while no server runs, and the next start takes
// each one back (adopt) and removes the rest (sweep).
//
// Thread safety: internally synchronised; reserve/attach/release may be
// called from any thread, for different sandboxes at once.
#pragma once

#include <array>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/fd.h"
#include "base/status.h"
#include "base/thread_annotations.h"
#include "sandbox-runtime/network/dns_forwarder.h"
#include "sandbox-runtime/network/egress_policies.h"
#include "sandbox-runtime/network/nft_rules.h"

namespace sg::network {

struct NetworkConfig {
  // The sandboxes' addresses: a /30 each (a /16 holds 16384 sandboxes).
  // nullopt: a /20 (1024 sandboxes) of 10.192.0.0/10 picked by instance,
  // the next one along where a route on this host overlaps it.
  std::optional<Ipv4Net> range;
  // Four hex digits naming this server's table and links on the host.
  std::string instance = "0000";
  // The host's internal networks reachable from sandboxes (--egress-allow-private).
  bool allow_internal = false;
  // Each sandbox's limits (nft_rules.h): bytes per second each way, open
  // connections; 0: none.
  uint64_t rate_bytes_per_s = 0;
  uint32_t max_connections = 0;
  // DNS for sandboxes: a forwarder (dns_forwarder.h) to this upstream
  // resolver (IPv4, host byte order; 0: /etc/resolv.conf's), which also
  // opens allowOut names' addresses. Off: sandboxes have no DNS server.
  bool dns = true;
  uint32_t dns_upstream = 0;
  // Sandboxes' policies, by id; a sandbox with none gets no internet.
  EgressPolicies* policies = nullptr;
  // Sandboxes outlive the server (--keep-sandboxes on): see above.
  bool keep_links = false;
  // The sandboxes are microVMs (attach_tap): start() also needs /dev/net/tun.
  bool tap = false;
};

// The host end's Ethernet address on every TAP (locally administered).
inline constexpr std::array<uint8_t, 6> kTapHostMac = {0x02, 0x53, 0x47, 0xff, 0xff, 0xfe};

struct SandboxLink {
  std::string link;       // the host end's name
  uint32_t address = 0;   // the sandbox's (host byte order)
  uint32_t gateway = 0;   // the host end's: its default route and DNS server
};

class HostNetwork : public EgressPolicies::Listener {
 public:
  // Enables IPv4 forwarding, installs the table, removes links a previous
  // run left (with keep_links: keeps them for adopt and sweep).
  // kUnavailable where this host cannot (no CAP_NET_ADMIN, no nf_tables,
  // no free range): the caller falls back to the egress proxy.
  static Result<std::unique_ptr<HostNetwork>> start(const NetworkConfig& cfg);
  ~HostNetwork() override;
  HostNetwork(const HostNetwork&) = delete;
  HostNetwork& operator=(const HostNetwork&) = delete;

  // Addresses for sandbox id (before its namespace exists: they go into
  // its agent's environment). kQuota when the range is full.
  Result<SandboxLink> reserve(const std::string& id);
  // The reserved link made, into the namespace netns_fd names, and the
  // sandbox's policy installed. On error the caller still calls release.
  Status attach(const std::string& id, int netns_fd);
  // The same for a microVM: the reserved link made as a TAP device
  // (the host end of its virtio-net, docs/networking.md), addressed,
  // up, and the sandbox's policy installed; returns the TAP's fd for its
  // VMM. The link lives while that fd is open or until release(). The
  // guest configures its own end (the agent, from "configure").
  Result<UniqueFd> attach_tap(const std::string& id);
  // Everything of id's gone (link, chain, address); no-op if none.
  void release(const std::string& id);
  // A sandbox a previous run of this server made, taken back after a
  // restart (keep_links): its address read from the eth0 in the namespace
  // netns_fd names, its link (left in place) counted again and its policy
  // installed. kNotFound when it has no network of this server's (made
  // without one, or in another range). Then release() as for any other.
  Status adopt(const std::string& id, int netns_fd);
  // The same for a microVM (attach_tap): its TAP, kept open by its VMM,
  // found by the address its guest was given (host byte order).
  Status adopt_tap(const std::string& id, uint32_t address);
  // The links of a previous run that no adopt() took back, removed (their
  // sandboxes are gone): once, after the restart's adoptions.
  void sweep();

  void policy_changed(const std::string& id) override;

  const NftConfig& nft_config() const { return nft_; }
  // The DNS forwarder's counters (all zero without one).
  DnsForwarder::Counters dns_counters() const;
  // Prometheus text: each sandbox's bytes each way and refused and
  // over-rate packets (its nftables counters), the DNS forwarder's counts.
  void render_metrics(std::string& out) const;
  struct Traffic {
    uint64_t tx_bytes = 0, rx_bytes = 0, refused_packets = 0, limited_packets = 0;
  };
  // A sandbox's counters; kNotFound when it has no network here.
  Result<Traffic> traffic(const std::string& id) const;
  // "10.201.0.0/16 (links sg3f2an*, table inet sandgate_3f2a)": for logs.
  std::string describe() const;
  size_t sandboxes() const;

 private:
  struct Entry {
    NftSandbox nft;
    bool attached = false;  // its link exists
    bool chain = false;     // its rules exist
  };
  HostNetwork(const NetworkConfig& cfg, NftConfig nft, std::unique_ptr<Nftables> nft_run);
  // The DNS forwarder's hooks (its thread).
  std::optional<EgressPolicy> policy_at(uint32_t address) const;
  void allow_names(uint32_t address, const std::vector<uint32_t>& addrs, uint32_t ttl_s);
  Ipv4Net range() const { return nft_.range; }
  EgressPolicy policy_of(const std::string& id) const;
  // A previous run's link of the /30 whose sandbox address is address,
  // taken back for id with its rules (adopt, adopt_tap).
  Status take_back(const std::string& id, uint32_t address);
  // id's addresses and names from reserve(); kInternal if it has none.
  Result<NftSandbox> reserved(const std::string& id) const;
  // id's link exists from now on: release() removes it.
  void mark_attached(const std::string& id);
  // id's chain with its policy, its link in the verdict maps (attach, adopt).
  Status install_rules(const std::string& id, const NftSandbox& s);

  const NetworkConfig cfg_;
  const NftConfig nft_;
  std::unique_ptr<Nftables> nftables_;
  mutable Mutex mu_;
  std::map<std::string, Entry> sandboxes_ GUARDED_BY(mu_);
  std::map<uint32_t, std::string> by_address_ GUARDED_BY(mu_);  // attached sandboxes' ids
  // Last member: it calls the hooks above until it is destroyed, first.
  std::unique_ptr<DnsForwarder> dns_;
  std::vector<bool> used_ GUARDED_BY(mu_);  // by /30 index
  size_t next_ GUARDED_BY(mu_) = 0;
  // A previous run's links not yet adopted, by /30 index (their slots
  // count as used until sweep()).
  std::map<uint32_t, std::string> stale_ GUARDED_BY(mu_);
};

}  // namespace sg::network
