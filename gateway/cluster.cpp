// Implementation of cluster membership, the catalog mirror and placement
// (cluster.h, docs/cluster.md).
#include "gateway/cluster.h"

#include <algorithm>
#include <sstream>

#include <nlohmann/json.hpp>

#include "base/log.h"
#include "base/sys.h"
#include "gateway/cluster_tenants.h"

namespace sg::gateway {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

std::string node_json(const NodeInfo& n) {
  return json{{"id", n.id},
              {"address", n.address},
              {"backend", n.backend},
              {"capacity", {{"memoryMB", n.memory_mb}, {"cpus", n.cpus}, {"diskMB", n.disk_mb}, {"maxSandboxes", n.max_sandboxes}}},
              {"load", {{"sandboxes", n.sandboxes}, {"memoryMB", n.memory_used_mb}}}}
      .dump();
}

Result<NodeInfo> parse_node(const std::string& text) {
  json j = json::parse(text, nullptr, false);
  if (!j.is_object() || !j.contains("id") || !j["id"].is_string() || !j.contains("address") || !j["address"].is_string())
    return invalid_error("malformed node record");
  NodeInfo n;
  n.id = j["id"].get<std::string>();
  n.address = j["address"].get<std::string>();
  n.backend = j.value("backend", std::string());
  auto get = [](const json& o, const char* k) -> int64_t {
    auto it = o.find(k);
    return it != o.end() && it->is_number_integer() ? it->get<int64_t>() : 0;
  };
  if (auto c = j.find("capacity"); c != j.end() && c->is_object()) {
    n.memory_mb = get(*c, "memoryMB");
    n.cpus = get(*c, "cpus");
    n.disk_mb = get(*c, "diskMB");
    n.max_sandboxes = get(*c, "maxSandboxes");
  }
  if (auto l = j.find("load"); l != j.end() && l->is_object()) {
    n.sandboxes = get(*l, "sandboxes");
    n.memory_used_mb = get(*l, "memoryMB");
  }
  return n;
}

namespace {
std::string nodes_key(const std::string& prefix, const std::string& id) { return prefix + "nodes/" + id; }
std::string drain_key(const std::string& prefix, const std::string& id) { return prefix + "drain/" + id; }
std::string sandbox_key(const std::string& prefix, const std::string& id) { return prefix + "sandboxes/" + id; }

// The share of a node in use, for placement: the larger of memory and
// sandbox count against capacity.
double load_of(const NodeInfo& n) {
  double mem = n.memory_mb > 0 ? static_cast<double>(n.memory_used_mb) / static_cast<double>(n.memory_mb) : 0;
  double cnt = n.max_sandboxes > 0 ? static_cast<double>(n.sandboxes) / static_cast<double>(n.max_sandboxes) : 0;
  return std::max(mem, cnt);
}
}  // namespace

Cluster::Cluster(ClusterConfig cfg, std::function<NodeLoad()> load, storage::Store* mirror)
    : cfg_(std::move(cfg)),
      load_(std::move(load)),
      etcd_(cfg_.etcd, cfg_.etcd_timeout),
      mirror_(mirror),
      rng_(std::random_device{}()),
      miss_lookups_(cfg_.miss_lookups_per_s, cfg_.miss_lookups_per_s * 2, [] { return sys::monotonic_ns(); }) {}

Cluster::~Cluster() { leave(); }

Status Cluster::register_self() {
  NodeInfo me = cfg_.self;
  NodeLoad l = load_();
  me.sandboxes = l.sandboxes;
  me.memory_used_mb = l.memory_used_mb;
  Result<int64_t> lease = etcd_.grant(cfg_.lease_ttl_s);
  if (!lease) return lease.error();
  // The id is this node's while its lease lives: a second node started
  // with the same id is refused, not merged.
  std::string key = nodes_key(cfg_.prefix, me.id);
  Result<etcd::TxnResult> t = etcd_.txn({etcd::Compare{key, "VERSION", "EQUAL", 0, {}}},
                                        {etcd::Op::put(key, node_json(me), *lease)});
  if (!t) return t.error();
  if (!t->succeeded) {
    (void)etcd_.revoke(*lease);
    Result<etcd::RangeResult> cur = etcd_.get(key);
    // Our own registration from before a restart, under a lease not yet
    // expired: take the id over.
    if (cur && !cur->kvs.empty()) {
      Result<NodeInfo> other = parse_node(cur->kvs[0].value);
      if (other && other->address != me.address)
        return conflict_error("node id \"" + me.id + "\" is held by a live node at " + other->address +
                              ": give this node another --node-id");
    }
    lease = etcd_.grant(cfg_.lease_ttl_s);
    if (!lease) return lease.error();
    Result<int64_t> p = etcd_.put(key, node_json(me), *lease);
    if (!p) return p.error();
  }
  lease_.store(*lease);
  last_renewal_ = Clock::now();
  member_.store(true);
  return Status();
}

Status Cluster::join() {
  if (Status s = register_self(); !s) return s.error().with_context("join the cluster at " + cfg_.etcd[0].str());
  // The first mirror before serving: lookups must not miss what exists.
  Result<etcd::RangeResult> all = etcd_.get_prefix(cfg_.prefix);
  if (!all) return all.error().with_context("read the cluster state");
  {
    std::lock_guard<std::mutex> g(mu_);
    apply_all(all->kvs);
    mirrored_ = true;
  }
  int64_t from = all->revision + 1;
  watcher_ = std::thread([this, from] {
    int64_t rev = from;
    int failures = 0;  // in a row: the first is logged, then every 20th
    while (!stop_.load()) {
      Status s = etcd_.watch_prefix(
          cfg_.prefix, rev,
          [&](const std::vector<etcd::Event>& events, int64_t) {
            std::lock_guard<std::mutex> g(mu_);
            for (const etcd::Event& e : events) {
              apply(e.kv.key, e.type == etcd::Event::Type::kPut ? std::optional<std::string>(e.kv.value) : std::nullopt,
                    e.kv.mod_revision);
              rev = std::max(rev, e.kv.mod_revision + 1);
            }
            return !stop_.load();
          },
          stop_);
      if (stop_.load()) break;
      if (failures++ % 20 == 0) LOG_WARN("cluster: watch: " << s.error().message() << "; listing again");
      if (!sleep_for(std::chrono::milliseconds(500))) break;
      // Re-list: what changed while the watch was down, deletes included.
      Result<etcd::RangeResult> again = etcd_.get_prefix(cfg_.prefix);
      if (!again) continue;
      if (failures > 1) LOG_INFO("cluster: watching etcd again after " << failures << " failed tries");
      failures = 0;
      std::lock_guard<std::mutex> g(mu_);
      std::map<std::string, NodeInfo> old_nodes = nodes_;
      nodes_.clear();
      drain_.clear();
      catalog_.clear();
      reservations_.clear();
      templates_.clear();
      apply_all(again->kvs);
      for (const auto& [id, n] : old_nodes)
        if (!nodes_.count(id) && !gone_.count(id)) gone_[id] = Clock::now();
      rev = again->revision + 1;
    }
  });
  heartbeat_ = std::thread([this] { heartbeat_loop(); });
  LOG_INFO("cluster: joined as node " << cfg_.self.id << " (" << cfg_.self.address << ") via etcd " << cfg_.etcd[0].str());
  return Status();
}

void Cluster::leave() {
  if (stop_.exchange(true)) return;
  cv_.notify_all();
  if (heartbeat_.joinable()) heartbeat_.join();
  if (watcher_.joinable()) watcher_.join();
  if (int64_t lease = lease_.exchange(0); lease != 0) {
    if (Status s = etcd_.revoke(lease); !s) LOG_WARN("cluster: leave: " << s.error().message());
  }
  member_.store(false);
}

bool Cluster::sleep_for(std::chrono::milliseconds d) {
  std::unique_lock<std::mutex> g(mu_);
  cv_.wait_for(g, d, [&] { return stop_.load(); });
  return !stop_.load();
}

void Cluster::apply_all(const std::vector<etcd::KeyValue>& kvs) {
  // Tenants before their keys (keys/ sorts first).
  for (const etcd::KeyValue& kv : kvs)
    if (kv.key.compare(0, cfg_.prefix.size() + 8, cfg_.prefix + "tenants/") == 0) apply(kv.key, kv.value, kv.mod_revision);
  for (const etcd::KeyValue& kv : kvs)
    if (kv.key.compare(0, cfg_.prefix.size() + 8, cfg_.prefix + "tenants/") != 0) apply(kv.key, kv.value, kv.mod_revision);
}

void Cluster::apply(const std::string& key, const std::optional<std::string>& value, int64_t mod_revision) {
  if (key.compare(0, cfg_.prefix.size(), cfg_.prefix) != 0) return;
  std::string rest = key.substr(cfg_.prefix.size());
  auto under = [&](const char* dir, std::string* id) {
    size_t n = std::char_traits<char>::length(dir);
    if (rest.compare(0, n, dir) != 0) return false;
    *id = rest.substr(n);
    return !id->empty();
  };
  std::string id;
  if (under("nodes/", &id)) {
    if (!value) {
      nodes_.erase(id);
      gone_[id] = Clock::now();
      return;
    }
    Result<NodeInfo> n = parse_node(*value);
    if (!n) return;
    n->draining = drain_.count(id) > 0;
    nodes_[id] = *n;
    gone_.erase(id);
  } else if (under("drain/", &id)) {
    if (value) drain_[id] = true;
    else drain_.erase(id);
    if (auto it = nodes_.find(id); it != nodes_.end()) it->second.draining = value.has_value();
  } else if (under("tenants/", &id) || under("keys/", &id) || under("llmkeys/", &id)) {
    // Never deleted (revocation is a flag): only puts are mirrored.
    if (!value || !mirror_) return;
    bool tenant = rest.compare(0, 8, "tenants/") == 0;
    Status s;
    if (tenant) {
      Result<storage::TenantRow> t = cluster_tenants::parse_tenant(*value);
      s = t ? mirror_->upsert_tenant(*t) : Status(t.error());
    } else if (rest.compare(0, 8, "llmkeys/") == 0) {
      Result<storage::LlmKeyRow> k = cluster_tenants::parse_llm_key(*value);
      s = k ? mirror_->upsert_llm_key(*k) : Status(k.error());
    } else {
      Result<storage::ApiKeyRow> k = cluster_tenants::parse_key(*value);
      s = k ? mirror_->upsert_key(*k) : Status(k.error());
    }
    if (!s) LOG_ERROR("cluster: mirror " << rest << ": " << s.error().message());
  } else if (under("quota/", &id)) {
    size_t slash = id.find('/');
    if (slash == std::string::npos) return;  // a tenant's guard key
    std::string sandbox = id.substr(slash + 1);
    if (!value) {
      reservations_.erase(sandbox);
      return;
    }
    json j = json::parse(*value, nullptr, false);
    if (!j.is_object()) return;
    reservations_[sandbox] = Reservation{key, j.value("node", std::string()), mod_revision};
  } else if (under("templates/", &id)) {
    if (!value) templates_.erase(id);
    else {
      etcd::KeyValue& kv = templates_[id];
      kv.key = id;
      kv.value = *value;
      kv.mod_revision = mod_revision;
    }
  } else if (under("sandboxes/", &id)) {
    if (!value) {
      catalog_.erase(id);
      return;
    }
    json j = json::parse(*value, nullptr, false);
    if (!j.is_object() || !j.contains("node") || !j["node"].is_string()) return;
    catalog_[id] = Entry{j["node"].get<std::string>(), j.value("tenant", std::string()), mod_revision};
  }
}

void Cluster::heartbeat_loop() {
  auto every = std::chrono::milliseconds(std::max<int64_t>(300, cfg_.lease_ttl_s * 1000 / 3));
  int failures = 0;  // keepalives in a row that found no etcd: the first is logged, then every 20th
  while (sleep_for(every)) {
    int64_t lease = lease_.load();
    Result<int64_t> ttl = lease ? etcd_.keep_alive(lease) : Result<int64_t>(not_found_error("no lease"));
    if (!ttl) {
      if (ttl.error().kind() == ErrorKind::kNotFound) {
        // Expired (a partition longer than the TTL): the others have
        // dropped this node. Join again under a new lease.
        if (member_.exchange(false)) LOG_WARN("cluster: lease lost: " << ttl.error().message() << "; registering again");
        if (Status s = register_self(); !s) LOG_WARN("cluster: register: " << s.error().message());
      } else {
        if (failures++ % 20 == 0) LOG_WARN("cluster: keepalive: " << ttl.error().message());
        // Not renewed within the TTL: it has expired for the others, who
        // stop sending creates here; so does this node.
        if (Clock::now() - last_renewal_ > std::chrono::seconds(cfg_.lease_ttl_s) && member_.exchange(false))
          LOG_WARN("cluster: no contact with etcd for " << cfg_.lease_ttl_s << " s: refusing creates until it is back");
        continue;
      }
    }
    last_renewal_ = Clock::now();
    failures = 0;
    member_.store(true);
    // Load and the catalog, with the lease renewed.
    NodeInfo me = cfg_.self;
    NodeLoad l = load_();
    me.sandboxes = l.sandboxes;
    me.memory_used_mb = l.memory_used_mb;
    if (Result<int64_t> p = etcd_.put(nodes_key(cfg_.prefix, me.id), node_json(me), lease_.load()); !p) {
      LOG_WARN("cluster: heartbeat: " << p.error().message());
      continue;
    }
    reconcile();
  }
}

void Cluster::reconcile() {
  // The catalog first, then this node's sandboxes (read again, not the
  // heartbeat's load from before its put): a sandbox made in between is
  // then in the second and not the first, and is recorded, never dropped.
  std::map<std::string, int64_t> listed;  // ours in the catalog: id -> mod revision
  {
    std::lock_guard<std::mutex> g(mu_);
    for (const auto& [id, e] : catalog_)
      if (e.node == cfg_.self.id) listed[id] = e.mod_revision;
  }
  NodeLoad l = load_();
  std::sort(l.sandbox_ids.begin(), l.sandbox_ids.end());
  for (const std::string& id : l.sandbox_ids)
    if (!listed.count(id)) (void)record(id, "");
  for (const auto& [id, rev] : listed) {
    if (std::binary_search(l.sandbox_ids.begin(), l.sandbox_ids.end(), id)) continue;
    // Gone here (timed out, killed): delete unless rewritten since.
    std::string key = sandbox_key(cfg_.prefix, id);
    (void)etcd_.txn({etcd::Compare{key, "MOD", "EQUAL", rev, {}}}, {etcd::Op::del(key)});
  }
  // Reservations of sandboxes that are not live here (ended, or a create
  // that failed after reserving): released at the second sighting.
  std::vector<Reservation> stale;
  std::set<std::string> suspect;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (const auto& [id, r] : reservations_) {
      if (r.node != cfg_.self.id || std::binary_search(l.sandbox_ids.begin(), l.sandbox_ids.end(), id)) continue;
      if (suspect_.count(id)) stale.push_back(r);
      else suspect.insert(id);
    }
  }
  suspect_ = std::move(suspect);
  for (const Reservation& r : stale)
    (void)etcd_.txn({etcd::Compare{r.key, "MOD", "EQUAL", r.mod_revision, {}}}, {etcd::Op::del(r.key)});
}

