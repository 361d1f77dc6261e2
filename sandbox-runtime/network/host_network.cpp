// HostNetwork: see host_network.h.
#include "sandbox-runtime/network/host_network.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <linux/rtnetlink.h>
#include <sched.h>
#include <sys/mount.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <atomic>
#include <map>
#include <optional>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "base/log.h"
#include "base/sys.h"
#include "sandbox-runtime/network/rtnl.h"

namespace sg::network {
namespace {

// Linux's interface names are at most 15 bytes: "sg" + 4 hex + "n" + index.
std::string link_prefix(const std::string& instance) { return "sg" + instance + "n"; }

// The unreachable route that holds a server's range: a protocol number
// of its own (83, 'S': unassigned in iproute2's rt_protos) and a metric
// that carries the instance, so `ip route` shows whose it is and a
// restart of the same server finds the one its crash left.
constexpr uint8_t kRangeProtocol = 83;
uint32_t range_metric(const std::string& instance) {
  return 0x53470000u | static_cast<uint32_t>(std::stoul(instance, nullptr, 16));
}
bool ours(const Rtnl::Route4& r, uint32_t metric) {
  return r.protocol == kRangeProtocol && r.metric == metric && r.type == RTN_UNREACHABLE;
}

// The /30 index a sandbox link's name carries (prefix + decimal index).
std::optional<uint32_t> link_index_of(const std::string& link, const std::string& prefix) {
  if (link.size() <= prefix.size() || link.size() > prefix.size() + 6 || link.compare(0, prefix.size(), prefix) != 0)
    return std::nullopt;
  uint32_t v = 0;
  for (size_t i = prefix.size(); i < link.size(); ++i) {
    if (link[i] < '0' || link[i] > '9') return std::nullopt;
    v = v * 10 + static_cast<uint32_t>(link[i] - '0');
  }
  return v;
}

Status valid_instance(const std::string& s) {
  if (s.size() != 4 || s.find_first_not_of("0123456789abcdef") != std::string::npos)
    return invalid_error("network instance \"" + s + "\": four lower-case hex digits");
  return Status::Ok();
}

// net.ipv4.ping_group_range of the namespace netns_fd names: every group.
// /proc/sys/net is the opening thread's namespace's, hence a thread there.
// A container's /proc/sys is read-only (the engine's bind mount): the
// thread then mounts a procfs of its own, in a mount namespace of its own
// that ends with it, and writes there.
Status set_ping_group_range(int netns_fd) {
  constexpr const char* kPath = "/proc/sys/net/ipv4/ping_group_range";
  auto write = [&]() -> int {
    UniqueFd fd(::open(kPath, O_WRONLY | O_CLOEXEC));
    if (!fd) return errno;
    static constexpr char kAll[] = "0 2147483647";
    return ::write(fd.get(), kAll, sizeof kAll - 1) == static_cast<ssize_t>(sizeof kAll - 1) ? 0 : errno;
  };
  Status out = Status::Ok();
  std::thread t([&] {
    if (::setns(netns_fd, CLONE_NEWNET) != 0) {
      out = sys::errno_error("setns", "sandbox network namespace");
      return;
    }
    int e = write();
    if (e == EROFS) {
      if (::unshare(CLONE_NEWNS) != 0 || ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
          ::mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr) != 0) {
        out = sys::errno_error("a procfs of its own for", kPath);
        return;
      }
      e = write();
    }
    if (e != 0) out = sys::errno_error("write", kPath, e);
  });
  t.join();
  return out;
}

}  // namespace

