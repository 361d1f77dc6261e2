// App: the sandgate server process, wired from its parts.
//
// Owns, in order of construction: the Store (SQLite), the Runtime, the
// template registry entries, the tenancy services, the SandboxService, the
// ControlPlane and the HttpServer. Threads (docs/design.md, "Threads"): the
// io threads of the HttpServer, its worker pool (all SQLite and runtime
// work), and the process runtime's spawner thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"

namespace sg::gateway {

struct AppConfig {
  std::string data_dir;       // sandgate.db, sandbox state, local key
  std::string templates_dir;  // template root filesystems (default data_dir/templates)
  std::string listen_address = "127.0.0.1";
  uint16_t port = 3000;       // 0: ephemeral
  std::string runtime = "auto";  // auto | process | kvm
  std::string agent_path;        // default: sandgate-agent beside the sandgate binary
  std::string vmm_path;          // default: sandgate-vmm beside the sandgate binary
  std::string guest_dir;         // microVM guest image (default data_dir/guest)
  std::string cgroup_parent = "sandgate";
  std::string port_file;         // if set, the bound port is written here once listening
  std::string public_url;        // what the banner prints; default http://ADDRESS:PORT
  // Domain for host-based routing ("{port}-{id}.{domain}").
  // Empty: header routing only.
  std::string domain;
  std::string tls_cert_file;  // PEM chain; with tls_key_file: serve HTTPS
  std::string tls_key_file;
  int64_t tick_ms = 1000;
  // At SIGTERM: requests in progress may take this long to finish (drain).
  int64_t drain_timeout_ms = 10000;
  int64_t read_timeout_ms = 30000;
  size_t body_limit = 1 << 20;
  size_t max_connections = 0;              // 0: from the open-file limit (http::ServerConfig)
  size_t max_connections_per_address = 0;  // 0: a quarter of max_connections
  double requests_per_s = 200;  // per tenant
  double creates_per_s = 20;    // per tenant
  int64_t local_max_sandboxes = 50;
  int64_t local_max_memory_mb = 64 * 1024;
  int64_t sandbox_disk_mb = 1024;  // the base template's diskSizeMB: each sandbox's writable layer
  size_t template_builds = 4;            // per tenant, queued or running
  int64_t template_storage_mb = 50 * 1024;  // per tenant: layers, uploads, image roots
  int64_t template_build_timeout_s = 1800;
  int64_t template_ready_timeout_s = 60;  // a start command's ready command, at build end and at create
  int worker_threads = 8;
  bool local_tenant = true;  // create tenant "local" and print its key
  // If set, GET /metrics requires "Authorization: Bearer <token>" with the
  // token this file holds (read once at start, never logged). A hosted
  // deployment sets it; without it /metrics is open (local use).
  std::string metrics_token_file;