Status Cluster::reserve(const storage::TenantRow& tenant, const std::string& sandbox_id, int64_t memory_mb) {
  const std::string guard = cfg_.prefix + "quota/" + tenant.name;
  const std::string mine = guard + "/" + sandbox_id;
  json value{{"node", cfg_.self.id}, {"memoryMB", memory_mb}};
  for (int attempt = 0; attempt < 32; ++attempt) {
    // The guard and the reservations in one read (one revision): a
    // reservation made after it changes the guard's version, so the
    // transaction below fails and this reads again. (The range also holds
    // tenants whose names extend this one's: skipped.)
    Result<etcd::RangeResult> held = etcd_.get_prefix(guard);
    if (!held) return Error(ErrorKind::kUnavailable, "cluster quota: " + held.error().message());
    int64_t version = 0, count = 0, memory = 0;
    for (const etcd::KeyValue& kv : held->kvs) {
      if (kv.key == guard) {
        version = kv.version;
        continue;
      }
      if (kv.key.compare(0, guard.size() + 1, guard + "/") != 0) continue;
      ++count;
      json j = json::parse(kv.value, nullptr, false);
      if (j.is_object()) memory += j.value("memoryMB", int64_t{0});
    }
    if (count + 1 > tenant.max_sandboxes)
      return Error(ErrorKind::kQuota, "sandbox quota exceeded: tenant '" + tenant.name + "' has " + std::to_string(count) +
                                          " of " + std::to_string(tenant.max_sandboxes) + " sandboxes across the cluster");
    if (memory + memory_mb > tenant.max_memory_mb)
      return Error(ErrorKind::kQuota, "memory quota exceeded: tenant '" + tenant.name + "' uses " + std::to_string(memory) +
                                          " of " + std::to_string(tenant.max_memory_mb) + " MiB across the cluster");
    Result<etcd::TxnResult> t = etcd_.txn({etcd::Compare{guard, "VERSION", "EQUAL", version, {}}},
                                          {etcd::Op::put(guard, sandbox_id), etcd::Op::put(mine, value.dump())});
    if (!t) return Error(ErrorKind::kUnavailable, "cluster quota: " + t.error().message());
    if (t->succeeded) {
      std::lock_guard<std::mutex> lk(mu_);
      reservations_[sandbox_id] = Reservation{mine, cfg_.self.id, t->revision};
      return Status();
    }
  }
  return Error(ErrorKind::kUnavailable, "cluster quota: too many concurrent creates for tenant '" + tenant.name + "'; retry");
}