Result<std::unique_ptr<HostNetwork>> HostNetwork::start(const NetworkConfig& cfg) {
  if (Status s = valid_instance(cfg.instance); !s) return s.error();
  if (cfg.range && (cfg.range->prefix > 29 || cfg.range->prefix < 8))
    return invalid_error("sandbox network range " + ipv4_net_text(*cfg.range) + ": a prefix from /8 to /29");
  NftConfig nft;
  nft.table = "sandgate_" + cfg.instance;
  nft.if_prefix = link_prefix(cfg.instance);
  nft.allow_internal = cfg.allow_internal;
  nft.rate_bytes_per_s = cfg.rate_bytes_per_s;
  nft.max_connections = cfg.max_connections;

  Result<Rtnl> rtnl = Rtnl::open();
  if (!rtnl) return Error(ErrorKind::kUnavailable, "netlink: " + rtnl.error().message());
  if (cfg.tap) {
    // microVMs' links are TAP devices: made through /dev/net/tun.
    UniqueFd tun(::open("/dev/net/tun", O_RDWR | O_CLOEXEC));
    if (!tun) return Error(ErrorKind::kUnavailable, std::string("/dev/net/tun: ") + std::strerror(errno));
  }
  // A previous run's links: a crash leaves them, and so does a stop whose
  // sandboxes outlive it (keep_links). Without keep_links their sandboxes
  // are gone; with it, those adopt() takes back keep theirs, sweep()
  // removes the rest.
  Result<std::vector<std::string>> stale = rtnl->links_with_prefix(nft.if_prefix);
  if (!stale) return Error(ErrorKind::kUnavailable, stale.error().message());
  std::map<uint32_t, std::string> kept;  // by /30 index
  std::set<int> kept_ifindex;
  for (const std::string& l : *stale) {
    if (cfg.keep_links) {
      std::optional<uint32_t> index = link_index_of(l, nft.if_prefix);
      Result<int> ifindex = rtnl->link_index(l);
      if (index && ifindex) {
        kept.emplace(*index, l);
        kept_ifindex.insert(*ifindex);
        continue;
      }
    }
    if (Status s = rtnl->delete_link(l); !s && s.error().kind() != ErrorKind::kNotFound)
      return Error(ErrorKind::kUnavailable, "removing the stale sandbox link " + l + ": " + s.error().message());
  }
  // The range must be the sandboxes' alone: no route of this host (another
  // server's sandboxes, a LAN, a VPN) may overlap it. It is then held by an
  // unreachable route (reserve_range), so the next server to start sees it
  // taken even while it has no sandbox, and an address of it that no
  // sandbox has goes nowhere (not out the default route).
  const uint32_t metric = range_metric(cfg.instance);
  Result<std::vector<Rtnl::Route4>> routes = rtnl->routes4();
  if (!routes) return Error(ErrorKind::kUnavailable, routes.error().message());
  // This server's own reservation, left by a crash or a stop that kept
  // its sandboxes: taken back; so are the routes of the links it kept.
  std::erase_if(*routes, [&](const Rtnl::Route4& r) {
    if (kept_ifindex.count(r.oif)) return true;
    if (!ours(r, metric)) return false;
    (void)rtnl->delete_route4(r);
    return true;
  });
  auto overlapping = [](const std::vector<Rtnl::Route4>& rs, const Ipv4Net& n) -> std::optional<Ipv4Net> {
    for (const Rtnl::Route4& r : rs) {
      if (r.prefix == 0) continue;  // a default route
      int p = std::min(r.prefix, n.prefix);
      uint32_t mask = ~uint32_t{0} << (32 - p);
      if ((r.dst & mask) == (n.addr & mask)) return Ipv4Net{r.dst, r.prefix};
    }
    return std::nullopt;
  };
  // Holds n with this server's route; false when another server took a
  // range overlapping it at the same moment and this one gives way (the
  // higher metric yields, so one of two racing servers keeps it).
  auto reserve_range = [&](const Ipv4Net& n) -> Result<bool> {
    if (Status s = rtnl->add_unreachable_route4(n.addr, n.prefix, kRangeProtocol, metric); !s)
      return Error(ErrorKind::kUnavailable, "reserving " + ipv4_net_text(n) + ": " + s.error().message());
    Result<std::vector<Rtnl::Route4>> now = rtnl->routes4();
    if (!now) return Error(ErrorKind::kUnavailable, now.error().message());
    std::erase_if(*now, [&](const Rtnl::Route4& r) {
      return ours(r, metric) || kept_ifindex.count(r.oif) || (r.protocol == kRangeProtocol && r.metric > metric);
    });
    if (!overlapping(*now, n)) return true;
    Rtnl::Route4 mine{n.addr, n.prefix, RTN_UNREACHABLE, kRangeProtocol, RT_TABLE_MAIN, metric};
    (void)rtnl->delete_route4(mine);
    return false;
  };
  if (cfg.range) {
    if (std::optional<Ipv4Net> r = overlapping(*routes, *cfg.range))
      return invalid_error("sandbox network range " + ipv4_net_text(*cfg.range) + " overlaps this host's route to " +
                           ipv4_net_text(*r) + "; pass a --network-range no route uses");
    Result<bool> held = reserve_range(*cfg.range);
    if (!held) return held.error();
    if (!*held)
      return invalid_error("sandbox network range " + ipv4_net_text(*cfg.range) +
                           " was taken by another server as this one started; pass a --network-range no route uses");
    nft.range = *cfg.range;
  } else {
    constexpr uint32_t kBase = (10u << 24) | (192u << 16);  // 10.192.0.0/10: 1024 blocks of /20
    const uint32_t first = static_cast<uint32_t>(std::stoul(cfg.instance, nullptr, 16)) % 1024;
    bool found = false;
    for (uint32_t k = 0; k < 1024 && !found; ++k) {
      Ipv4Net n{kBase + ((first + k) % 1024) * 4096, 20};
      if (overlapping(*routes, n)) continue;
      Result<bool> held = reserve_range(n);
      if (!held) return held.error();
      if (*held) {
        nft.range = n;
        found = true;
      }
    }
    if (!found) return Error(ErrorKind::kUnavailable, "no free /20 for sandboxes in 10.192.0.0/10; pass --network-range");
  }
  // From here on a failed start gives the range back.
  struct RangeGuard {
    Rtnl& rtnl;
    Rtnl::Route4 route;
    bool armed = true;
    ~RangeGuard() {
      if (armed) (void)rtnl.delete_route4(route);
    }
  } range_guard{*rtnl, Rtnl::Route4{nft.range.addr, nft.range.prefix, RTN_UNREACHABLE, kRangeProtocol, RT_TABLE_MAIN, metric}};
  // The forwarder first (its port goes into the table), bound to nothing
  // until the object exists: its hooks go through a pointer set below.
  auto self = std::make_shared<std::atomic<HostNetwork*>>(nullptr);
  std::unique_ptr<DnsForwarder> dns;
  if (cfg.dns) {
    DnsForwarderConfig dc;
    dc.upstream = cfg.dns_upstream;
    dc.policy_of = [self](uint32_t a) -> std::optional<EgressPolicy> {
      HostNetwork* h = self->load();
      return h ? h->policy_at(a) : std::nullopt;
    };
    dc.on_allowed = [self](uint32_t a, const std::vector<uint32_t>& addrs, uint32_t ttl) {
      if (HostNetwork* h = self->load()) h->allow_names(a, addrs, ttl);
    };
    Result<std::unique_ptr<DnsForwarder>> d = DnsForwarder::start(std::move(dc));
    if (!d) return Error(ErrorKind::kUnavailable, d.error().message());
    dns = std::move(*d);
    nft.dns_port = dns->port();
  }
  Result<std::unique_ptr<Nftables>> nftables = Nftables::open();
  if (!nftables) return Error(ErrorKind::kUnavailable, nftables.error().message());
  if (Status s = (*nftables)->run(nft_table_script(nft)); !s)
    return Error(ErrorKind::kUnavailable, s.error().message());
  // Routing between the sandboxes' links and the uplink. Host-wide, as
  // for any router or container engine; left on at exit (other software
  // on the host may rely on it by then).
  // Only written when off: a container engine mounts /proc/sys read-only
  // and sets it itself (compose.yaml's sysctls).
  Result<std::string> forwarding = sys::read_file("/proc/sys/net/ipv4/ip_forward", 16);
  if (forwarding && forwarding->starts_with("1")) {
  } else if (Status s = sys::write_file("/proc/sys/net/ipv4/ip_forward", "1"); !s) {
    (void)(*nftables)->run(nft_delete_table_script(nft));
    return Error(ErrorKind::kUnavailable, "enabling IPv4 forwarding: " + s.error().message());
  }
  range_guard.armed = false;
  auto hn = std::unique_ptr<HostNetwork>(new HostNetwork(cfg, std::move(nft), std::move(*nftables)));
  {
    MutexLock l(hn->mu_);
    for (auto& [index, link] : kept) {
      if (index >= hn->used_.size()) {
        (void)rtnl->delete_link(link);  // of another range: its sandbox cannot be adopted
        continue;
      }
      hn->used_[index] = true;
      hn->stale_.emplace(index, link);
    }
  }
  hn->dns_ = std::move(dns);
  self->store(hn.get());
  if (cfg.policies) cfg.policies->listen(hn.get());
  return hn;
}

