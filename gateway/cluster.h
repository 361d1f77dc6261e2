// Cluster: this sandgate's place in a cluster of nodes coordinated by etcd
// (docs/cluster.md). Single-host mode has none of it.
//
// What lives in etcd, under the prefix (default "/sandgate/"):
//   nodes/<id>      this node's registration (NodeInfo as JSON), under a
//                   lease it renews every ttl/3; gone when the lease is
//   sandboxes/<id>  the catalog: which node holds sandbox <id> (JSON
//                   {"node","tenant"}), no lease: it outlives its node, so
//                   that the others can report the sandbox lost
//   drain/<id>      set by `sandgate node drain`: place nothing there
//   tenants/<name>, keys/<id>   global tenants and API keys (hashes),
//                   mirrored into each node's SQLite (cluster_tenants.h)
//   quota/<tenant>  the tenant's quota guard; quota/<tenant>/<sandbox>
//                   one reservation per sandbox ({"node","memoryMB"})
//   templates/<id>  a tenant's template, published by the node that built
//                   it, so that others copy it (cluster_templates.h)
// Each node mirrors the whole prefix in memory (one list, then one watch
// from the listed revision; again after any break), so a lookup is a map
// read. The catalog is written by the node that holds a sandbox: at once
// on a create and a kill, and by a reconcile each heartbeat (sandboxes
// that timed out, or came back after a restart).
//
// Threads: a heartbeat thread (lease keepalive, load, reconcile) and a
// watch thread; the accessors are called from the server's workers.
// Thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "base/blocking_http.h"
#include "base/status.h"
#include "base/thread_annotations.h"
#include "storage/etcd.h"
#include "storage/store.h"
#include "tenancy/rate_limiter.h"

namespace sg::gateway {

struct NodeInfo {
  std::string id;
  std::string address;  // host:port where peers reach this node's HTTP server
  std::string backend;  // "process" | "kvm"
  // Capacity.
  int64_t memory_mb = 0, cpus = 0, disk_mb = 0, max_sandboxes = 0;
  // Load, as of the last heartbeat.
  int64_t sandboxes = 0, memory_used_mb = 0;
  bool draining = false;  // from drain/<id>, not from the node's own record
};

std::string node_json(const NodeInfo& n);
Result<NodeInfo> parse_node(const std::string& json);

// Where everything of a cluster lives in etcd.
inline constexpr const char* kClusterPrefix = "/sandgate/";

struct ClusterConfig {
  std::vector<net::Endpoint> etcd;
  std::string prefix = kClusterPrefix;
  NodeInfo self;  // id, address, backend, capacity
  std::string secret;  // the cluster secret every forwarded request carries
  int64_t lease_ttl_s = 5;
  // A node whose lease has expired: its sandboxes are answered "node
  // unreachable" (503, retry) for this long, then "lost" (404).
  std::chrono::milliseconds lost_grace{30000};
  std::chrono::milliseconds etcd_timeout{2000};
  // Lookups of sandbox ids the mirror does not hold go to etcd (a sandbox
  // made elsewhere a moment ago); at most this many a second, so a
  // client probing made-up ids cannot turn its requests into etcd load.
  double miss_lookups_per_s = 200;
};

// What the node reports each heartbeat.
struct NodeLoad {
  int64_t sandboxes = 0, memory_used_mb = 0;
  std::vector<std::string> sandbox_ids;  // every sandbox this node holds
};

// Where a sandbox id leads.
struct Owner {
  enum class Where { kHere, kPeer, kUnreachable, kLost, kUnknown };
  Where where = Where::kUnknown;
  NodeInfo node;  // kPeer: the node to forward to; kUnreachable/kLost: its id
};

class Cluster {
 public:
  // mirror: the SQLite the cluster's tenants and keys are mirrored into
  // (null: none, for tests of membership alone).
  Cluster(ClusterConfig cfg, std::function<NodeLoad()> load, storage::Store* mirror = nullptr);
  ~Cluster();
  Cluster(const Cluster&) = delete;
  Cluster& operator=(const Cluster&) = delete;

  // Where peers reach this node, once its server is bound (before join).
  void set_address(std::string address) { cfg_.self.address = std::move(address); }
  // Registers this node and mirrors the cluster; starts the threads. An
  // error (etcd unreachable, the id held by a live node) fails the start.
  Status join();
  // Revokes the lease (the registration goes at once) and stops the threads.
  void leave();