std::vector<etcd::KeyValue> Cluster::template_records() const {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<etcd::KeyValue> out;
  out.reserve(templates_.size());
  for (const auto& [id, kv] : templates_) out.push_back(kv);
  return out;
}

std::vector<NodeInfo> Cluster::nodes() const {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<NodeInfo> out;
  for (const auto& [id, n] : nodes_) out.push_back(n);
  return out;
}

bool Cluster::mirrored_here(const std::string& sandbox_id) const {
  std::lock_guard<std::mutex> g(mu_);
  auto it = catalog_.find(sandbox_id);
  return it != catalog_.end() && it->second.node == cfg_.self.id;
}

Owner Cluster::owner_of(const std::string& sandbox_id) {
  Owner o;
  std::string node;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (auto it = catalog_.find(sandbox_id); it != catalog_.end()) node = it->second.node;
  }
  if (node.empty()) {
    // Not mirrored yet (created a moment ago elsewhere): ask etcd, within
    // the budget for misses.
    if (miss_lookups_.acquire("miss") > 0) return o;
    Result<etcd::RangeResult> r = etcd_.get(sandbox_key(cfg_.prefix, sandbox_id));
    if (!r || r->kvs.empty()) return o;
    json j = json::parse(r->kvs[0].value, nullptr, false);
    if (!j.is_object() || !j.contains("node") || !j["node"].is_string()) return o;
    node = j["node"].get<std::string>();
  }
  if (node == cfg_.self.id) {
    o.where = Owner::Where::kHere;
    o.node = cfg_.self;
    return o;
  }
  std::lock_guard<std::mutex> g(mu_);
  if (auto it = nodes_.find(node); it != nodes_.end()) {
    o.where = Owner::Where::kPeer;
    o.node = it->second;
    return o;
  }
  o.node.id = node;
  auto gone = gone_.find(node);
  bool recent = gone != gone_.end() && Clock::now() - gone->second < cfg_.lost_grace;
  o.where = recent ? Owner::Where::kUnreachable : Owner::Where::kLost;
  return o;
}

