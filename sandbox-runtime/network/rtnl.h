// A minimal rtnetlink client: the few link, address and route requests a
// sandbox's network needs (a veth pair with one end in the sandbox's
// network namespace, its addresses, its default route), spoken directly
// over NETLINK_ROUTE so that creating a sandbox starts no `ip` process.
//
// Each request carries NLM_F_ACK and is answered before the next is sent,
// so an error names the request that failed. Replies are read with a
// timeout and bounded (the kernel is trusted, but a wrong netns or a stuck
// socket must not hang a create).
//
// Not thread-safe: one Rtnl per thread at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "base/fd.h"
#include "base/status.h"

struct nlmsghdr;

namespace sg::network {

// A TAP device named name in the calling thread's network namespace (no
// packet-information prefix, no vnet header: one read or write is one
// Ethernet frame), alive while the returned fd is open. kUnavailable
// where there is no /dev/net/tun.
Result<UniqueFd> open_tap(const std::string& name);

class Rtnl {
 public:
  // A socket in the calling thread's network namespace.
  static Result<Rtnl> open();
  // A socket in the network namespace netns_fd names (an nsfs file, such
  // as /proc/PID/ns/net); the calling thread's own namespace is unchanged.
  static Result<Rtnl> open_in(int netns_fd);

  // A veth pair: `name` here, `peer` in the namespace peer_netns_fd names
  // (the peer is created there, so no name clash with this namespace).
  Status create_veth(const std::string& name, const std::string& peer, int peer_netns_fd);
  Status delete_link(const std::string& name);
  // kNotFound when there is no such link.
  Result<int> link_index(const std::string& name);
  Status set_up(int ifindex);
  // An IPv4 address (network byte order) with its prefix length.
  Status add_address4(int ifindex, uint32_t addr, int prefix);
  Status delete_address4(int ifindex, uint32_t addr, int prefix);
  // The link's hardware address (an Ethernet link's six bytes).
  Status set_mac(int ifindex, const uint8_t mac[6]);
  // The default route through gateway (network byte order) on ifindex;
  // with replace, whatever default route the main table had goes.
  Status add_default_route4(int ifindex, uint32_t gateway, bool replace = false);
  // The IPv4 addresses (host byte order) with their prefix lengths on
  // link ifindex.
  Result<std::vector<std::pair<uint32_t, int>>> addresses4(int ifindex);
  // Link names starting with prefix, in this namespace.
  Result<std::vector<std::string>> links_with_prefix(const std::string& prefix);
  // An IPv4 route as routes4 lists it: destination in host byte order.
  struct Route4 {
    uint32_t dst = 0;
    int prefix = 0;
    uint8_t type = 0;      // RTN_*
    uint8_t protocol = 0;  // RTPROT_*: who made it
    uint8_t table = 0;     // RT_TABLE_*
    uint32_t metric = 0;   // RTA_PRIORITY
    int oif = 0;           // the link it goes out on (0: none)
  };
  // The IPv4 routes but local and broadcast ones, every table.
  Result<std::vector<Route4>> routes4();
  // An unreachable route to dst/prefix (host byte order) in the main
  // table; protocol and metric mark whose it is (delete_route4 finds it by
  // both). kConflict when that very route is there; delete_route4 gives
  // kNotFound when it is not.
  Status add_unreachable_route4(uint32_t dst, int prefix, uint8_t protocol, uint32_t metric);
  Status delete_route4(const Route4& r);

 private:
  explicit Rtnl(UniqueFd fd) : fd_(std::move(fd)) {}
  // Sends one request (NLM_F_ACK set; its length and sequence are filled
  // in) and reads until its ack, error or dump end, handing every other
  // message of that sequence to visit.
  Status transact(std::string& req, const char* what,
                  const std::function<void(const struct nlmsghdr*)>& visit = nullptr);
  UniqueFd fd_;
  uint32_t seq_ = 0;
};

}  // namespace sg::network