HostNetwork::HostNetwork(const NetworkConfig& cfg, NftConfig nft, std::unique_ptr<Nftables> nft_run)
    : cfg_(cfg), nft_(std::move(nft)), nftables_(std::move(nft_run)) {
  used_.assign(size_t{1} << (32 - nft_.range.prefix - 2), false);
}

std::string HostNetwork::describe() const {
  return ipv4_net_text(nft_.range) + " (links " + nft_.if_prefix + "*, nftables table inet " + nft_.table + ")";
}

HostNetwork::~HostNetwork() {
  dns_.reset();  // its thread calls in here
  if (cfg_.policies) cfg_.policies->unlisten(this);
  std::vector<std::string> links;
  {
    MutexLock l(mu_);
    if (cfg_.keep_links && !(sandboxes_.empty() && stale_.empty())) {
      // Sandboxes outlive this server: their links, their rules (the
      // kernel enforces them meanwhile) and the range stay for the next.
      LOG_INFO("network: " << sandboxes_.size() + stale_.size() << " sandboxes keep their links, table inet "
                           << nft_.table << " and " << ipv4_net_text(nft_.range) << " for the next start");
      return;
    }
    for (auto& [id, e] : sandboxes_) links.push_back(e.nft.link);
    for (auto& [index, link] : stale_) links.push_back(link);
    sandboxes_.clear();
    stale_.clear();
  }
  if (Result<Rtnl> rtnl = Rtnl::open()) {
    for (const std::string& l : links) (void)rtnl->delete_link(l);
    Rtnl::Route4 range{nft_.range.addr, nft_.range.prefix, RTN_UNREACHABLE, kRangeProtocol, RT_TABLE_MAIN,
                       range_metric(cfg_.instance)};
    if (Status s = rtnl->delete_route4(range); !s)
      LOG_WARN("network: giving back the range " << ipv4_net_text(nft_.range) << ": " << s.error().message());
  }
  if (Status s = nftables_->run(nft_delete_table_script(nft_)); !s)
    LOG_WARN("network: removing table " << nft_.table << ": " << s.error().message());
}