Status Cluster::record(const std::string& sandbox_id, const std::string& tenant) {
  json v{{"node", cfg_.self.id}};
  if (!tenant.empty()) v["tenant"] = tenant;
  Result<int64_t> r = etcd_.put(sandbox_key(cfg_.prefix, sandbox_id), v.dump());
  if (!r) return r.error();
  std::lock_guard<std::mutex> g(mu_);
  catalog_[sandbox_id] = Entry{cfg_.self.id, tenant, *r};
  return Status();
}

Status Cluster::forget(const std::string& sandbox_id) {
  std::string key = sandbox_key(cfg_.prefix, sandbox_id);
  // Only our own entry: a sandbox the catalog moved is not ours to drop.
  Result<etcd::RangeResult> cur = etcd_.get(key);
  if (!cur) return cur.error();
  if (cur->kvs.empty()) return Status();
  json j = json::parse(cur->kvs[0].value, nullptr, false);
  if (!j.is_object() || j.value("node", std::string()) != cfg_.self.id) return Status();
  std::vector<etcd::Op> ops = {etcd::Op::del(key)};
  {
    std::lock_guard<std::mutex> g(mu_);
    if (auto it = reservations_.find(sandbox_id); it != reservations_.end()) ops.push_back(etcd::Op::del(it->second.key));
  }
  Result<etcd::TxnResult> t = etcd_.txn({etcd::Compare{key, "MOD", "EQUAL", cur->kvs[0].mod_revision, {}}}, ops);
  if (!t) return t.error();
  std::lock_guard<std::mutex> g(mu_);
  catalog_.erase(sandbox_id);
  return Status();
}