  // Model API proxy (wait-engine/llm, docs/llm-gateway.md). Global
  // upstreams; a tenant's own (sandgate llm upstream set) win over these.
  // Key files hold the provider key (read once at start, never logged).
  std::string openai_base_url;      // e.g. https://api.openai.com (empty: none)
  std::string openai_key_file;
  std::string anthropic_base_url;   // e.g. https://api.anthropic.com
  std::string anthropic_key_file;
  size_t llm_body_limit = 32 << 20;          // model request bodies
  double llm_requests_per_s = 50;            // per tenant
  double llm_tokens_per_min = 2'000'000;     // per tenant (input + output)
  // Wait coordinator (wait-engine/coordinator): pause a sandbox that waits
  // on a model after this grace, never sooner than cooldown after a resume.
  bool llm_pause = true;
  // Network egress for sandboxes through the egress proxy, by each one's
  // network policy (docs/egress.md); off: none at all.
  bool egress = false;
  // The proxy also reaches the host's internal networks (loopback, RFC
  // 1918, link-local, ...): for local use and tests, never for tenants.
  bool egress_allow_private = false;
  // How sandboxes get out (docs/networking.md): "veth" (a network of their
  // own per sandbox, policy in nftables: a veth pair each, microVMs a TAP
  // device and virtio-net), "proxy" (the
  // egress proxy, as --egress), "auto" (veth where this host can, else
  // proxy), "off" (loopback only). "": --egress decides (proxy or off).
  std::string network;
  // The veth path's addresses ("10.201.0.0/16"); "": picked (host_network.h).
  std::string network_range;
  // The resolver sandboxes' DNS forwarder asks (IPv4); "": the host's
  // (/etc/resolv.conf).
  std::string dns_upstream;
  // The veth path's limits per sandbox (0: none): Mbit/s each way, open
  // connections.
  int64_t sandbox_bandwidth_mbit = 1000;
  int64_t sandbox_connections = 4096;
  int64_t llm_grace_ms = 30;
  int64_t llm_cooldown_ms = 250;
  // Memory offload of wait-paused microVMs (wait-engine/memory,
  // docs/memory-offload.md): "auto" (under host memory pressure, with
  // hysteresis), "always", "off". The kvm runtime offloads guest RAM
  // into the memory engine; the process backend into swap (below).
  std::string memory_offload = "auto";
  // Where process sandboxes' memory goes (sandbox-runtime/process/swap.h):
  // "zram" (a zram device sandgate makes, zram_mb, 0: half of RAM),
  // "host" (the host's active swap), "off".
  std::string process_swap = "zram";
  int64_t zram_mb = 0;
  // Measure the memory engine's codecs on the pages process sandboxes
  // offload (wait-engine/memory/swap_audit.h); costs CPU on every offload.
  bool swap_codec_audit = false;
  // Size-limited writable layers on the process backend (the template's
  // disk size; sandbox-runtime/process/disk.h): "auto" where loop devices
  // and mkfs.ext4 are available, "on" (a create fails without them), "off".
  std::string disk_limit = "auto";
  // "on": process sandboxes outlive this sandgate (a stop or crash) and the
  // next start on the same data directory takes them back; "off": they
  // end with it.
  std::string keep_sandboxes = "on";
  // The code interpreter template (code-interpreter-v1): "auto" builds it
  // in the background at start when it is missing (apt, a few minutes;
  // creates of it answer 503 meanwhile), "off" leaves it out.
  std::string code_interpreter = "auto";
  // Sandboxes of each hot template with a start command kept started ahead
  // of creates, per tenant (sandbox-runtime/lifecycle/warm_pool.h); -1:
  // 2 on the process backend, 0 on kvm (its clones start with the command
  // already running).
  int64_t warm_pool = -1;
  // Sandbox root as an unprivileged host uid range on the process backend
  // (sandbox-runtime/process/userns.h): "auto", "on", "off".
  std::string user_namespaces = "auto";
  // Each VMM in a jail of its own (sandbox-runtime/vmm/vm/confine.h):
  // "auto", "on", "off".
  std::string vmm_jail = "auto";
  uint32_t first_sandbox_uid = 1u << 30;
  int64_t offload_min_wait_ms = 2000;  // 0: offload every pause
  // A process sandbox idle this long (no traffic, under 1 % of a CPU) goes
  // out to swap without a pause, where memory offload applies; 0: never.
  int64_t idle_offload_ms = 30000;
  int64_t memory_pool_mb = 1024;
  int64_t offload_concurrency = 1;

  // Cluster mode (gateway/cluster.h, docs/cluster.md): empty, one host.
  std::string cluster;              // etcd://host:port[,host:port...]
  std::string cluster_secret_file;  // the secret every node holds (required)
  std::string node_id;              // default: the host name
  // host:port where the other nodes reach this one (default: the listen
  // address and port; required when listening on a wildcard address).
  std::string advertise;
  // A plain-HTTP listener for node-to-node traffic only (forwarded
  // requests and tunnels, with the cluster key): required with TLS, where
  // the client port speaks HTTPS; "" without TLS: the client port serves
  // the nodes too.
  std::string cluster_listen;
  int64_t cluster_lease_ttl_s = 5;
  int64_t cluster_lost_grace_s = 30;
};

// Runs until SIGINT or SIGTERM. Returns the process exit code.
int serve(const AppConfig& cfg);

// The name of the lock file (under /run/sandgate/cgroup-parents) that one
// sandgate holds for its cgroup parent: the parent with '/', '%' and '.'
// percent-escaped, so distinct parents never share a lock.
std::string cgroup_lock_name(const std::string& parent);

// Ensures the base template exists under templates_dir (building it with
// progress on stderr if missing). Returns its rootfs path.
Result<std::string> ensure_base_template(const std::string& templates_dir);

// The code interpreter SDKs' default template (docs/code-interpreter.md).
inline constexpr const char* kCodeInterpreterTemplate = "code-interpreter-v1";

// Ensures the code interpreter template's layers under
// templates_dir/code-interpreter-v1 (building what is missing, with
// progress on stderr; one builder at a time per templates dir, the others
// wait on a lock). Returns its layers, lowest first.
Result<std::vector<std::string>> ensure_code_interpreter_template(const std::string& templates_dir);

}  // namespace sg::gateway