DnsForwarder::Counters HostNetwork::dns_counters() const { return dns_ ? dns_->counters() : DnsForwarder::Counters{}; }

std::optional<EgressPolicy> HostNetwork::policy_at(uint32_t address) const {
  std::string id;
  {
    MutexLock l(mu_);
    auto it = by_address_.find(address);
    if (it == by_address_.end()) return std::nullopt;
    id = it->second;
  }
  return policy_of(id);
}

void HostNetwork::allow_names(uint32_t address, const std::vector<uint32_t>& addrs, uint32_t ttl_s) {
  MutexLock l(mu_);
  auto it = by_address_.find(address);
  if (it == by_address_.end()) return;
  auto e = sandboxes_.find(it->second);
  if (e == sandboxes_.end() || !e->second.chain) return;
  if (Status s = nftables_->run(nft_allow_names_script(nft_, e->second.nft, addrs, ttl_s)); !s)
    LOG_WARN("network: sandbox " << it->second << "'s allowOut names: " << s.error().message());
}

namespace {

// `list counters` as JSON: counter name -> (packets, bytes).
std::map<std::string, std::pair<uint64_t, uint64_t>> parse_counters(const std::string& text) {
  std::map<std::string, std::pair<uint64_t, uint64_t>> out;
  nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (!j.is_object() || !j.contains("nftables") || !j["nftables"].is_array()) return out;
  for (const nlohmann::json& e : j["nftables"]) {
    if (!e.is_object() || !e.contains("counter")) continue;
    const nlohmann::json& c = e["counter"];
    if (!c.is_object() || !c.contains("name") || !c["name"].is_string()) continue;
    out[c["name"].get<std::string>()] = {c.value("packets", uint64_t{0}), c.value("bytes", uint64_t{0})};
  }
  return out;
}

}  // namespace