std::vector<NodeInfo> Cluster::placement(int64_t memory_mb) {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<NodeInfo> fits;
  for (const auto& [id, n] : nodes_) {
    if (n.draining) continue;
    if (n.memory_mb > 0 && n.memory_used_mb + memory_mb > n.memory_mb) continue;
    if (n.max_sandboxes > 0 && n.sandboxes >= n.max_sandboxes) continue;
    fits.push_back(n);
  }
  // This node's own view of itself may be fresher than its record.
  if (fits.size() <= 2) {
    std::sort(fits.begin(), fits.end(), [](const NodeInfo& a, const NodeInfo& b) { return load_of(a) < load_of(b); });
    return fits;
  }
  std::shuffle(fits.begin(), fits.end(), rng_);
  if (load_of(fits[1]) < load_of(fits[0])) std::swap(fits[0], fits[1]);
  std::sort(fits.begin() + 2, fits.end(), [](const NodeInfo& a, const NodeInfo& b) { return load_of(a) < load_of(b); });
  return fits;
}

std::string Cluster::metrics() const {
  std::ostringstream o;
  std::lock_guard<std::mutex> g(mu_);
  int64_t mine = 0;
  for (const auto& [id, e] : catalog_)
    if (e.node == cfg_.self.id) ++mine;
  o << "# HELP sandgate_cluster_member 1 while this node holds a live lease in the cluster.\n"
    << "# TYPE sandgate_cluster_member gauge\nsandgate_cluster_member " << (member_.load() ? 1 : 0) << "\n"
    << "# HELP sandgate_cluster_nodes Live nodes in the cluster, as this node sees them.\n"
    << "# TYPE sandgate_cluster_nodes gauge\nsandgate_cluster_nodes " << nodes_.size() << "\n"
    << "# HELP sandgate_cluster_sandboxes Sandboxes in the cluster catalog.\n"
    << "# TYPE sandgate_cluster_sandboxes gauge\nsandgate_cluster_sandboxes " << catalog_.size() << "\n"
    << "# HELP sandgate_cluster_node_sandboxes Sandboxes the catalog places on this node.\n"
    << "# TYPE sandgate_cluster_node_sandboxes gauge\nsandgate_cluster_node_sandboxes " << mine << "\n";
  return o.str();
}