  // True while this node's lease is live (a partitioned node loses it and
  // stops accepting creates).
  bool member() const { return member_.load(); }
  const NodeInfo& self() const { return cfg_.self; }
  const std::string& prefix() const { return cfg_.prefix; }
  etcd::Client& etcd() { return etcd_; }
  const std::string& secret() const { return cfg_.secret; }

  // Live nodes (registered), by id; draining ones included, flagged.
  std::vector<NodeInfo> nodes() const;
  Owner owner_of(const std::string& sandbox_id);
  // True when the mirror places the sandbox on this node (no etcd read).
  bool mirrored_here(const std::string& sandbox_id) const;
  // Catalog writes for sandboxes this node holds.
  Status record(const std::string& sandbox_id, const std::string& tenant);
  Status forget(const std::string& sandbox_id);

  // Reserves sandbox row.id against its tenant's limits across the
  // cluster (quota/<tenant>/<id>, written in a transaction guarded by the
  // tenant's quota key, so concurrent creates on different nodes cannot
  // both take the last slot). kQuota when over; kUnavailable without etcd.
  Status reserve(const storage::TenantRow& tenant, const std::string& sandbox_id, int64_t memory_mb);

  // The nodes to try for a create, in order: two live, non-draining nodes
  // with room for memory_mb drawn at random, the less loaded first, then
  // the rest by load (power of two choices, with fallbacks for refusals).
  std::vector<NodeInfo> placement(int64_t memory_mb);

  // The templates/ records: key = template id, value, mod_revision.
  std::vector<etcd::KeyValue> template_records() const;

  // Prometheus text: cluster gauges.
  std::string metrics() const;

  // Operations on any cluster, without joining it (sandgate node ...).
  static Result<std::vector<NodeInfo>> list_nodes(etcd::Client& etcd, const std::string& prefix);
  static Status set_drain(etcd::Client& etcd, const std::string& prefix, const std::string& node_id, bool drain);
  // Forgets a node: its registration, drain mark and catalog entries (its
  // sandboxes are lost for good). Refused while the node is live.
  static Result<int64_t> remove_node(etcd::Client& etcd, const std::string& prefix, const std::string& node_id);

 private:
  void heartbeat_loop();
  void watch_loop();
  Status register_self();
  void reconcile();
  void apply(const std::string& key, const std::optional<std::string>& value, int64_t mod_revision)
      REQUIRES(mu_);
  void apply_all(const std::vector<etcd::KeyValue>& kvs) REQUIRES(mu_);
  bool sleep_for(std::chrono::milliseconds d);  // false when stopping

  ClusterConfig cfg_;
  std::function<NodeLoad()> load_;
  etcd::Client etcd_;
  std::atomic<bool> member_{false};
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> lease_{0};
  // When the lease was last renewed (the heartbeat thread's own).
  std::chrono::steady_clock::time_point last_renewal_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  struct Entry {
    std::string node, tenant;
    int64_t mod_revision = 0;
  };
  std::map<std::string, NodeInfo> nodes_ GUARDED_BY(mu_);
  std::map<std::string, bool> drain_ GUARDED_BY(mu_);
  std::map<std::string, Entry> catalog_ GUARDED_BY(mu_);
  struct Reservation {
    std::string key, node;
    int64_t mod_revision = 0;
  };
  std::map<std::string, Reservation> reservations_ GUARDED_BY(mu_);  // by sandbox id
  std::map<std::string, etcd::KeyValue> templates_ GUARDED_BY(mu_);  // by template id
  // Reservations of this node with no live sandbox at the last reconcile:
  // deleted if still so at the next (a create reserves before its row).
  std::set<std::string> suspect_;  // the heartbeat thread's own
  storage::Store* const mirror_;
  // Nodes whose registration went away, and when (for the lost grace).
  std::map<std::string, std::chrono::steady_clock::time_point> gone_ GUARDED_BY(mu_);
  bool mirrored_ GUARDED_BY(mu_) = false;
  std::mt19937_64 rng_ GUARDED_BY(mu_);

  tenancy::RateLimiter miss_lookups_;
  std::thread heartbeat_, watcher_;
};

// Node-to-node forwarding (docs/cluster.md, "Forwarding").
namespace cluster_wire {
inline constexpr const char* kSecretHeader = "x-sandgate-cluster-key";
inline constexpr const char* kTenantHeader = "x-sandgate-tenant";
inline constexpr const char* kPathHeader = "x-sandgate-path";
}  // namespace cluster_wire

}  // namespace sg::gateway
