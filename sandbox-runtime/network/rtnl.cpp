// rtnetlink requests (rtnl.h). Message layout: rtnetlink(7), netlink(7);
// the veth peer attribute nesting: linux/veth.h (VETH_INFO_PEER holds an
// ifinfomsg followed by the peer's own IFLA_* attributes).
#include "sandbox-runtime/network/rtnl.h"

#include <linux/if.h>
#include <linux/if_tun.h>
#include <linux/if_addr.h>
#include <linux/if_link.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <arpa/inet.h>
#include <linux/veth.h>
#include <poll.h>
#include <fcntl.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <optional>
#include <thread>

#include "base/sys.h"

namespace sg::network {
namespace {

constexpr int kReplyTimeoutMs = 5000;
constexpr size_t kMaxReply = 64 * 1024;

// Appends raw bytes, padded to netlink's 4-byte alignment.
void put(std::string& b, const void* p, size_t n) {
  b.append(static_cast<const char*>(p), n);
  b.append(NLMSG_ALIGN(n) - n, '\0');
}

// Starts an attribute; returns its offset for end_attr (nested ones).
size_t begin_attr(std::string& b, uint16_t type) {
  size_t off = b.size();
  struct rtattr a{};
  a.rta_type = type;
  put(b, &a, sizeof a);
  return off;
}
void end_attr(std::string& b, size_t off) {
  uint16_t len = static_cast<uint16_t>(b.size() - off);
  std::memcpy(b.data() + off + offsetof(struct rtattr, rta_len), &len, sizeof len);
}
void attr(std::string& b, uint16_t type, const void* p, size_t n) {
  struct rtattr a{};
  a.rta_type = type;
  a.rta_len = static_cast<uint16_t>(RTA_LENGTH(n));
  put(b, &a, sizeof a);
  put(b, p, n);
}
void attr_str(std::string& b, uint16_t type, const std::string& s) { attr(b, type, s.c_str(), s.size() + 1); }
template <typename T>
void attr_val(std::string& b, uint16_t type, T v) {
  attr(b, type, &v, sizeof v);
}

std::string header(uint16_t type, uint16_t flags) {
  std::string b;
  struct nlmsghdr h{};
  h.nlmsg_type = type;
  h.nlmsg_flags = static_cast<uint16_t>(NLM_F_REQUEST | NLM_F_ACK | flags);
  put(b, &h, sizeof h);
  return b;
}

Status valid_ifname(const std::string& n) {
  if (n.empty() || n.size() >= IFNAMSIZ || n.find('/') != std::string::npos)
    return invalid_error("bad interface name \"" + n + "\"");
  return Status::Ok();
}

}  // namespace

Result<UniqueFd> open_tap(const std::string& name) {
  if (Status s = valid_ifname(name); !s) return s.error();
  UniqueFd tap(::open("/dev/net/tun", O_RDWR | O_CLOEXEC));
  if (!tap) return Error(errno == ENOENT ? ErrorKind::kUnavailable : ErrorKind::kInternal,
                         std::string("open /dev/net/tun: ") + std::strerror(errno));
  struct ifreq ifr {};
  std::strncpy(ifr.ifr_name, name.c_str(), IFNAMSIZ - 1);
  ifr.ifr_flags = IFF_TAP | IFF_NO_PI;
  // SAFETY: ifr is a zeroed ifreq with a NUL-terminated name, as TUNSETIFF expects.
  if (::ioctl(tap.get(), TUNSETIFF, &ifr) != 0) return sys::errno_error("TUNSETIFF", name);
  return tap;
}

Result<Rtnl> Rtnl::open() {
  UniqueFd fd(::socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_ROUTE));
  if (!fd) return sys::errno_error("socket", "NETLINK_ROUTE");
  struct sockaddr_nl sa{};
  sa.nl_family = AF_NETLINK;
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0)
    return sys::errno_error("bind", "NETLINK_ROUTE");
  return Rtnl(std::move(fd));
}

Result<Rtnl> Rtnl::open_in(int netns_fd) {
  // A socket belongs to the namespace it was made in: make it on a thread
  // of its own that enters netns_fd, so the caller's thread never moves.
  std::optional<Result<Rtnl>> out;
  std::thread t([&] {
    if (::setns(netns_fd, CLONE_NEWNET) != 0) {
      out.emplace(sys::errno_error("setns", "sandbox network namespace"));
      return;
    }
    out.emplace(open());
  });
  t.join();
  return std::move(*out);
}