Result<HostNetwork::Traffic> HostNetwork::traffic(const std::string& id) const {
  std::string prefix;
  {
    MutexLock l(mu_);
    auto it = sandboxes_.find(id);
    if (it == sandboxes_.end() || !it->second.chain) return Error(ErrorKind::kNotFound, "sandbox " + id + " has no network here");
    prefix = nft_counter_prefix(it->second.nft);
  }
  Result<std::string> text = nftables_->run_json("list counters table inet " + nft_.table);
  if (!text) return text.error();
  auto c = parse_counters(*text);
  Traffic t;
  t.tx_bytes = c[prefix + "_tx"].second;
  t.rx_bytes = c[prefix + "_rx"].second;
  t.refused_packets = c[prefix + "_refused"].first;
  t.limited_packets = c[prefix + "_limited"].first;
  return t;
}

void HostNetwork::render_metrics(std::string& out) const {
  std::vector<std::pair<std::string, std::string>> ids;  // (counter prefix, sandbox id)
  {
    MutexLock l(mu_);
    for (const auto& [id, e] : sandboxes_)
      if (e.chain) ids.emplace_back(nft_counter_prefix(e.nft), id);
  }
  std::map<std::string, std::pair<uint64_t, uint64_t>> c;
  if (!ids.empty()) {
    Result<std::string> text = nftables_->run_json("list counters table inet " + nft_.table);
    if (text) c = parse_counters(*text);
  }
  out += "# HELP sandgate_sandbox_network_bytes_total Bytes a sandbox sent (out) and received (in) on its own network.\n"
         "# TYPE sandgate_sandbox_network_bytes_total counter\n";
  for (const auto& [p, id] : ids) {
    out += "sandgate_sandbox_network_bytes_total{sandbox=\"" + id + "\",direction=\"out\"} " +
           std::to_string(c[p + "_tx"].second) + "\n";
    out += "sandgate_sandbox_network_bytes_total{sandbox=\"" + id + "\",direction=\"in\"} " +
           std::to_string(c[p + "_rx"].second) + "\n";
  }
  out += "# HELP sandgate_sandbox_network_refused_packets_total Packets a sandbox's policy or connection limit refused.\n"
         "# TYPE sandgate_sandbox_network_refused_packets_total counter\n";
  for (const auto& [p, id] : ids)
    out += "sandgate_sandbox_network_refused_packets_total{sandbox=\"" + id + "\"} " + std::to_string(c[p + "_refused"].first) + "\n";
  out += "# HELP sandgate_sandbox_network_limited_packets_total Packets over a sandbox's bandwidth limit, dropped.\n"
         "# TYPE sandgate_sandbox_network_limited_packets_total counter\n";
  for (const auto& [p, id] : ids)
    out += "sandgate_sandbox_network_limited_packets_total{sandbox=\"" + id + "\"} " + std::to_string(c[p + "_limited"].first) + "\n";
  DnsForwarder::Counters d = dns_counters();
  out += "# HELP sandgate_dns_queries_total Sandboxes' DNS queries by outcome.\n"
         "# TYPE sandgate_dns_queries_total counter\n";
  for (auto [k, v] : std::initializer_list<std::pair<const char*, uint64_t>>{
           {"forwarded", d.forwarded}, {"refused", d.refused}, {"malformed", d.malformed},
           {"upstream_failed", d.upstream_failures}, {"dropped", d.dropped}})
    out += std::string("sandgate_dns_queries_total{outcome=\"") + k + "\"} " + std::to_string(v) + "\n";
}

size_t HostNetwork::sandboxes() const {
  MutexLock l(mu_);
  return sandboxes_.size();
}

EgressPolicy HostNetwork::policy_of(const std::string& id) const {
  if (cfg_.policies)
    if (std::optional<EgressPolicy> p = cfg_.policies->get(id)) return *p;
  EgressPolicy none;
  none.internet = false;
  return none;
}

Result<SandboxLink> HostNetwork::reserve(const std::string& id) {
  MutexLock l(mu_);
  if (sandboxes_.count(id)) return Error(ErrorKind::kConflict, "sandbox " + id + " has a network already");
  size_t n = used_.size();
  for (size_t k = 0; k < n; ++k) {
    size_t i = (next_ + k) % n;
    if (used_[i]) continue;
    used_[i] = true;
    next_ = i + 1;
    Entry e;
    e.nft.index = static_cast<uint32_t>(i);
    e.nft.link = nft_.if_prefix + std::to_string(i);
    uint32_t base = nft_.range.addr + static_cast<uint32_t>(i) * 4;
    e.nft.address = base + 2;
    SandboxLink out{e.nft.link, base + 2, base + 1};
    sandboxes_.emplace(id, std::move(e));
    return out;
  }
  return Error(ErrorKind::kQuota, "no free sandbox address in " + ipv4_net_text(nft_.range) +
                                      " (one /30 per sandbox); pass a larger --network-range");
}

