// Command-line parsing and the admin commands over the same SQLite file the
// server uses (WAL lets them run while it serves).
#include "gateway/cli.h"

#include <arpa/inet.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <ctime>
#include <iostream>
#include <functional>
#include <map>
#include <optional>
#include <set>

#include "gateway/app.h"
#include "gateway/cluster.h"
#include "gateway/cluster_tenants.h"
#include "sandbox-runtime/network/nft_rules.h"
#include "storage/etcd.h"
#include "sandbox-runtime/microvm/microvm_runtime.h"
#include "storage/store.h"
#include "base/log.h"
#include "base/sys.h"
#include "tenancy/llm_keys.h"
#include "tenancy/tenants.h"

namespace sg::gateway {

namespace {

const char* kUsage = R"(usage: sandgate COMMAND [options]

commands:
  serve                         run the server (default command)
  tenant create NAME            create a tenant; prints its first API key
         [--max-sandboxes N] [--max-memory-mb N]
  tenant list                   list tenants with their quotas
  tenant set-quota NAME --max-sandboxes N --max-memory-mb N
  tenant revoke NAME            revoke all keys of a tenant and disable it; the
                                server kills its sandboxes within a second
  key create TENANT             add an API key to a tenant; prints it
  key list TENANT               list a tenant's keys (prefixes only)
  key revoke KEY_ID             revoke one key
                                (tenant, key and llm key commands with
                                --cluster URL: the cluster's, in etcd, for
                                every node)
  llm key create TENANT [--name LABEL]
                                add a model-proxy key (sk-sg-...) to a tenant;
                                prints it once
  llm key list TENANT           list a tenant's model-proxy keys (prefixes only)
  llm key revoke KEY_ID         revoke one model-proxy key
  llm upstream set PROVIDER --base-url URL --key-file FILE [--tenant NAME]
                                where the model proxy sends PROVIDER (openai or
                                anthropic) requests: globally, or for one tenant
                                (a tenant's own wins); FILE holds the provider
                                key, which is stored but never printed
  llm upstream list             list upstreams (keys as their last 4 characters)
  llm upstream remove PROVIDER [--tenant NAME]
  llm usage TENANT [--sandbox ID]
                                model-proxy requests and tokens used
  template build                build the base template if missing
  template image                build the base template's ext4 image (kvm backend)
  template build|image code-interpreter-v1
                                the same for the code interpreter template
  node list --cluster URL       the cluster's live nodes, capacity and load
  node drain|undrain ID --cluster URL
                                stop (or resume) placing new sandboxes on a
                                node; its sandboxes run on
  node remove ID --cluster URL  forget a node that is gone: its sandboxes are
                                reported not found instead of lost
  kvm check                     say whether this host's /dev/kvm can run microVMs
                                (exit 0: yes, 1: no, with the reason)
  version                       print the version

common options:
  --data-dir DIR                state directory (default $SANDGATE_DATA_DIR,
                                else ~/.local/share/sandgate)
serve options:
  --listen ADDR:PORT            default 127.0.0.1:3000 (port 0: any free port)
  --templates-dir DIR           default DATA_DIR/templates
  --runtime auto|process|kvm    backend (default auto)
  --agent PATH                  sandgate-agent binary (default: beside sandgate)
  --vmm PATH                    sandgate-vmm binary (default: beside sandgate)
  --guest-dir DIR               microVM kernel + initramfs (default DATA_DIR/guest,
                                built by scripts/guest-image.sh)
  --cgroup-parent NAME          cgroup directory for this instance (default sandgate)
  --port-file FILE              write the bound port here once listening
  --domain DOMAIN               route Host PORT-ID.DOMAIN to sandbox ports
  --tls-cert FILE --tls-key FILE  serve HTTPS (PEM; a wildcard *.DOMAIN
                                certificate for host-based routing)
  --read-timeout-ms N           per-read deadline for clients (default 30000)
  --body-limit BYTES            request body limit (default 1048576)
  --max-connections N           open client connections in all (default: half
                                the open-file limit, at most 16384); past it a
                                connection gets 503 and is closed
  --max-connections-per-address N  the same from one source address (default:
                                a quarter of --max-connections)
  --tick-ms N                   timeout sweep period (default 1000)
  --drain-timeout-ms N          at SIGTERM, how long requests in progress may
                                take to finish before the stop (0-600000,
                                default 10000)
  --rate N                      requests per second per tenant (default 200)
  --create-rate N               creates per second per tenant (default 20)
  --openai-base-url URL         global OpenAI-compatible upstream of the model
                                proxy (http[s]://HOST[:PORT][/PATH])
  --openai-key-file FILE        its provider key
  --anthropic-base-url URL      global Anthropic upstream
  --anthropic-key-file FILE     its provider key
  --llm-body-limit BYTES        model request body limit (default 33554432)
  --llm-rate N                  model requests per second per tenant (default 50)
  --llm-tokens-per-min N        model tokens per minute per tenant (default 2000000)
  --llm-grace-ms N              pause a sandbox waiting on a model after N ms
                                (0-10000, default 30)
  --llm-cooldown-ms N           never pause sooner than N ms after a resume
                                (0-600000, default 250)
  --no-llm-pause                never pause sandboxes that wait on a model
  --memory-offload auto|always|off  offload a wait-paused sandbox's memory
                                (microVMs: into the memory engine; process
                                sandboxes: into swap, --process-swap; auto:
                                while host MemAvailable is under 20% of
                                MemTotal, until it is over 30%; default auto)
  --process-swap zram|host|off  the swap process sandboxes offload into: a
                                zram device sandgate makes (default), the
                                host's active swap, or none (a freeze)
  --zram-mb N                   the zram device's capacity, uncompressed
                                (default: half of RAM)
  --swap-codec-audit            measure: encode every page a process
                                sandbox's offload puts out with the memory
                                engine's codecs too, beside what the swap
                                stored (/metrics sandgate_swap_audit_*;
                                costs CPU on every offload)
  --offload-min-wait-ms N       offload only when the expected remaining wait
                                is at least N ms (0: every pause; default 2000)
  --idle-offload-ms N           a process sandbox with no traffic and under 1%
                                of a CPU for N ms goes out to swap as it runs,
                                where --memory-offload applies (0: never;
                                default 30000)
  --memory-pool-mb N            RAM for offloaded pages before they spill to
                                DATA_DIR/memory-pool (default 1024)
  --offload-concurrency N       offloads encoding at once (CPU budget; default 1)
  --disk-limit auto|on|off      limit each process sandbox's writable layer to
                                its template's disk size (a loop-mounted ext4
                                image; auto: where loop devices and mkfs.ext4
                                are available; default auto)
  --keep-sandboxes on|off       on: process sandboxes outlive a stop, upgrade
                                or crash of sandgate, and the next start on the
                                same data directory serves them again; off:
                                they end with it (default on)
  --code-interpreter auto|off   the code-interpreter-v1 template (E2B's code
                                interpreter SDKs' default): auto builds it in
                                the background when missing (apt, a few
                                minutes; its creates answer 503 meanwhile);
                                default auto
  --sandbox-disk-mb N           the base template's disk size (16-1048576 MiB,
                                default 1024)
  --template-builds N           template builds a tenant may have queued or
                                running at once (default 4)
  --template-storage-mb N       what a tenant's template builds may keep on
                                disk: layers, uploads, pulled images (MiB,
                                default 51200)
  --template-build-timeout S    a template build's time limit (s, default
                                1800; each step at most 600)
  --warm-pool N                 sandboxes of each template with a start command
                                kept started ahead of creates, per tenant that
                                created one in the last 10 min, within its
                                quota (0-64; default 2 on the process backend,
                                0 on kvm)
  --template-ready-timeout S    how long a template's ready command may take
                                to succeed after its start command, at the
                                end of its build and at each create (s,
                                default 60)
  --user-namespaces auto|on|off map each process sandbox's root to its own
                                range of 65536 unprivileged host uids (auto:
                                where the kernel and the template's
                                filesystem allow it; default auto)
  --sandbox-uid-base N          first host uid of those ranges (default
                                1073741824; one range per sandgate on a host)
  --vmm-jail auto|on|off        run each VMM (kvm backend) in an empty root
                                of its own as its own unprivileged uid, one
                                of the 65536 below --sandbox-uid-base (auto:
                                where sandgate is root and the kernel has
                                /dev/userfaultfd; default auto)
  --egress                      let sandboxes out through the egress proxy
                                (HTTP_PROXY/HTTPS_PROXY inside), by each
                                one's allow_internet_access and
                                network.allowOut/denyOut: --network proxy
  --egress-allow-private        the proxy (or the sandboxes' own networks)
                                may also reach the host's internal
                                networks (loopback, private, link-local):
                                local use only, never with tenants
  --network veth|proxy|auto|off how sandboxes get out: veth, a network of
                                their own (a veth pair each, a TAP device
                                and virtio-net for microVMs; NAT, policy in
                                nftables); proxy, the
                                egress proxy (as --egress); auto, veth
                                where this host can, else proxy (the
                                default, as E2B: internet on unless a
                                sandbox is created without it); off,
                                loopback only, for every sandbox
  --network-range CIDR          the veth path's sandbox addresses, a /30
                                each (default: a free /20 of 10.192.0.0/10)
  --sandbox-bandwidth-mbit N    the veth path's limit per sandbox and
                                direction, in Mbit/s (default 1000; 0: none)
  --sandbox-connections N       the veth path's limit of open connections
                                per sandbox (default 4096; 0: none)
  --dns-upstream ADDR           the resolver (IPv4) that sandboxes' DNS
                                forwarder asks on the veth path (default:
                                the host's, from /etc/resolv.conf)
  --no-local-tenant             do not create the "local" tenant
  --metrics-token-file FILE     GET /metrics requires "Authorization: Bearer
                                TOKEN" with the token in FILE (set it when
                                the port is public; default: open)
  --cluster etcd://HOST:PORT[,HOST:PORT...]
                                join a cluster coordinated by etcd
                                (docs/cluster.md): any node serves every
                                sandbox, creates are placed across nodes
  --cluster-secret-file FILE    the secret all the cluster's nodes share
                                (16+ characters; required with --cluster)
  --node-id ID                  this node's name in the cluster (default:
                                the host name)
  --advertise HOST:PORT         where the other nodes reach this one
                                (default: the node port's address)
  --cluster-listen ADDR:PORT    a plain-HTTP port for the other nodes only
                                (required with --tls-cert; default: the
                                --listen port serves them too)
  --cluster-lease-ttl S         a silent node is dropped after S seconds
                                (2-60, default 5)
  --cluster-lost-grace S        its sandboxes answer 503 (retry) for S
                                seconds, then 404 lost (default 30)
  --log-level debug|info|warn|error
)";

struct Args {
  std::vector<std::string> positional;
  std::map<std::string, std::string> opts;
};

// Options that take no value; "--flag=false" (or "=0") turns one off.
const std::set<std::string> kFlags = {"help", "no-local-tenant", "no-llm-pause", "egress", "egress-allow-private",
                                      "swap-codec-audit"};

bool flag_on(const std::string& v) { return v != "false" && v != "0"; }

bool parse(const std::vector<std::string>& in, Args& a, std::ostream& err) {
  for (size_t i = 0; i < in.size(); ++i) {
    const std::string& s = in[i];
    if (s.rfind("--", 0) == 0) {
      std::string name = s.substr(2), value;
      size_t eq = name.find('=');
      if (eq != std::string::npos) {
        value = name.substr(eq + 1);
        name = name.substr(0, eq);
      } else if (kFlags.count(name)) {
        value = "1";
      } else {
        if (i + 1 >= in.size()) {
          err << "sandgate: option --" << name << " needs a value\n";
          return false;
        }
        value = in[++i];
      }
      a.opts[name] = value;
    } else {
      a.positional.push_back(s);
    }
  }
  return true;
}

bool to_int(const std::string& s, int64_t& out) {
  if (s.empty()) return false;
  char* end = nullptr;
  long long v = std::strtoll(s.c_str(), &end, 10);
  if (*end) return false;
  out = v;
  return true;
}

// An admin command's error: said, and exit 2 for bad input, else 1.
int admin_fail(std::ostream& err, const Error& e) {
  err << "sandgate: " << e.message() << "\n";
  return e.kind() == ErrorKind::kInvalid ? 2 : 1;
}

// A quota option (--max-sandboxes, --max-memory-mb) into v if given; false
// (said) when it is not a non-negative integer.
bool read_quota_opt(Args& a, std::ostream& err, const char* name, int64_t& v) {
  auto it = a.opts.find(name);
  if (it == a.opts.end()) return true;
  if (!to_int(it->second, v) || v < 0) {
    err << "sandgate: --" << name << " wants a non-negative integer\n";
    return false;
  }
  return true;
}

// The listings, one format for a node's own tenants and keys and the
// cluster's.
void print_tenants(std::ostream& out, const std::vector<storage::TenantRow>& ts) {
  out << "NAME\tID\tMAX_SANDBOXES\tMAX_MEMORY_MB\tSTATUS\tCREATED\n";
  for (const auto& t : ts)
    out << t.name << "\t" << t.id << "\t" << t.max_sandboxes << "\t" << t.max_memory_mb << "\t"
        << (t.disabled ? "revoked" : "active") << "\t" << sys::format_rfc3339(t.created_at) << "\n";
}

void print_keys(std::ostream& out, const std::vector<storage::ApiKeyRow>& ks) {
  out << "ID\tPREFIX\tSTATUS\tCREATED\n";
  for (const auto& k : ks)
    out << k.id << "\t" << k.key_prefix << "\t" << (k.revoked_at ? "revoked" : "active") << "\t"
        << sys::format_rfc3339(k.created_at) << "\n";
}

void print_llm_keys(std::ostream& out, const std::vector<storage::LlmKeyRow>& ks) {
  out << "ID\tPREFIX\tNAME\tSTATUS\tCREATED\n";
  for (const auto& k : ks)
    out << k.id << "\t" << k.key_prefix << "\t" << (k.name.empty() ? "-" : k.name) << "\t"
        << (k.revoked_at ? "revoked" : "active") << "\t" << sys::format_rfc3339(k.created_at) << "\n";
}

// The etcd client of --cluster URL, or nullopt after saying why.
std::optional<etcd::Client> cluster_client(Args& a, std::ostream& err) {
  Result<std::vector<net::Endpoint>> eps = etcd::parse_endpoints(a.opts["cluster"]);
  if (!eps) {
    err << "sandgate: --cluster: " << eps.error().message() << "\n";
    return std::nullopt;
  }
  return std::optional<etcd::Client>(std::in_place, *eps);
}

// `sandgate node ...`: the cluster's nodes, read and changed in etcd
// (no node needs to be reached).
int run_node(const std::vector<std::string>& p, Args& a, std::ostream& out, std::ostream& err) {
  std::string sub = p.size() > 1 ? p[1] : "";
  bool list = sub == "list" && p.size() == 2;
  bool one = (sub == "drain" || sub == "undrain" || sub == "remove") && p.size() == 3;
  if ((!list && !one) || !a.opts.count("cluster")) {
    err << "usage: sandgate node list|drain ID|undrain ID|remove ID --cluster etcd://HOST:PORT[,...]\n";
    return 2;
  }
  std::optional<etcd::Client> client = cluster_client(a, err);
  if (!client) return 2;
  etcd::Client& etcd = *client;
  const std::string prefix = kClusterPrefix;
  if (list) {
    Result<std::vector<NodeInfo>> nodes = Cluster::list_nodes(etcd, prefix);
    if (!nodes) {
      err << "sandgate: " << nodes.error().message() << "\n";
      return 1;
    }
    out << "ID\tADDRESS\tBACKEND\tSANDBOXES\tMEMORY_MB\tCPUS\tSTATE\n";
    for (const NodeInfo& n : *nodes)
      out << n.id << "\t" << n.address << "\t" << n.backend << "\t" << n.sandboxes << "\t" << n.memory_used_mb << "/"
          << n.memory_mb << "\t" << n.cpus << "\t" << (n.draining ? "draining" : "ready") << "\n";
    return 0;
  }
  if (sub == "remove") {
    Result<int64_t> n = Cluster::remove_node(etcd, prefix, p[2]);
    if (!n) {
      err << "sandgate: node remove " << p[2] << ": " << n.error().message() << "\n";
      return 1;
    }
    out << "node " << p[2] << " removed; " << *n << " of its sandboxes forgotten\n";
    return 0;
  }
  if (Status s = Cluster::set_drain(etcd, prefix, p[2], sub == "drain"); !s) {
    err << "sandgate: node " << sub << " " << p[2] << ": " << s.error().message() << "\n";
    return 1;
  }
  out << "node " << p[2] << (sub == "drain" ? " draining: no new sandboxes are placed there\n" : " takes new sandboxes again\n");
  return 0;
}

// `sandgate tenant|key ... --cluster URL`: the cluster's tenants and keys,
// in etcd (every node mirrors them; cluster_tenants.h).
int run_cluster_admin(const std::vector<std::string>& p, Args& a, std::ostream& out, std::ostream& err) {
  std::optional<etcd::Client> client = cluster_client(a, err);
  if (!client) return 2;
  etcd::Client& etcd = *client;
  const std::string prefix = kClusterPrefix;
  auto fail = [&](const Error& e) { return admin_fail(err, e); };
  auto quota_opt = [&](const char* name, int64_t& v) { return read_quota_opt(a, err, name, v); };
  std::string cmd = p[0], sub = p.size() > 1 ? p[1] : "";
  if (cmd == "tenant" && sub == "create" && p.size() == 3) {
    tenancy::Quota q;
    if (!quota_opt("max-sandboxes", q.max_sandboxes) || !quota_opt("max-memory-mb", q.max_memory_mb)) return 2;
    Result<tenancy::CreatedKey> k = cluster_tenants::create_tenant(etcd, prefix, p[2], q);
    if (!k) return fail(k.error());
    out << k->key << "\n";
    err << "tenant " << p[2] << " created in the cluster (max " << q.max_sandboxes << " sandboxes, " << q.max_memory_mb
        << " MB across all nodes); the key above is shown only once\n";
    return 0;
  }
  if (cmd == "tenant" && sub == "list" && p.size() == 2) {
    Result<std::vector<storage::TenantRow>> ts = cluster_tenants::list(etcd, prefix);
    if (!ts) return fail(ts.error());
    print_tenants(out, *ts);
    return 0;
  }
  if (cmd == "tenant" && sub == "set-quota" && p.size() == 3) {
    Result<storage::TenantRow> t = cluster_tenants::find(etcd, prefix, p[2]);
    if (!t) return fail(t.error());
    tenancy::Quota q{t->max_sandboxes, t->max_memory_mb};
    if (!quota_opt("max-sandboxes", q.max_sandboxes) || !quota_opt("max-memory-mb", q.max_memory_mb)) return 2;
    if (Status s = cluster_tenants::set_quota(etcd, prefix, p[2], q); !s) return fail(s.error());
    out << "tenant " << p[2] << ": max " << q.max_sandboxes << " sandboxes, " << q.max_memory_mb << " MB across the cluster\n";
    return 0;
  }
  if (cmd == "tenant" && sub == "revoke" && p.size() == 3) {
    Result<int64_t> n = cluster_tenants::revoke(etcd, prefix, p[2]);
    if (!n) return fail(n.error());
    out << "tenant " << p[2] << " revoked (" << *n << " keys); every node kills its sandboxes within a second\n";
    return 0;
  }
  if (cmd == "key" && sub == "create" && p.size() == 3) {
    Result<tenancy::CreatedKey> k = cluster_tenants::add_key(etcd, prefix, p[2]);
    if (!k) return fail(k.error());
    out << k->key << "\n";
    return 0;
  }
  if (cmd == "key" && sub == "list" && p.size() == 3) {
    Result<std::vector<storage::ApiKeyRow>> ks = cluster_tenants::list_keys(etcd, prefix, p[2]);
    if (!ks) return fail(ks.error());
    print_keys(out, *ks);
    return 0;
  }
  if (cmd == "key" && sub == "revoke" && p.size() == 3) {
    Result<bool> r = cluster_tenants::revoke_key(etcd, prefix, p[2]);
    if (!r) return fail(r.error());
    if (!*r) return fail(not_found_error("no active key with id " + p[2] + " in the cluster"));
    out << "key " << p[2] << " revoked\n";
    return 0;
  }
  if (cmd == "llm" && sub == "key" && p.size() == 4) {
    const std::string& what = p[2];
    if (what == "create") {
      std::string label = a.opts.count("name") ? a.opts["name"] : "";
      Result<tenancy::CreatedLlmKey> k = cluster_tenants::create_llm_key(etcd, prefix, p[3], label);
      if (!k) return fail(k.error());
      out << k->key << "\n";
      err << "model-proxy key " << k->row.id << " created for tenant " << p[3]
          << " in the cluster; the key above is shown only once\n";
      return 0;
    }
    if (what == "list") {
      Result<std::vector<storage::LlmKeyRow>> ks = cluster_tenants::list_llm_keys(etcd, prefix, p[3]);
      if (!ks) return fail(ks.error());
      print_llm_keys(out, *ks);
      return 0;
    }
    if (what == "revoke") {
      Result<bool> r = cluster_tenants::revoke_llm_key(etcd, prefix, p[3]);
      if (!r) return fail(r.error());
      if (!*r) return fail(not_found_error("no active model-proxy key with id " + p[3] + " in the cluster"));
      out << "model-proxy key " << p[3] << " revoked\n";
      return 0;
    }
  }
  err << "sandgate: bad " << cmd << " command\n" << kUsage;
  return 2;
}

// `sandgate llm ...`: model-proxy keys, upstreams and usage. Provider keys
// are read from files and never written to out or err.
int run_llm(const std::vector<std::string>& p, Args& a, storage::Store& store, const std::string& db_path,
            std::ostream& out, std::ostream& err) {
  tenancy::Tenants tenants(store);
  tenancy::LlmKeys keys(store);
  const std::string what = p.size() > 1 ? p[1] : "";
  const std::string sub = p.size() > 2 ? p[2] : "";
  auto fail = [&](const Error& e) {
    err << "sandgate: " << e.message() << "\n";
    return e.kind() == ErrorKind::kInvalid ? 2 : 1;
  };
  auto opt = [&](const char* name) -> std::optional<std::string> {
    auto it = a.opts.find(name);
    if (it == a.opts.end()) return std::nullopt;
    return it->second;
  };
  // --tenant NAME as a tenant id, or "" (global) without it.
  auto tenant_scope = [&]() -> Result<std::string> {
    std::optional<std::string> name = opt("tenant");
    if (!name) return std::string();
    Result<storage::TenantRow> t = tenants.by_name(*name);
    if (!t) return t.error();
    if (t->disabled) return conflict_error("tenant '" + *name + "' is revoked");
    return t->id;
  };
  auto scope_name = [&](const std::optional<std::string>& name) {
    return name ? "tenant " + *name : std::string("global");
  };

  if (what == "key" && sub == "create" && p.size() == 4) {
    Result<tenancy::CreatedLlmKey> k = keys.create(p[3], opt("name").value_or(""));
    if (!k) return fail(k.error());
    out << k->key << "\n";
    err << "model-proxy key " << k->row.id << " created for tenant " << p[3]
        << "; the key above is shown only once\n";
    return 0;
  }
  if (what == "key" && sub == "list" && p.size() == 4) {
    Result<storage::TenantRow> t = tenants.by_name(p[3]);
    if (!t) return fail(t.error());
    Result<std::vector<storage::LlmKeyRow>> ks = store.list_llm_keys(t->id);
    if (!ks) return fail(ks.error());
    print_llm_keys(out, *ks);
    return 0;
  }
  if (what == "key" && sub == "revoke" && p.size() == 4) {
    Result<bool> r = store.revoke_llm_key(p[3], sys::unix_seconds());
    if (!r) return fail(r.error());
    if (!*r) return fail(not_found_error("no active model-proxy key with id " + p[3]));
    out << "model-proxy key " << p[3] << " revoked\n";
    return 0;
  }
  if (what == "upstream" && sub == "set" && p.size() == 4) {
    std::optional<std::string> url = opt("base-url"), key_file = opt("key-file");
    if (!url || !key_file) {
      err << "usage: sandgate llm upstream set PROVIDER --base-url URL --key-file FILE [--tenant NAME]\n";
      return 2;
    }
    Result<std::string> normalised = tenancy::check_upstream(p[3], *url);
    if (!normalised) return fail(normalised.error().with_context("--base-url"));
    Result<std::string> secret = tenancy::read_upstream_key_file(*key_file);
    if (!secret) return fail(secret.error());
    Result<std::string> tenant_id = tenant_scope();
    if (!tenant_id) return fail(tenant_id.error());
    // The file now holds a secret: keep it 0600 even if an older sandgate
    // created it with the umask's mode (the server does the same at start).
    ::chmod(db_path.c_str(), 0600);
    storage::UpstreamRow u{*tenant_id, p[3], *normalised, *secret, sys::unix_seconds()};
    if (Status s = store.upsert_upstream(u); !s) return fail(s.error());
    out << "upstream " << p[3] << " (" << scope_name(opt("tenant")) << "): " << u.base_url << ", key "
        << tenancy::upstream_key_hint(u.api_key) << "\n";
    return 0;
  }
  if (what == "upstream" && sub == "list" && p.size() == 3) {
    Result<std::vector<storage::UpstreamRow>> us = store.list_upstreams();
    if (!us) return fail(us.error());
    Result<std::vector<storage::TenantRow>> ts = store.list_tenants();
    if (!ts) return fail(ts.error());
    std::map<std::string, std::string> names;
    for (const auto& t : *ts) names[t.id] = t.name;
    out << "TENANT\tPROVIDER\tBASE_URL\tKEY\n";
    for (const auto& u : *us) {
      auto n = names.find(u.tenant_id);
      out << (u.tenant_id.empty() ? "(global)" : n != names.end() ? n->second : u.tenant_id) << "\t" << u.provider
          << "\t" << u.base_url << "\t" << tenancy::upstream_key_hint(u.api_key) << "\n";
    }
    return 0;
  }
  if (what == "upstream" && sub == "remove" && p.size() == 4) {
    if (!tenancy::valid_provider(p[3]))
      return fail(invalid_error("unknown model provider '" + p[3] + "': use openai or anthropic"));
    Result<std::string> tenant_id = tenant_scope();
    if (!tenant_id) return fail(tenant_id.error());
    Result<bool> r = store.remove_upstream(*tenant_id, p[3]);
    if (!r) return fail(r.error());
    if (!*r) return fail(not_found_error("no " + scope_name(opt("tenant")) + " upstream for " + p[3]));
    out << "upstream " << p[3] << " (" << scope_name(opt("tenant")) << ") removed\n";
    return 0;
  }
  if (what == "usage" && p.size() == 3) {
    Result<storage::TenantRow> t = tenants.by_name(p[2]);
    if (!t) return fail(t.error());
    Result<storage::LlmUsageTotals> u = store.llm_usage_totals(t->id, opt("sandbox"));
    if (!u) return fail(u.error());
    out << "REQUESTS\tINPUT_TOKENS\tOUTPUT_TOKENS\tCACHE_READ_TOKENS\tCACHE_WRITE_TOKENS\n"
        << u->requests << "\t" << u->input_tokens << "\t" << u->output_tokens << "\t" << u->cache_read_tokens
        << "\t" << u->cache_write_tokens << "\n";
    return 0;
  }
  err << "sandgate: bad llm command\n" << kUsage;
  return 2;
}

}  // namespace

std::string default_data_dir() {
  if (const char* d = std::getenv("SANDGATE_DATA_DIR"); d && *d) return d;
  if (const char* x = std::getenv("XDG_DATA_HOME"); x && *x) return std::string(x) + "/sandgate";
  const char* home = std::getenv("HOME");
  return std::string(home && *home ? home : "/root") + "/.local/share/sandgate";
}

namespace {

// The serve flags but the integer ones. False (after saying why on err):
// exit 2.
bool serve_flags(Args& a, AppConfig& cfg, std::ostream& err) {
  if (auto it = a.opts.find("listen"); it != a.opts.end()) {
    size_t colon = it->second.rfind(':');
    int64_t port = 0;
    if (colon == std::string::npos || !to_int(it->second.substr(colon + 1), port) || port < 0 || port > 65535) {
      err << "sandgate: --listen wants ADDRESS:PORT, got '" << it->second << "'\n";
      return false;
    }
    cfg.listen_address = it->second.substr(0, colon);
    cfg.port = static_cast<uint16_t>(port);
  }
  if (a.opts.count("templates-dir")) cfg.templates_dir = a.opts["templates-dir"];
  if (a.opts.count("runtime")) cfg.runtime = a.opts["runtime"];
  if (a.opts.count("agent")) cfg.agent_path = a.opts["agent"];
  if (a.opts.count("vmm")) cfg.vmm_path = a.opts["vmm"];
  if (a.opts.count("guest-dir")) cfg.guest_dir = a.opts["guest-dir"];
  if (a.opts.count("cgroup-parent")) cfg.cgroup_parent = a.opts["cgroup-parent"];
  if (a.opts.count("port-file")) cfg.port_file = a.opts["port-file"];
  if (a.opts.count("public-url")) cfg.public_url = a.opts["public-url"];
  if (a.opts.count("domain")) cfg.domain = a.opts["domain"];
  if (a.opts.count("tls-cert")) cfg.tls_cert_file = a.opts["tls-cert"];
  if (a.opts.count("tls-key")) cfg.tls_key_file = a.opts["tls-key"];
  if (a.opts.count("no-local-tenant")) cfg.local_tenant = !flag_on(a.opts["no-local-tenant"]);
  if (a.opts.count("no-llm-pause")) cfg.llm_pause = !flag_on(a.opts["no-llm-pause"]);
  if (a.opts.count("egress")) cfg.egress = flag_on(a.opts["egress"]);
  if (a.opts.count("swap-codec-audit")) cfg.swap_codec_audit = flag_on(a.opts["swap-codec-audit"]);
  if (a.opts.count("cluster")) cfg.cluster = a.opts["cluster"];
  if (a.opts.count("cluster-secret-file")) cfg.cluster_secret_file = a.opts["cluster-secret-file"];
  if (a.opts.count("node-id")) cfg.node_id = a.opts["node-id"];
  if (a.opts.count("advertise")) cfg.advertise = a.opts["advertise"];
  if (a.opts.count("cluster-listen")) cfg.cluster_listen = a.opts["cluster-listen"];
  if (a.opts.count("egress-allow-private")) cfg.egress_allow_private = flag_on(a.opts["egress-allow-private"]);
  if (a.opts.count("network-range")) {
    cfg.network_range = a.opts["network-range"];
    if (!network::parse_ipv4_net(cfg.network_range)) {
      err << "sandgate: --network-range wants an IPv4 network, like 10.201.0.0/16 (host bits zero), not \""
          << cfg.network_range << "\"\n";
      return false;
    }
  }
  // Options with a fixed set of values.
  struct ChoiceOpt {
    const char* name;
    std::vector<std::string> values;
    std::string& out;
  };
  for (const ChoiceOpt& o : {ChoiceOpt{"disk-limit", {"auto", "on", "off"}, cfg.disk_limit},
                             ChoiceOpt{"code-interpreter", {"auto", "off"}, cfg.code_interpreter},
                             ChoiceOpt{"keep-sandboxes", {"on", "off"}, cfg.keep_sandboxes},
                             ChoiceOpt{"user-namespaces", {"auto", "on", "off"}, cfg.user_namespaces},
                             ChoiceOpt{"vmm-jail", {"auto", "on", "off"}, cfg.vmm_jail},
                             ChoiceOpt{"memory-offload", {"auto", "always", "off"}, cfg.memory_offload},
                             ChoiceOpt{"process-swap", {"zram", "host", "off"}, cfg.process_swap},
                             ChoiceOpt{"network", {"veth", "proxy", "auto", "off"}, cfg.network}}) {
    auto it = a.opts.find(o.name);
    if (it == a.opts.end()) continue;
    if (std::find(o.values.begin(), o.values.end(), it->second) == o.values.end()) {
      err << "sandgate: --" << o.name << " wants ";
      for (size_t i = 0; i < o.values.size(); ++i)
        err << (i == 0 ? "" : i + 1 == o.values.size() ? " or " : ", ") << o.values[i];
      err << "\n";
      return false;
    }
    o.out = it->second;
  }
  // --egress is --network proxy, said the old way; they must agree.
  if (cfg.network.empty()) cfg.network = cfg.egress ? "proxy" : "auto";
  if (a.opts.count("egress") && cfg.egress != (cfg.network == "proxy")) {
    err << "sandgate: --egress and --network " << cfg.network << " disagree (--egress is --network proxy)\n";
    return false;
  }
  cfg.egress = cfg.network != "off";
  if (cfg.egress_allow_private && cfg.network == "off") {
    err << "sandgate: --egress-allow-private needs a way out (--network veth, proxy or auto, or --egress)\n";
    return false;
  }
  if (a.opts.count("dns-upstream")) {
    cfg.dns_upstream = a.opts["dns-upstream"];
    struct in_addr ia {};
    if (::inet_pton(AF_INET, cfg.dns_upstream.c_str(), &ia) != 1) {
      err << "sandgate: --dns-upstream wants an IPv4 address, not \"" << cfg.dns_upstream << "\"\n";
      return false;
    }
  }
  if ((!cfg.network_range.empty() || !cfg.dns_upstream.empty()) && cfg.network != "veth" && cfg.network != "auto") {
    err << "sandgate: --network-range and --dns-upstream are for --network veth or auto\n";
    return false;
  }
  struct UrlOpt {
    const char* name;
    const char* provider;
    std::string& url;
  };
  for (const UrlOpt& o : {UrlOpt{"openai-base-url", "openai", cfg.openai_base_url},
                          UrlOpt{"anthropic-base-url", "anthropic", cfg.anthropic_base_url}}) {
    auto it = a.opts.find(o.name);
    if (it == a.opts.end()) continue;
    Result<std::string> u = tenancy::check_upstream(o.provider, it->second);
    if (!u) {
      err << "sandgate: --" << o.name << ": " << u.error().message() << "\n";
      return false;
    }
    o.url = *u;
  }
  if (a.opts.count("openai-key-file")) cfg.openai_key_file = a.opts["openai-key-file"];
  if (a.opts.count("anthropic-key-file")) cfg.anthropic_key_file = a.opts["anthropic-key-file"];
  if (a.opts.count("metrics-token-file")) cfg.metrics_token_file = a.opts["metrics-token-file"];
  if (a.opts.count("openai-key-file")) cfg.openai_key_file = a.opts["openai-key-file"];
  if (a.opts.count("anthropic-key-file")) cfg.anthropic_key_file = a.opts["anthropic-key-file"];
  if (a.opts.count("metrics-token-file")) cfg.metrics_token_file = a.opts["metrics-token-file"];
  return true;
}

// The integer serve flags, each with its range.
bool serve_ints(Args& a, AppConfig& cfg, std::ostream& err) {
  struct IntOpt {
    const char* name;
    int64_t lo, hi;
    std::function<void(int64_t)> set;
  };
  std::vector<IntOpt> ints = {
      {"read-timeout-ms", 10, 3600000, [&](int64_t v) { cfg.read_timeout_ms = v; }},
      {"body-limit", 1024, 1LL << 30, [&](int64_t v) { cfg.body_limit = static_cast<size_t>(v); }},
      {"tick-ms", 10, 60000, [&](int64_t v) { cfg.tick_ms = v; }},
      {"drain-timeout-ms", 0, 600000, [&](int64_t v) { cfg.drain_timeout_ms = v; }},
      {"max-connections", 1, 1 << 20, [&](int64_t v) { cfg.max_connections = static_cast<size_t>(v); }},
      {"max-connections-per-address", 1, 1 << 20,
       [&](int64_t v) { cfg.max_connections_per_address = static_cast<size_t>(v); }},
      {"rate", 0, 1000000, [&](int64_t v) { cfg.requests_per_s = static_cast<double>(v); }},
      {"create-rate", 0, 1000000, [&](int64_t v) { cfg.creates_per_s = static_cast<double>(v); }},
      {"llm-body-limit", 1024, 1LL << 30, [&](int64_t v) { cfg.llm_body_limit = static_cast<size_t>(v); }},
      {"llm-rate", 0, 1000000, [&](int64_t v) { cfg.llm_requests_per_s = static_cast<double>(v); }},
      {"llm-tokens-per-min", 0, 1'000'000'000'000LL,
       [&](int64_t v) { cfg.llm_tokens_per_min = static_cast<double>(v); }},
      {"llm-grace-ms", 0, 10000, [&](int64_t v) { cfg.llm_grace_ms = v; }},
      {"llm-cooldown-ms", 0, 600000, [&](int64_t v) { cfg.llm_cooldown_ms = v; }},
      {"offload-min-wait-ms", 0, 3600000, [&](int64_t v) { cfg.offload_min_wait_ms = v; }},
      {"idle-offload-ms", 0, 86400000, [&](int64_t v) { cfg.idle_offload_ms = v; }},
      {"memory-pool-mb", 0, 1 << 20, [&](int64_t v) { cfg.memory_pool_mb = v; }},
      {"zram-mb", 16, 1 << 24, [&](int64_t v) { cfg.zram_mb = v; }},
      {"offload-concurrency", 1, 64, [&](int64_t v) { cfg.offload_concurrency = v; }},
      {"sandbox-disk-mb", 16, 1 << 20, [&](int64_t v) { cfg.sandbox_disk_mb = v; }},
      {"template-builds", 1, 1024, [&](int64_t v) { cfg.template_builds = static_cast<size_t>(v); }},
      {"template-storage-mb", 1, 1LL << 30, [&](int64_t v) { cfg.template_storage_mb = v; }},
      {"template-build-timeout", 1, 86400, [&](int64_t v) { cfg.template_build_timeout_s = v; }},
      {"template-ready-timeout", 1, 3600, [&](int64_t v) { cfg.template_ready_timeout_s = v; }},
      {"warm-pool", 0, 64, [&](int64_t v) { cfg.warm_pool = v; }},
      {"sandbox-bandwidth-mbit", 0, 400000, [&](int64_t v) { cfg.sandbox_bandwidth_mbit = v; }},
      {"sandbox-connections", 0, 1 << 20, [&](int64_t v) { cfg.sandbox_connections = v; }},
      {"cluster-lease-ttl", 2, 60, [&](int64_t v) { cfg.cluster_lease_ttl_s = v; }},
      {"cluster-lost-grace", 0, 86400, [&](int64_t v) { cfg.cluster_lost_grace_s = v; }},
      {"sandbox-uid-base", 65536, 4294967294LL - 65536,
       [&](int64_t v) { cfg.first_sandbox_uid = static_cast<uint32_t>(v); }},
  };
  for (const IntOpt& o : ints) {
    auto it = a.opts.find(o.name);
    if (it == a.opts.end()) continue;
    int64_t v = 0;
    if (!to_int(it->second, v) || v < o.lo || v > o.hi) {
      err << "sandgate: --" << o.name << " wants an integer from " << o.lo << " to " << o.hi << "\n";
      return false;
    }
    o.set(v);
  }
  return true;
}

int run_kvm(const std::vector<std::string>& p, std::ostream& out, std::ostream& err) {
  if (p.size() != 2 || p[1] != "check") {
    err << "usage: sandgate kvm check\n";
    return 2;
  }
  std::string why;
  if (!microvm::kvm_usable(&why)) {
    out << "KVM unusable: " << why << "\n";
    return 1;
  }
  out << "KVM usable: microVMs can run here\n";
  return 0;
}

int run_template(const std::vector<std::string>& p, Args& a, const std::string& data_dir, std::ostream& out,
                 std::ostream& err) {
  bool interpreter = p.size() == 3 && p[2] == kCodeInterpreterTemplate;
  if ((p.size() != 2 && !interpreter) || (p[1] != "build" && p[1] != "image")) {
    err << "usage: sandgate template build|image [code-interpreter-v1] [--templates-dir DIR]\n";
    return 2;
  }
  std::string dir = a.opts.count("templates-dir") ? a.opts["templates-dir"] : data_dir + "/templates";
  Result<std::string> r = ensure_base_template(dir);
  if (r && interpreter) {
    // Its layers; with image, the microVM image merged from them.
    Result<std::vector<std::string>> layers = ensure_code_interpreter_template(dir);
    if (!layers) r = layers.error();
    else if (p[1] == "image") r = microvm::ensure_template_image(*r, *layers);
    else r = layers->back();
  } else if (r && p[1] == "image") {
    r = microvm::ensure_rootfs_image(*r);
  }
  if (!r) {
    err << "sandgate: " << r.error().message() << "\n";
    return 1;
  }
  out << *r << "\n";
  return 0;
}

// The admin commands on the data directory's database: tenant, key, llm.
struct Admin {
  Args& a;
  storage::Store& store;
  tenancy::Tenants tenants;
  std::ostream& out;
  std::ostream& err;