Status Rtnl::transact(std::string& req, const char* what, const std::function<void(const struct nlmsghdr*)>& visit) {
  auto* h = reinterpret_cast<struct nlmsghdr*>(req.data());
  h->nlmsg_len = static_cast<uint32_t>(req.size());
  h->nlmsg_seq = ++seq_;
  struct sockaddr_nl kernel{};
  kernel.nl_family = AF_NETLINK;
  if (::sendto(fd_.get(), req.data(), req.size(), 0, reinterpret_cast<sockaddr*>(&kernel), sizeof kernel) !=
      static_cast<ssize_t>(req.size()))
    return sys::errno_error("netlink send", what);
  std::string buf(kMaxReply, '\0');
  for (;;) {
    struct pollfd p = {fd_.get(), POLLIN, 0};
    int r = ::poll(&p, 1, kReplyTimeoutMs);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return sys::errno_error("poll", "netlink");
    if (r == 0) return Error(ErrorKind::kTimeout, std::string("netlink: no answer to ") + what);
    ssize_t n = ::recv(fd_.get(), buf.data(), buf.size(), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return sys::errno_error("netlink recv", what);
    int len = static_cast<int>(n);
    for (auto* m = reinterpret_cast<struct nlmsghdr*>(buf.data()); NLMSG_OK(m, len); m = NLMSG_NEXT(m, len)) {
      if (m->nlmsg_seq != seq_) continue;  // a late answer to an earlier, timed-out request
      if (m->nlmsg_type == NLMSG_DONE) return Status::Ok();
      if (m->nlmsg_type != NLMSG_ERROR) {
        if (visit) visit(m);
        continue;
      }
      if (m->nlmsg_len < NLMSG_LENGTH(sizeof(struct nlmsgerr)))
        return internal_error(std::string("netlink: short error message for ") + what);
      // SAFETY: the length check above covers the nlmsgerr.
      const auto* e = static_cast<const struct nlmsgerr*>(NLMSG_DATA(m));
      if (e->error == 0) return Status::Ok();
      if (e->error == -ENODEV) return Error(ErrorKind::kNotFound, std::string(what) + ": no such link");
      if (e->error == -ESRCH) return Error(ErrorKind::kNotFound, std::string(what) + ": no such route");
      if (e->error == -EEXIST) return Error(ErrorKind::kConflict, std::string(what) + ": it exists");
      return sys::errno_error("netlink", what, -e->error);
    }
  }
}

Status Rtnl::create_veth(const std::string& name, const std::string& peer, int peer_netns_fd) {
  if (Status s = valid_ifname(name); !s) return s;
  if (Status s = valid_ifname(peer); !s) return s;
  std::string b = header(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL);
  struct ifinfomsg ifi{};
  ifi.ifi_family = AF_UNSPEC;
  put(b, &ifi, sizeof ifi);
  attr_str(b, IFLA_IFNAME, name);
  size_t linkinfo = begin_attr(b, IFLA_LINKINFO);
  attr_str(b, IFLA_INFO_KIND, "veth");
  size_t data = begin_attr(b, IFLA_INFO_DATA);
  size_t peer_attr = begin_attr(b, VETH_INFO_PEER);
  struct ifinfomsg pifi{};
  pifi.ifi_family = AF_UNSPEC;
  put(b, &pifi, sizeof pifi);
  attr_str(b, IFLA_IFNAME, peer);
  attr_val<uint32_t>(b, IFLA_NET_NS_FD, static_cast<uint32_t>(peer_netns_fd));
  end_attr(b, peer_attr);
  end_attr(b, data);
  end_attr(b, linkinfo);
  std::string what = "create veth " + name;
  return transact(b, what.c_str());
}

Status Rtnl::delete_link(const std::string& name) {
  if (Status s = valid_ifname(name); !s) return s;
  std::string b = header(RTM_DELLINK, 0);
  struct ifinfomsg ifi{};
  ifi.ifi_family = AF_UNSPEC;
  put(b, &ifi, sizeof ifi);
  attr_str(b, IFLA_IFNAME, name);
  std::string what = "delete link " + name;
  return transact(b, what.c_str());
}

Result<int> Rtnl::link_index(const std::string& name) {
  if (Status s = valid_ifname(name); !s) return s.error();
  std::string b = header(RTM_GETLINK, 0);
  struct ifinfomsg ifi{};
  ifi.ifi_family = AF_UNSPEC;
  put(b, &ifi, sizeof ifi);
  attr_str(b, IFLA_IFNAME, name);
  int index = 0;
  std::string what = "get link " + name;
  Status s = transact(b, what.c_str(), [&](const struct nlmsghdr* m) {
    // SAFETY: the length check covers the ifinfomsg.
    if (m->nlmsg_type == RTM_NEWLINK && m->nlmsg_len >= NLMSG_LENGTH(sizeof(struct ifinfomsg)))
      index = static_cast<const struct ifinfomsg*>(NLMSG_DATA(m))->ifi_index;
  });
  if (!s) return s.error();
  if (index <= 0) return Error(ErrorKind::kNotFound, what + ": no such link");
  return index;
}

Result<std::vector<std::string>> Rtnl::links_with_prefix(const std::string& prefix) {
  std::string b = header(RTM_GETLINK, NLM_F_DUMP);
  struct ifinfomsg ifi{};
  ifi.ifi_family = AF_UNSPEC;
  put(b, &ifi, sizeof ifi);
  std::vector<std::string> out;
  Status s = transact(b, "list links", [&](const struct nlmsghdr* m) {
    if (m->nlmsg_type != RTM_NEWLINK || m->nlmsg_len < NLMSG_LENGTH(sizeof(struct ifinfomsg))) return;
    // SAFETY: attributes follow the ifinfomsg inside nlmsg_len; RTA_OK
    // bounds each one by the remaining length.
    const auto* ifi_p = static_cast<const struct ifinfomsg*>(NLMSG_DATA(m));
    int alen = static_cast<int>(m->nlmsg_len - NLMSG_LENGTH(sizeof(struct ifinfomsg)));
    for (auto* a = IFLA_RTA(ifi_p); RTA_OK(a, alen); a = RTA_NEXT(a, alen)) {
      if (a->rta_type != IFLA_IFNAME) continue;
      const char* d = static_cast<const char*>(RTA_DATA(a));
      std::string name(d, strnlen(d, RTA_PAYLOAD(a)));
      if (name.compare(0, prefix.size(), prefix) == 0) out.push_back(std::move(name));
    }
  });
  if (!s) return s.error();
  return out;
}

Result<std::vector<std::pair<uint32_t, int>>> Rtnl::addresses4(int ifindex) {
  std::string b = header(RTM_GETADDR, NLM_F_DUMP);
  struct ifaddrmsg ifa{};
  ifa.ifa_family = AF_INET;
  put(b, &ifa, sizeof ifa);
  std::vector<std::pair<uint32_t, int>> out;
  Status s = transact(b, "list addresses", [&](const struct nlmsghdr* m) {
    if (m->nlmsg_type != RTM_NEWADDR || m->nlmsg_len < NLMSG_LENGTH(sizeof(struct ifaddrmsg))) return;
    // SAFETY: as in links_with_prefix, RTA_OK bounds every attribute.
    const auto* a = static_cast<const struct ifaddrmsg*>(NLMSG_DATA(m));
    if (a->ifa_family != AF_INET || static_cast<int>(a->ifa_index) != ifindex) return;
    int alen = static_cast<int>(m->nlmsg_len - NLMSG_LENGTH(sizeof(struct ifaddrmsg)));
    for (auto* r = IFA_RTA(a); RTA_OK(r, alen); r = RTA_NEXT(r, alen)) {
      if (r->rta_type != IFA_LOCAL || RTA_PAYLOAD(r) != 4) continue;
      uint32_t addr = 0;
      std::memcpy(&addr, RTA_DATA(r), 4);
      out.emplace_back(ntohl(addr), a->ifa_prefixlen);
    }
  });
  if (!s) return s.error();
  return out;
}

Result<std::vector<Rtnl::Route4>> Rtnl::routes4() {
  std::string b = header(RTM_GETROUTE, NLM_F_DUMP);
  struct rtmsg rt{};
  rt.rtm_family = AF_INET;
  put(b, &rt, sizeof rt);
  std::vector<Route4> out;
  Status s = transact(b, "list routes", [&](const struct nlmsghdr* m) {
    if (m->nlmsg_type != RTM_NEWROUTE || m->nlmsg_len < NLMSG_LENGTH(sizeof(struct rtmsg))) return;
    // SAFETY: as in links_with_prefix, RTA_OK bounds every attribute.
    const auto* r = static_cast<const struct rtmsg*>(NLMSG_DATA(m));
    if (r->rtm_family != AF_INET || r->rtm_type == RTN_LOCAL || r->rtm_type == RTN_BROADCAST) return;
    Route4 route;
    uint32_t dst = 0;
    route.table = r->rtm_table;
    int alen = static_cast<int>(m->nlmsg_len - NLMSG_LENGTH(sizeof(struct rtmsg)));
    for (auto* a = RTM_RTA(r); RTA_OK(a, alen); a = RTA_NEXT(a, alen)) {
      if (a->rta_type == RTA_DST && RTA_PAYLOAD(a) == 4) std::memcpy(&dst, RTA_DATA(a), 4);
      if (a->rta_type == RTA_PRIORITY && RTA_PAYLOAD(a) == 4) std::memcpy(&route.metric, RTA_DATA(a), 4);
      if (a->rta_type == RTA_OIF && RTA_PAYLOAD(a) == 4) std::memcpy(&route.oif, RTA_DATA(a), 4);
      if (a->rta_type == RTA_TABLE && RTA_PAYLOAD(a) == 4) {
        uint32_t t = 0;
        std::memcpy(&t, RTA_DATA(a), 4);
        route.table = t > 255 ? 0 : static_cast<uint8_t>(t);
      }
    }
    route.dst = ntohl(dst);
    route.prefix = r->rtm_dst_len;
    route.type = r->rtm_type;
    route.protocol = r->rtm_protocol;
    out.push_back(route);
  });
  if (!s) return s.error();
  return out;
}

namespace {

// A route request for r (its destination, type, table, protocol and
// metric): what add_unreachable_route4 and delete_route4 send.
std::string route_request(uint16_t type, uint16_t flags, const Rtnl::Route4& r) {
  std::string b = header(type, flags);
  struct rtmsg rt{};
  rt.rtm_family = AF_INET;
  rt.rtm_dst_len = static_cast<unsigned char>(r.prefix);
  rt.rtm_table = r.table;
  rt.rtm_protocol = r.protocol;
  rt.rtm_scope = RT_SCOPE_UNIVERSE;
  rt.rtm_type = r.type;
  put(b, &rt, sizeof rt);
  attr_val<uint32_t>(b, RTA_DST, htonl(r.dst));
  attr_val<uint32_t>(b, RTA_PRIORITY, r.metric);
  return b;
}

}  // namespace

Status Rtnl::add_unreachable_route4(uint32_t dst, int prefix, uint8_t protocol, uint32_t metric) {
  if (prefix < 0 || prefix > 32) return invalid_error("route prefix /" + std::to_string(prefix));
  Route4 r{dst, prefix, RTN_UNREACHABLE, protocol, RT_TABLE_MAIN, metric};
  std::string b = route_request(RTM_NEWROUTE, NLM_F_CREATE | NLM_F_EXCL, r);
  return transact(b, "add unreachable route");
}

Status Rtnl::delete_route4(const Route4& r) {
  if (r.prefix < 0 || r.prefix > 32) return invalid_error("route prefix /" + std::to_string(r.prefix));
  std::string b = route_request(RTM_DELROUTE, 0, r);
  return transact(b, "delete route");
}

Status Rtnl::set_up(int ifindex) {
  std::string b = header(RTM_NEWLINK, 0);
  struct ifinfomsg ifi{};
  ifi.ifi_family = AF_UNSPEC;
  ifi.ifi_index = ifindex;
  ifi.ifi_flags = IFF_UP;
  ifi.ifi_change = IFF_UP;
  put(b, &ifi, sizeof ifi);
  return transact(b, "set link up");
}

namespace {
std::string address_request(uint16_t type, uint16_t flags, int ifindex, uint32_t addr, int prefix) {
  std::string b = header(type, flags);
  struct ifaddrmsg ifa{};
  ifa.ifa_family = AF_INET;
  ifa.ifa_prefixlen = static_cast<unsigned char>(prefix);
  ifa.ifa_index = static_cast<unsigned>(ifindex);
  put(b, &ifa, sizeof ifa);
  attr_val<uint32_t>(b, IFA_LOCAL, addr);
  attr_val<uint32_t>(b, IFA_ADDRESS, addr);
  return b;
}
}  // namespace

Status Rtnl::add_address4(int ifindex, uint32_t addr, int prefix) {
  std::string b = address_request(RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL, ifindex, addr, prefix);
  return transact(b, "add address");
}

Status Rtnl::delete_address4(int ifindex, uint32_t addr, int prefix) {
  std::string b = address_request(RTM_DELADDR, 0, ifindex, addr, prefix);
  return transact(b, "delete address");
}

Status Rtnl::set_mac(int ifindex, const uint8_t mac[6]) {
  std::string b = header(RTM_NEWLINK, 0);
  struct ifinfomsg ifi{};
  ifi.ifi_family = AF_UNSPEC;
  ifi.ifi_index = ifindex;
  put(b, &ifi, sizeof ifi);
  attr(b, IFLA_ADDRESS, mac, 6);
  return transact(b, "set link address");
}

Status Rtnl::add_default_route4(int ifindex, uint32_t gateway, bool replace) {
  std::string b = header(RTM_NEWROUTE, NLM_F_CREATE | (replace ? NLM_F_REPLACE : NLM_F_EXCL));
  struct rtmsg rt{};
  rt.rtm_family = AF_INET;
  rt.rtm_table = RT_TABLE_MAIN;
  rt.rtm_protocol = RTPROT_STATIC;
  rt.rtm_scope = RT_SCOPE_UNIVERSE;
  rt.rtm_type = RTN_UNICAST;
  put(b, &rt, sizeof rt);
  attr_val<uint32_t>(b, RTA_GATEWAY, gateway);
  attr_val<uint32_t>(b, RTA_OIF, static_cast<uint32_t>(ifindex));
  return transact(b, "add default route");
}

}  // namespace sg::network