Result<std::vector<NodeInfo>> Cluster::list_nodes(etcd::Client& etcd, const std::string& prefix) {
  Result<etcd::RangeResult> nodes = etcd.get_prefix(prefix + "nodes/");
  if (!nodes) return nodes.error();
  Result<etcd::RangeResult> drains = etcd.get_prefix(prefix + "drain/");
  if (!drains) return drains.error();
  std::vector<NodeInfo> out;
  for (const etcd::KeyValue& kv : nodes->kvs) {
    Result<NodeInfo> n = parse_node(kv.value);
    if (!n) continue;
    for (const etcd::KeyValue& d : drains->kvs)
      if (d.key == drain_key(prefix, n->id)) n->draining = true;
    out.push_back(*n);
  }
  return out;
}

Status Cluster::set_drain(etcd::Client& etcd, const std::string& prefix, const std::string& node_id, bool drain) {
  if (drain) {
    Result<int64_t> r = etcd.put(drain_key(prefix, node_id), "1");
    if (!r) return r.error();
    return Status();
  }
  Result<int64_t> r = etcd.remove(drain_key(prefix, node_id));
  if (!r) return r.error();
  return Status();
}

Result<int64_t> Cluster::remove_node(etcd::Client& etcd, const std::string& prefix, const std::string& node_id) {
  Result<etcd::RangeResult> live = etcd.get(nodes_key(prefix, node_id));
  if (!live) return live.error();
  if (!live->kvs.empty())
    return conflict_error("node \"" + node_id + "\" is live: stop it (or drain it) first; its registration goes with its lease");
  // Its catalog entries and quota reservations, each unless rewritten
  // meanwhile; the count is of the catalog's.
  auto drop_entries_of = [&](const std::string& dir) -> Result<int64_t> {
    Result<etcd::RangeResult> all = etcd.get_prefix(prefix + dir);
    if (!all) return all.error();
    int64_t dropped = 0;
    for (const etcd::KeyValue& kv : all->kvs) {
      json j = json::parse(kv.value, nullptr, false);
      if (!j.is_object() || j.value("node", std::string()) != node_id) continue;
      Result<etcd::TxnResult> t =
          etcd.txn({etcd::Compare{kv.key, "MOD", "EQUAL", kv.mod_revision, {}}}, {etcd::Op::del(kv.key)});
      if (!t) return t.error();
      if (t->succeeded) ++dropped;
    }
    return dropped;
  };
  Result<int64_t> removed = drop_entries_of("sandboxes/");
  if (!removed) return removed.error();
  if (Result<int64_t> q = drop_entries_of("quota/"); !q) return q.error();
  // Its templates: their files went with it (copies elsewhere are dropped).
  if (Result<int64_t> t = drop_entries_of("templates/"); !t) return t.error();
  if (Result<int64_t> r = etcd.remove(drain_key(prefix, node_id)); !r) return r.error();
  return *removed;
}

}  // namespace sg::gateway