Result<NftSandbox> HostNetwork::reserved(const std::string& id) const {
  MutexLock l(mu_);
  auto it = sandboxes_.find(id);
  if (it == sandboxes_.end()) return internal_error("network: attach before reserve for " + id);
  return it->second.nft;
}

void HostNetwork::mark_attached(const std::string& id) {
  MutexLock l(mu_);
  sandboxes_[id].attached = true;
}

Status HostNetwork::attach(const std::string& id, int netns_fd) {
  Result<NftSandbox> r = reserved(id);
  if (!r) return r.error();
  const NftSandbox s = std::move(*r);
  const uint32_t gateway = s.address - 1;
  Result<Rtnl> host = Rtnl::open();
  if (!host) return host.error();
  if (Status st = host->create_veth(s.link, "eth0", netns_fd); !st) return st;
  mark_attached(id);  // from here the link exists: release() removes it
  Result<int> hidx = host->link_index(s.link);
  if (!hidx) return hidx.error();
  if (Status st = host->add_address4(*hidx, htonl(gateway), 30); !st) return st;
  if (Status st = host->set_up(*hidx); !st) return st;

  Result<Rtnl> inside = Rtnl::open_in(netns_fd);
  if (!inside) return inside.error();
  Result<int> sidx = inside->link_index("eth0");
  if (!sidx) return sidx.error();
  if (Status st = inside->add_address4(*sidx, htonl(s.address), 30); !st) return st;
  if (Status st = inside->set_up(*sidx); !st) return st;
  if (Status st = inside->add_default_route4(*sidx, htonl(gateway)); !st) return st;
  // ping without privileges (ICMP datagram sockets, as on desktop
  // distributions): the sandbox's root is not root of its network
  // namespace, so raw sockets are not its to open.
  if (Status st = set_ping_group_range(netns_fd); !st) return st;
  // The policy last: until its chain is in the verdict map the forward
  // chain drops everything from the link.
  return install_rules(id, s);
}

Result<UniqueFd> HostNetwork::attach_tap(const std::string& id) {
  Result<NftSandbox> r = reserved(id);
  if (!r) return r.error();
  const NftSandbox s = std::move(*r);
  const uint32_t gateway = s.address - 1;
  // The VMM's virtio-net (vmm/devices/virtio_net.h) reads and writes it.
  Result<UniqueFd> tap = open_tap(s.link);
  if (!tap) return tap.error();
  mark_attached(id);  // the link exists while the fd is open: release() removes it
  Result<Rtnl> host = Rtnl::open();
  if (!host) return host.error();
  Result<int> idx = host->link_index(s.link);
  if (!idx) return idx.error();
  // Every TAP's host end has the same address: a microVM restored onto
  // another TAP (a fork, a resume) keeps its gateway's neighbour entry.
  if (Status st = host->set_mac(*idx, kTapHostMac.data()); !st) return st.error();
  if (Status st = host->add_address4(*idx, htonl(gateway), 30); !st) return st.error();
  if (Status st = host->set_up(*idx); !st) return st.error();
  if (Status st = install_rules(id, s); !st) return st.error();
  return std::move(*tap);
}

Status HostNetwork::install_rules(const std::string& id, const NftSandbox& s) {
  EgressPolicy p = policy_of(id);
  // Under the lock, so that a policy change or a release sees the chain
  // whole or not at all.
  MutexLock l(mu_);
  auto it = sandboxes_.find(id);
  if (it == sandboxes_.end()) return Error(ErrorKind::kNotFound, "sandbox " + id + " is gone");
  if (Status st = nftables_->run(nft_sandbox_script(nft_, s, p, false)); !st) return st;
  it->second.chain = true;
  by_address_[s.address] = id;
  return Status::Ok();
}

