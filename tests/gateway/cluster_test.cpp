// Cluster membership, the catalog mirror, placement and node operations
// against a real etcd member (tests/support/etcd_server.h), with made-up
// node loads: two (or three) Cluster objects in one process.
#include "gateway/cluster.h"
#include "gateway/cluster_tenants.h"

#include <doctest/doctest.h>

#include <mutex>
#include <set>
#include <thread>

#include "tests/support/etcd_server.h"
#include "tests/support/eventually.h"
#include "tests/support/temp_dir.h"
#include "tests/support/test_store.h"
#include "tenancy/llm_keys.h"
#include "tenancy/tenants.h"

namespace sg::gateway {
namespace {

struct FakeLoad {
  std::mutex mu;
  std::vector<std::string> ids;
  int64_t memory_mb = 0;
  NodeLoad operator()() {
    std::lock_guard<std::mutex> g(mu);
    NodeLoad l;
    l.sandbox_ids = ids;
    l.sandboxes = static_cast<int64_t>(ids.size());
    l.memory_used_mb = memory_mb;
    return l;
  }
};

ClusterConfig config(const test::EtcdCluster& etcd, const std::string& id, int64_t memory_mb = 1000) {
  ClusterConfig c;
  c.etcd = etcd.endpoints();
  c.self.id = id;
  c.self.address = "127.0.0.1:" + std::to_string(10000 + id.size() * 7 + static_cast<unsigned char>(id[0]));
  c.self.backend = "process";
  c.self.memory_mb = memory_mb;
  c.secret = "0123456789abcdef0123";
  c.lease_ttl_s = 2;
  c.lost_grace = std::chrono::milliseconds(0);
  return c;
}

std::set<std::string> ids_of(const std::vector<NodeInfo>& nodes) {
  std::set<std::string> s;
  for (const NodeInfo& n : nodes) s.insert(n.id);
  return s;
}

TEST_CASE("cluster: node records round-trip") {
  NodeInfo n;
  n.id = "n1";
  n.address = "10.0.0.1:3000";
  n.backend = "kvm";
  n.memory_mb = 1024;
  n.cpus = 4;
  n.sandboxes = 3;
  n.memory_used_mb = 300;
  Result<NodeInfo> back = parse_node(node_json(n));
  REQUIRE(back);
  CHECK(back->id == "n1");
  CHECK(back->address == "10.0.0.1:3000");
  CHECK(back->memory_mb == 1024);
  CHECK(back->sandboxes == 3);
  CHECK(!parse_node("{}"));
  CHECK(!parse_node("not json"));
}

TEST_CASE("cluster: membership, catalog, placement, drain, loss and removal on real etcd") {
  test::TempDir dir;
  test::EtcdCluster etcd(dir.path(), 1);
  REQUIRE_MESSAGE(etcd.ok(), "etcd did not start (is etcd-server installed?)");
  FakeLoad load_a, load_b;
  load_b.memory_mb = 900;  // b is nearly full: a comes first
  auto a = std::make_unique<Cluster>(config(etcd, "a"), std::ref(load_a));
  Cluster b(config(etcd, "b"), std::ref(load_b));
  REQUIRE(a->join());
  REQUIRE(b.join());
  CHECK(a->member());
  CHECK(test::eventually([&] { return ids_of(a->nodes()) == std::set<std::string>{"a", "b"}; }, 10));
  CHECK(test::eventually([&] { return ids_of(b.nodes()) == std::set<std::string>{"a", "b"}; }, 10));

  // A second node under a live id is refused.
  {
    ClusterConfig c = config(etcd, "a");
    c.self.address = "127.0.0.1:1";
    Cluster other(c, std::ref(load_b));
    Status s = other.join();
    REQUIRE_FALSE(s);
    CHECK(s.error().kind() == ErrorKind::kConflict);
  }

  // The catalog: a records, b resolves (at once, through etcd, if its
  // watch has not caught up), a resolves its own.
  REQUIRE(a->record("sbx-1", "local"));
  Owner o = b.owner_of("sbx-1");
  CHECK(o.where == Owner::Where::kPeer);
  CHECK(o.node.id == "a");
  CHECK(a->owner_of("sbx-1").where == Owner::Where::kHere);
  CHECK(b.owner_of("no-such").where == Owner::Where::kUnknown);

  // Reconcile: a sandbox the node holds but never recorded appears; one
  // it recorded but no longer holds goes.
  {
    std::lock_guard<std::mutex> g(load_a.mu);
    load_a.ids = {"sbx-2"};
  }
  CHECK(test::eventually([&] { return b.owner_of("sbx-2").where == Owner::Where::kPeer; }, 10));
  CHECK(test::eventually([&] { return b.owner_of("sbx-1").where == Owner::Where::kUnknown; }, 10));

  // Placement: by load, and never on a draining node.
  CHECK(test::eventually([&] {
    std::vector<NodeInfo> p = b.placement(0);
    return p.size() == 2 && p[0].id == "a";
  }, 10));
  CHECK(b.placement(200).size() == 1);  // b has 100 MB left
  etcd::Client admin(etcd.endpoints());
  REQUIRE(Cluster::set_drain(admin, "/sandgate/", "a", true));
  CHECK(test::eventually([&] {
    std::vector<NodeInfo> p = b.placement(0);
    return p.size() == 1 && p[0].id == "b";
  }, 10));
  Result<std::vector<NodeInfo>> listed = Cluster::list_nodes(admin, "/sandgate/");
  REQUIRE(listed);
  REQUIRE(listed->size() == 2);
  CHECK((*listed)[0].draining);
  CHECK_FALSE((*listed)[1].draining);
  REQUIRE(Cluster::set_drain(admin, "/sandgate/", "a", false));

  // a goes (its lease revoked): its sandbox is lost (grace 0), never
  // served; a node that is live cannot be removed, a gone one can.
  CHECK_FALSE(Cluster::remove_node(admin, "/sandgate/", "a"));
  a->leave();
  CHECK(test::eventually([&] { return ids_of(b.nodes()) == std::set<std::string>{"b"}; }, 10));
  Owner lost = b.owner_of("sbx-2");
  CHECK(lost.where == Owner::Where::kLost);
  CHECK(lost.node.id == "a");
  Result<int64_t> removed = Cluster::remove_node(admin, "/sandgate/", "a");
  REQUIRE(removed);
  CHECK(*removed == 1);
  CHECK(test::eventually([&] { return b.owner_of("sbx-2").where == Owner::Where::kUnknown; }, 10));
  CHECK(b.metrics().find("sandgate_cluster_nodes 1") != std::string::npos);
}

TEST_CASE("cluster: lookups of ids the mirror lacks read etcd only within their budget") {
  test::TempDir dir;
  test::EtcdCluster etcd(dir.path(), 1);
  REQUIRE_MESSAGE(etcd.ok(), "etcd did not start (is etcd-server installed?)");
  etcd::Client admin(etcd.endpoints());
  REQUIRE(admin.put("/sandgate/sandboxes/sbx-x", R"({"node":"gone"})"));
  FakeLoad load;
  // Not joined: no mirror, so every lookup is a miss. Within the budget
  // the miss reads etcd and finds the entry (its node is not live: lost);
  // past it, etcd is not read and the id is unknown.
  Cluster reads(config(etcd, "r"), std::ref(load));
  CHECK(reads.owner_of("sbx-x").where == Owner::Where::kLost);
  CHECK(reads.owner_of("sbx-x").where == Owner::Where::kLost);
  ClusterConfig stingy = config(etcd, "s");
  stingy.miss_lookups_per_s = 0.001;  // one token (the smallest bucket), then one per 1000 s
  Cluster none(stingy, std::ref(load));
  CHECK(none.owner_of("sbx-x").where == Owner::Where::kLost);
  CHECK(none.owner_of("sbx-x").where == Owner::Where::kUnknown);
}

TEST_CASE("cluster: a node that loses etcd stops being a member (and so takes no creates)") {
  test::TempDir dir;
  auto etcd = std::make_unique<test::EtcdCluster>(dir.path(), 1);
  REQUIRE_MESSAGE(etcd->ok(), "etcd did not start (is etcd-server installed?)");
  FakeLoad load;
  ClusterConfig c = config(*etcd, "solo");
  c.etcd_timeout = std::chrono::milliseconds(300);
  Cluster n(c, std::ref(load));
  REQUIRE(n.join());
  CHECK(n.member());
  etcd->kill_member(0);
  // No renewal for longer than the TTL (2 s): no longer a member.
  CHECK(test::eventually([&] { return !n.member(); }, 15));
}

TEST_CASE("cluster: tenants and keys in etcd, mirrored into each node's SQLite") {
  test::TempDir dir;
  test::EtcdCluster etcd(dir.path(), 1);
  REQUIRE_MESSAGE(etcd.ok(), "etcd did not start (is etcd-server installed?)");
  etcd::Client admin(etcd.endpoints());
  const std::string prefix = "/sandgate/";
  Result<tenancy::CreatedKey> k1 = cluster_tenants::create_tenant(admin, prefix, "team", tenancy::Quota{4, 2048});
  REQUIRE(k1);
  Result<tenancy::CreatedKey> dup = cluster_tenants::create_tenant(admin, prefix, "team", tenancy::Quota{});
  REQUIRE_FALSE(dup);
  CHECK(dup.error().kind() == ErrorKind::kConflict);
  CHECK_FALSE(cluster_tenants::create_tenant(admin, prefix, "bad name", tenancy::Quota{}));
  CHECK(cluster_tenants::add_key(admin, prefix, "nobody").error().kind() == ErrorKind::kNotFound);

  // Two nodes' SQLite mirrors: a key made anywhere authenticates on both.
  test::TempDir da, db;
  std::unique_ptr<storage::Store> sa = test::open_store_with_base(da);
  std::unique_ptr<storage::Store> sb = test::open_store_with_base(db);
  FakeLoad load;
  Cluster a(config(etcd, "a"), std::ref(load), sa.get());
  Cluster b(config(etcd, "b"), std::ref(load), sb.get());
  REQUIRE(a.join());
  REQUIRE(b.join());
  tenancy::Tenants ta(*sa), tb(*sb);
  Result<storage::TenantRow> on_a = ta.authenticate(k1->key);
  REQUIRE(on_a);  // mirrored by join's first read
  CHECK(on_a->name == "team");
  CHECK(on_a->max_sandboxes == 4);
  Result<tenancy::CreatedKey> k2 = cluster_tenants::add_key(admin, prefix, "team");
  REQUIRE(k2);
  CHECK(test::eventually([&] { return tb.authenticate(k2->key).ok(); }, 10));
  REQUIRE(cluster_tenants::set_quota(admin, prefix, "team", tenancy::Quota{2, 1024}));
  CHECK(test::eventually([&] {
    Result<storage::TenantRow> t = tb.authenticate(k1->key);
    return t && t->max_sandboxes == 2;
  }, 10));

  // The quota across nodes: 2 sandboxes, reserved from both at once.
  Result<storage::TenantRow> team = tb.authenticate(k1->key);
  REQUIRE(team);
  std::atomic<int> granted{0}, refused{0};
  std::vector<std::thread> creators;
  for (int i = 0; i < 6; ++i)
    creators.emplace_back([&, i] {
      Cluster& node = i % 2 ? a : b;
      Status s = node.reserve(*team, "sbx-" + std::to_string(i), 256);
      if (s) ++granted;
      else if (s.error().kind() == ErrorKind::kQuota) ++refused;
    });
  for (std::thread& t : creators) t.join();
  CHECK(granted.load() == 2);
  CHECK(refused.load() == 4);
  // Memory: 1024 MiB in all, 512 held.
  REQUIRE(cluster_tenants::set_quota(admin, prefix, "team", tenancy::Quota{10, 1024}));
  CHECK(test::eventually([&] {
    Result<storage::TenantRow> t = ta.authenticate(k1->key);
    return t && t->max_sandboxes == 10;
  }, 10));
  team = ta.authenticate(k1->key);
  Status big = a.reserve(*team, "sbx-big", 600);
  REQUIRE_FALSE(big);
  CHECK(big.error().kind() == ErrorKind::kQuota);
  CHECK(a.reserve(*team, "sbx-fits", 512));

  // A model-proxy key made in etcd works on both nodes' model proxies.
  Result<tenancy::CreatedLlmKey> lk = cluster_tenants::create_llm_key(admin, prefix, "team", "agent");
  REQUIRE(lk);
  tenancy::LlmKeys la(*sa), lb(*sb);
  CHECK(test::eventually([&] { return la.authenticate(lk->key).ok() && lb.authenticate(lk->key).ok(); }, 10));
  Result<std::vector<storage::LlmKeyRow>> lks = cluster_tenants::list_llm_keys(admin, prefix, "team");
  REQUIRE(lks);
  CHECK(lks->size() == 1);

  // Revoked in etcd: no key of it authenticates on either node.
  Result<int64_t> revoked = cluster_tenants::revoke(admin, prefix, "team");
  REQUIRE(revoked);
  CHECK(*revoked == 3);
  CHECK(test::eventually([&] {
    return !ta.authenticate(k1->key) && !tb.authenticate(k2->key) && !lb.authenticate(lk->key);
  }, 10));
  Result<std::vector<storage::TenantRow>> all = cluster_tenants::list(admin, prefix);
  REQUIRE(all);
  REQUIRE(all->size() == 1);
  CHECK(all->front().disabled);
}

TEST_CASE("cluster: reservations of sandboxes that are not live are released by the reconcile") {
  test::TempDir dir;
  test::EtcdCluster etcd(dir.path(), 1);
  REQUIRE_MESSAGE(etcd.ok(), "etcd did not start (is etcd-server installed?)");
  FakeLoad load;
  Cluster n(config(etcd, "n"), std::ref(load));
  REQUIRE(n.join());
  storage::TenantRow t;
  t.id = "tn_1";
  t.name = "team";
  t.max_sandboxes = 1;
  t.max_memory_mb = 1024;
  {
    std::lock_guard<std::mutex> g(load.mu);
    load.ids = {"live"};
  }
  REQUIRE(n.reserve(t, "live", 100));
  CHECK(n.reserve(t, "second", 100).error().kind() == ErrorKind::kQuota);
  // The live one ends: within two heartbeats its slot is free again.
  {
    std::lock_guard<std::mutex> g(load.mu);
    load.ids.clear();
  }
  CHECK(test::eventually([&] { return n.reserve(t, "second", 100).ok(); }, 15));
}

}  // namespace
}  // namespace sg::gateway
