// nftables scripts for sandboxes' networks and their one runner (nft_rules.h).
// Script syntax: nft(8); the scripts are checked by tests against the
// kernel (tests/sandbox-runtime/network/) and by `nft -c` there.
#include "sandbox-runtime/network/nft_rules.h"

#include <nftables/libnftables.h>

#include <algorithm>
#include <cstdio>
#include <sstream>

namespace sg::network {
namespace {

// The host's internal IPv4 networks, as egress_policy.cpp's is_internal.
constexpr const char* kInternal =
    "0.0.0.0/8, 10.0.0.0/8, 100.64.0.0/10, 127.0.0.0/8, 169.254.0.0/16, 172.16.0.0/12, "
    "192.0.0.0/24, 192.168.0.0/16, 198.18.0.0/15, 224.0.0.0/3";

std::string chain_of(const NftSandbox& s) { return "sb_" + std::to_string(s.index); }

// The IPv4 entries of a policy list (sandboxes have no IPv6 address, so
// IPv6 entries can match nothing).
std::vector<std::string> v4_elements(const std::vector<IpNet>& nets) {
  std::vector<std::string> out;
  for (const IpNet& n : nets) {
    if (!is_v4_mapped(n.addr) || n.prefix < 96) continue;
    uint32_t a = (uint32_t{n.addr[12]} << 24) | (uint32_t{n.addr[13]} << 16) | (uint32_t{n.addr[14]} << 8) | n.addr[15];
    int prefix = n.prefix - 96;
    uint32_t mask = prefix == 0 ? 0 : ~uint32_t{0} << (32 - prefix);
    out.push_back(ipv4_net_text({a & mask, prefix}));
  }
  return out;
}

void elements(std::ostringstream& o, const std::string& table, const std::string& set,
              const std::vector<std::string>& els) {
  if (els.empty()) return;
  o << "add element inet " << table << " " << set << " { ";
  for (size_t i = 0; i < els.size(); ++i) o << (i ? ", " : "") << els[i];
  o << " }\n";
}

}  // namespace

std::string ipv4_text(uint32_t a) {
  char b[16];
  std::snprintf(b, sizeof b, "%u.%u.%u.%u", a >> 24, (a >> 16) & 255, (a >> 8) & 255, a & 255);
  return b;
}

std::string ipv4_net_text(const Ipv4Net& n) { return ipv4_text(n.addr) + "/" + std::to_string(n.prefix); }

std::optional<Ipv4Net> parse_ipv4_net(const std::string& text) {
  unsigned a, b, c, d, p;
  char tail;
  if (std::sscanf(text.c_str(), "%3u.%3u.%3u.%3u/%2u%c", &a, &b, &c, &d, &p, &tail) != 5) return std::nullopt;
  if (a > 255 || b > 255 || c > 255 || d > 255 || p > 32) return std::nullopt;
  uint32_t addr = (a << 24) | (b << 16) | (c << 8) | d;
  uint32_t mask = p == 0 ? 0 : ~uint32_t{0} << (32 - p);
  if ((addr & ~mask) != 0) return std::nullopt;
  if (text != ipv4_net_text({addr, static_cast<int>(p)})) return std::nullopt;  // no leading zeros or spaces
  return Ipv4Net{addr, static_cast<int>(p)};
}

std::string nft_table_script(const NftConfig& c) {
  const std::string t = c.table, links = "\"" + c.if_prefix + "*\"", range = ipv4_net_text(c.range);
  std::ostringstream o;
  // add + delete + add: one transaction that works whether or not the table exists.
  o << "add table inet " << t << "\n"
    << "delete table inet " << t << "\n"
    << "table inet " << t << " {\n"
    << "  set internal { type ipv4_addr; flags interval; elements = { " << kInternal << " } }\n"
    << "  set conns { type ipv4_addr; size 65535; flags dynamic; }\n"
    << "  map sandboxes { type ifname : verdict; }\n"
    << "  map sandboxes_in { type ifname : verdict; }\n"
    << "  chain refuse {\n"
    << "    meta l4proto tcp reject with tcp reset\n"
    << "    reject with icmpx type admin-prohibited\n"
    << "  }\n"
    << "  chain forward {\n"
    << "    type filter hook forward priority filter; policy accept;\n"
    << "    iifname " << links << " meta nfproto ipv6 drop\n"
    << "    iifname " << links << " iifname vmap @sandboxes\n"
    << "    iifname " << links << " drop\n"
    << "    oifname " << links << " ct state established,related oifname vmap @sandboxes_in\n"
    << "    oifname " << links << " drop\n"
    << "  }\n"
    << "  chain input {\n"
    << "    type filter hook input priority filter; policy accept;\n"
    << "    iifname " << links << " meta nfproto ipv6 drop\n";
  if (c.dns_port != 0)
    o << "    iifname " << links << " meta l4proto { tcp, udp } th dport " << c.dns_port << " accept\n";
  o << "    iifname " << links << " ct state established,related accept\n"
    << "    iifname " << links << " goto refuse\n"
    << "  }\n";
  if (c.dns_port != 0)
    o << "  chain prerouting {\n"
      << "    type nat hook prerouting priority dstnat; policy accept;\n"
      << "    iifname " << links << " fib daddr type local meta l4proto { tcp, udp } th dport 53 redirect to :"
      << c.dns_port << "\n"
      << "  }\n";
  o << "  chain postrouting {\n"
    << "    type nat hook postrouting priority srcnat; policy accept;\n"
    << "    ip saddr " << range << " oifname != " << links << " masquerade\n"
    << "  }\n"
    << "}\n";
  return o.str();
}

std::string nft_delete_table_script(const NftConfig& c) {
  return "add table inet " + c.table + "\ndelete table inet " + c.table + "\n";
}

std::string nft_counter_prefix(const NftSandbox& s) { return chain_of(s); }

std::string nft_sandbox_script(const NftConfig& c, const NftSandbox& s, const EgressPolicy& p, bool exists) {
  const std::string t = c.table, ch = chain_of(s);
  const std::string refused = "counter name \"" + ch + "_refused\" goto refuse";
  std::ostringstream o;
  if (!exists) {
    o << "add set inet " << t << " " << ch << "_allow { type ipv4_addr; flags interval; }\n"
      << "add set inet " << t << " " << ch << "_deny { type ipv4_addr; flags interval; }\n"
      << "add set inet " << t << " " << ch << "_names { type ipv4_addr; flags timeout; size 65536; }\n";
    for (const char* k : {"_tx", "_rx", "_refused", "_limited"}) o << "add counter inet " << t << " " << ch << k << "\n";
    if (c.rate_bytes_per_s) {
      // A burst of 1/16 s of the rate, at least 64 KiB.
      uint64_t burst = std::max<uint64_t>(c.rate_bytes_per_s / 16, 65536);
      for (const char* k : {"_up", "_down"})
        o << "add limit inet " << t << " " << ch << k << " { rate over " << c.rate_bytes_per_s
          << " bytes/second burst " << burst << " bytes }\n";
    }
    o << "add chain inet " << t << " " << ch << "\n"
      << "add chain inet " << t << " " << ch << "_in\n";
    const std::string in = "add rule inet " + t + " " + ch + "_in ";
    if (c.rate_bytes_per_s) o << in << "limit name \"" << ch << "_down\" counter name \"" << ch << "_limited\" drop\n";
    o << in << "counter name \"" << ch << "_rx\" accept\n";
  } else {
    o << "flush set inet " << t << " " << ch << "_allow\n"
      << "flush set inet " << t << " " << ch << "_deny\n"
      << "flush set inet " << t << " " << ch << "_names\n"
      << "flush chain inet " << t << " " << ch << "\n";
  }
  elements(o, t, ch + "_allow", v4_elements(p.allow_nets));
  elements(o, t, ch + "_deny", v4_elements(p.deny_nets));
  const std::string rule = "add rule inet " + t + " " + ch + " ";
  o << rule << "ip saddr != " << ipv4_text(s.address) << " drop\n";
  if (c.max_connections)
    o << rule << "ct state new add @conns { ip saddr ct count over " << c.max_connections << " } " << refused << "\n";
  if (c.rate_bytes_per_s) o << rule << "limit name \"" << ch << "_up\" counter name \"" << ch << "_limited\" drop\n";
  o << rule << "ip daddr " << ipv4_net_text(c.range) << " " << refused << "\n";
  if (!c.allow_internal) o << rule << "ip daddr @internal " << refused << "\n";
  o << rule << "ip daddr @" << ch << "_allow counter name \"" << ch << "_tx\" accept\n"
    << rule << "ip daddr @" << ch << "_names counter name \"" << ch << "_tx\" accept\n"
    << rule << "ip daddr @" << ch << "_deny " << refused << "\n";
  if (!p.internet) o << rule << refused << "\n";
  o << rule << "counter name \"" << ch << "_tx\" accept\n";
  if (!exists) {
    o << "add element inet " << t << " sandboxes { \"" << s.link << "\" : jump " << ch << " }\n"
      << "add element inet " << t << " sandboxes_in { \"" << s.link << "\" : jump " << ch << "_in }\n";
  }
  return o.str();
}

std::string nft_remove_sandbox_script(const NftConfig& c, const NftSandbox& s) {
  const std::string t = c.table, ch = chain_of(s);
  std::ostringstream o;
  o << "delete element inet " << t << " sandboxes { \"" << s.link << "\" }\n"
    << "delete element inet " << t << " sandboxes_in { \"" << s.link << "\" }\n"
    << "delete chain inet " << t << " " << ch << "\n"
    << "delete chain inet " << t << " " << ch << "_in\n"
    << "delete set inet " << t << " " << ch << "_allow\n"
    << "delete set inet " << t << " " << ch << "_deny\n"
    << "delete set inet " << t << " " << ch << "_names\n";
  for (const char* k : {"_tx", "_rx", "_refused", "_limited"}) o << "delete counter inet " << t << " " << ch << k << "\n";
  if (c.rate_bytes_per_s)
    for (const char* k : {"_up", "_down"}) o << "delete limit inet " << t << " " << ch << k << "\n";
  return o.str();
}

std::string nft_allow_names_script(const NftConfig& c, const NftSandbox& s, const std::vector<uint32_t>& addrs,
                                   uint32_t ttl_s) {
  if (addrs.empty()) return "";
  std::ostringstream o;
  // An address already there keeps its own timeout: add, not replace
  // (the longer of the two answers' TTLs is not worth a second command).
  o << "add element inet " << c.table << " " << chain_of(s) << "_names { ";
  for (size_t i = 0; i < addrs.size(); ++i) o << (i ? ", " : "") << ipv4_text(addrs[i]) << " timeout " << ttl_s << "s";
  o << " }\n";
  return o.str();
}

Result<std::string> Nftables::run_json(const std::string& command) {
  MutexLock l(mu_);
  unsigned flags = nft_ctx_output_get_flags(ctx_);
  nft_ctx_output_set_flags(ctx_, flags | NFT_CTX_OUTPUT_JSON);
  int rc = nft_run_cmd_from_buffer(ctx_, command.c_str());
  nft_ctx_output_set_flags(ctx_, flags);
  std::string out = nft_ctx_get_output_buffer(ctx_);
  std::string err = nft_ctx_get_error_buffer(ctx_);
  if (rc != 0) {
    if (err.size() > 2000) err.resize(2000);
    return internal_error("nftables: " + command + ": " + err);
  }
  return out;
}

Result<std::unique_ptr<Nftables>> Nftables::open() {
  nft_ctx* ctx = nft_ctx_new(NFT_CTX_DEFAULT);
  if (!ctx) return internal_error("nftables: cannot make a libnftables context");
  nft_ctx_buffer_output(ctx);
  nft_ctx_buffer_error(ctx);
  return std::unique_ptr<Nftables>(new Nftables(ctx));
}

Nftables::~Nftables() {
  MutexLock l(mu_);
  nft_ctx_free(ctx_);
}

Status Nftables::run(const std::string& script) {
  if (script.empty()) return Status::Ok();
  MutexLock l(mu_);
  int rc = nft_run_cmd_from_buffer(ctx_, script.c_str());
  std::string err = nft_ctx_get_error_buffer(ctx_);
  if (rc != 0) {
    if (err.size() > 2000) err.resize(2000);
    return internal_error("nftables: the kernel refused the rules: " + err);
  }
  return Status::Ok();
}

}  // namespace sg::network