Status HostNetwork::adopt(const std::string& id, int netns_fd) {
  Result<Rtnl> inside = Rtnl::open_in(netns_fd);
  if (!inside) return inside.error();
  Result<int> eth = inside->link_index("eth0");
  if (!eth) return eth.error();  // kNotFound: made without a network
  Result<std::vector<std::pair<uint32_t, int>>> addrs = inside->addresses4(*eth);
  if (!addrs) return addrs.error();
  const Ipv4Net r = nft_.range;
  for (auto [a, prefix] : *addrs) {
    uint64_t off = static_cast<uint64_t>(a) - r.addr;
    if (prefix == 30 && a >= r.addr && off < (uint64_t{1} << (32 - r.prefix)) && off % 4 == 2) return take_back(id, a);
  }
  return not_found_error("sandbox " + id + " has no address of " + ipv4_net_text(r));
}

Status HostNetwork::adopt_tap(const std::string& id, uint32_t address) { return take_back(id, address); }

Status HostNetwork::take_back(const std::string& id, uint32_t address) {
  const Ipv4Net r = nft_.range;
  const uint64_t off = static_cast<uint64_t>(address) - r.addr;
  if (address < r.addr || off >= (uint64_t{1} << (32 - r.prefix)) || off % 4 != 2)
    return not_found_error("sandbox " + id + "'s address " + ipv4_text(address) + " is not a sandbox's of " +
                           ipv4_net_text(r));
  const auto index = static_cast<uint32_t>(off / 4);
  NftSandbox s;
  {
    MutexLock l(mu_);
    if (sandboxes_.count(id)) return Error(ErrorKind::kConflict, "sandbox " + id + " has a network already");
    auto st = stale_.find(index);
    if (st == stale_.end())
      return not_found_error("sandbox " + id + "'s link " + nft_.if_prefix + std::to_string(index) + " is gone");
    Entry e;
    e.nft.index = index;
    e.nft.link = st->second;
    e.nft.address = address;
    e.attached = true;
    s = e.nft;
    stale_.erase(st);
    sandboxes_.emplace(id, std::move(e));
  }
  // Its rules as attach() installs them; until then the forward chain
  // drops everything from its link.
  return install_rules(id, s);
}

void HostNetwork::sweep() {
  std::map<uint32_t, std::string> gone;
  {
    MutexLock l(mu_);
    gone = stale_;
  }
  if (gone.empty()) return;
  Result<Rtnl> rtnl = Rtnl::open();
  for (const auto& [index, link] : gone) {
    if (rtnl)
      if (Status s = rtnl->delete_link(link); !s && s.error().kind() != ErrorKind::kNotFound) {
        LOG_WARN("network: removing the previous run's link " << link << ": " << s.error().message());
        continue;  // its slot stays taken
      }
    MutexLock l(mu_);
    if (stale_.erase(index)) used_[index] = false;
  }
  LOG_INFO("network: removed " << gone.size() << " links of sandboxes the previous run had and this one did not take back");
}

void HostNetwork::release(const std::string& id) {
  Entry e;
  {
    MutexLock l(mu_);
    auto it = sandboxes_.find(id);
    if (it == sandboxes_.end()) return;
    e = it->second;
    sandboxes_.erase(it);
    by_address_.erase(e.nft.address);
    used_[e.nft.index] = false;
    if (e.chain)
      if (Status s = nftables_->run(nft_remove_sandbox_script(nft_, e.nft)); !s)
        LOG_WARN("network: removing sandbox " << id << "'s rules: " << s.error().message());
  }
  if (!e.attached) return;
  // The chain goes whether or not the link still exists (the namespace's
  // end dies with the sandbox, taking the pair with it).
  if (Result<Rtnl> rtnl = Rtnl::open()) {
    if (Status s = rtnl->delete_link(e.nft.link); !s && s.error().kind() != ErrorKind::kNotFound)
      LOG_WARN("network: removing " << e.nft.link << ": " << s.error().message());
  }
}

void HostNetwork::policy_changed(const std::string& id) {
  EgressPolicy p = policy_of(id);
  MutexLock l(mu_);
  auto it = sandboxes_.find(id);
  if (it == sandboxes_.end() || !it->second.chain) return;
  if (Status st = nftables_->run(nft_sandbox_script(nft_, it->second.nft, p, true)); !st)
    LOG_WARN("network: sandbox " << id << "'s new policy: " << st.error().message());
}

}  // namespace sg::network