  int fail(const Error& e) { return admin_fail(err, e); }
  bool quota_opt(const char* name, int64_t& v) { return read_quota_opt(a, err, name, v); }
  int tenant(const std::vector<std::string>& p);
  int key(const std::vector<std::string>& p);
};

int Admin::tenant(const std::vector<std::string>& p) {
  const std::string& cmd = p[0];
  std::string sub = p.size() > 1 ? p[1] : "";
  if (cmd == "tenant" && sub == "create" && p.size() == 3) {
    tenancy::Quota q;
    if (!quota_opt("max-sandboxes", q.max_sandboxes) || !quota_opt("max-memory-mb", q.max_memory_mb)) return 2;
    Result<tenancy::CreatedKey> k = tenants.create(p[2], q);
    if (!k) return fail(k.error());
    out << k->key << "\n";
    err << "tenant " << p[2] << " created (max " << q.max_sandboxes << " sandboxes, " << q.max_memory_mb
        << " MB); the key above is shown only once\n";
    return 0;
  }
  if (cmd == "tenant" && sub == "list" && p.size() == 2) {
    Result<std::vector<storage::TenantRow>> ts = store.list_tenants();
    if (!ts) return fail(ts.error());
    print_tenants(out, *ts);
    return 0;
  }
  if (cmd == "tenant" && sub == "set-quota" && p.size() == 3) {
    Result<storage::TenantRow> t = tenants.by_name(p[2]);
    if (!t) return fail(t.error());
    int64_t ms = t->max_sandboxes, mm = t->max_memory_mb;
    if (!quota_opt("max-sandboxes", ms) || !quota_opt("max-memory-mb", mm)) return 2;
    if (Status s = store.set_tenant_limits(t->id, ms, mm); !s) return fail(s.error());
    out << "tenant " << p[2] << ": max " << ms << " sandboxes, " << mm << " MB\n";
    return 0;
  }
  if (cmd == "tenant" && sub == "revoke" && p.size() == 3) {
    Result<storage::TenantRow> t = tenants.by_name(p[2]);
    if (!t) return fail(t.error());
    Result<int64_t> n = store.revoke_tenant(t->id, sys::unix_seconds());
    if (!n) return fail(n.error());
    out << "tenant " << p[2] << " revoked (" << *n << " keys); a running sandgate kills its sandboxes within a second\n";
    return 0;
  }
  return -1;
}

int Admin::key(const std::vector<std::string>& p) {
  const std::string& cmd = p[0];
  std::string sub = p.size() > 1 ? p[1] : "";
  if (cmd == "key" && sub == "create" && p.size() == 3) {
    Result<tenancy::CreatedKey> k = tenants.add_key(p[2]);
    if (!k) return fail(k.error());
    out << k->key << "\n";
    return 0;
  }
  if (cmd == "key" && sub == "list" && p.size() == 3) {
    Result<storage::TenantRow> t = tenants.by_name(p[2]);
    if (!t) return fail(t.error());
    Result<std::vector<storage::ApiKeyRow>> ks = store.list_keys(t->id);
    if (!ks) return fail(ks.error());
    print_keys(out, *ks);
    return 0;
  }
  if (cmd == "key" && sub == "revoke" && p.size() == 3) {
    Result<bool> r = store.revoke_key(p[2], sys::unix_seconds());
    if (!r) return fail(r.error());
    if (!*r) return fail(not_found_error("no active key with id " + p[2]));
    out << "key " << p[2] << " revoked\n";
    return 0;
  }
  return -1;
}

}  // namespace

int run_cli(const std::vector<std::string>& argv, std::ostream& out, std::ostream& err) {
  Args a;
  if (!parse(argv, a, err)) return 2;
  if (a.opts.count("help")) {
    out << kUsage;
    return 0;
  }
  static const std::set<std::string> kKnown = {
      "data-dir", "listen", "templates-dir", "runtime", "agent", "vmm", "guest-dir", "cgroup-parent", "port-file", "read-timeout-ms",
      "body-limit", "max-connections", "max-connections-per-address", "tick-ms", "drain-timeout-ms", "rate", "create-rate", "log-level", "max-sandboxes", "max-memory-mb", "public-url",
      "no-local-tenant", "domain", "tls-cert", "tls-key", "openai-base-url", "openai-key-file",
      "anthropic-base-url", "anthropic-key-file", "llm-body-limit", "llm-rate", "llm-tokens-per-min",
      "llm-grace-ms", "llm-cooldown-ms", "no-llm-pause", "egress", "egress-allow-private", "network", "network-range", "dns-upstream", "sandbox-bandwidth-mbit", "sandbox-connections", "memory-offload", "disk-limit", "keep-sandboxes", "code-interpreter", "user-namespaces", "vmm-jail", "sandbox-uid-base", "sandbox-disk-mb", "offload-min-wait-ms", "idle-offload-ms", "memory-pool-mb", "process-swap", "zram-mb",
      "swap-codec-audit", "template-builds", "template-storage-mb", "template-build-timeout", "template-ready-timeout", "warm-pool",
      "offload-concurrency", "metrics-token-file", "name", "base-url", "key-file", "tenant", "sandbox",
      "cluster", "cluster-secret-file", "node-id", "advertise", "cluster-listen", "cluster-lease-ttl", "cluster-lost-grace"};
  for (const auto& [k, v] : a.opts)
    if (!kKnown.count(k)) {
      err << "sandgate: unknown option --" << k << " (see sandgate --help)\n";
      return 2;
    }
  if (auto it = a.opts.find("log-level"); it != a.opts.end()) {
    static const std::map<std::string, log::Level> kLevels = {
        {"debug", log::Level::kDebug}, {"info", log::Level::kInfo}, {"warn", log::Level::kWarn},
        {"error", log::Level::kError}};
    auto l = kLevels.find(it->second);
    if (l == kLevels.end()) {
      err << "sandgate: unknown --log-level " << it->second << "\n";
      return 2;
    }
    log::set_level(l->second);
  }
  std::string data_dir = a.opts.count("data-dir") ? a.opts["data-dir"] : default_data_dir();
  std::string cmd = a.positional.empty() ? "serve" : a.positional[0];
  const std::vector<std::string>& p = a.positional;

  if (cmd == "version") {
    out << "sandgate " << SANDGATE_VERSION << "\n";
    return 0;
  }
  if (cmd == "help") {
    out << kUsage;
    return 0;
  }
  if (cmd == "serve") {
    AppConfig cfg;
    cfg.data_dir = data_dir;
    if (!serve_flags(a, cfg, err) || !serve_ints(a, cfg, err)) return 2;
    return serve(cfg);
  }
  if (cmd == "kvm") return run_kvm(p, out, err);
  if (cmd == "node") return run_node(p, a, out, err);
  if (cmd == "template") return run_template(p, a, data_dir, out, err);
  if (cmd != "tenant" && cmd != "key" && cmd != "llm") {
    err << "sandgate: unknown command '" << cmd << "'\n" << kUsage;
    return 2;
  }
  if ((cmd == "tenant" || cmd == "key" || (cmd == "llm" && p.size() > 1 && p[1] == "key")) && a.opts.count("cluster"))
    return run_cluster_admin(p, a, out, err);
  if (Status s = sys::make_dirs(data_dir, 0700); !s) {
    err << "sandgate: " << s.error().message() << "\n";
    return 1;
  }
  const std::string db_path = data_dir + "/sandgate.db";
  Result<std::unique_ptr<storage::Store>> store = storage::Store::open(db_path);
  if (!store) {
    err << "sandgate: " << store.error().message() << "\n";
    return 1;
  }
  if (cmd == "llm") return run_llm(p, a, **store, db_path, out, err);
  Admin admin{a, **store, tenancy::Tenants(**store), out, err};
  int rc = cmd == "tenant" ? admin.tenant(p) : admin.key(p);
  if (rc >= 0) return rc;
  err << "sandgate: bad " << cmd << " command\n" << kUsage;
  return 2;
}

}  // namespace sg::gateway
