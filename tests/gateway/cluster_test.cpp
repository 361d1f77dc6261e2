// Cluster membership, the catalog mirror, placement and node operations
// against a real etcd member (tests/support/etcd_server.h), with made-up
// node loads: two (or three) Cluster objects in one process.
#include "gateway/cluster.h"

#include <doctest/doctest.h>

#include <mutex>
#include <set>

#include "tests/support/etcd_server.h"
#include "tests/support/eventually.h"
#include "tests/support/temp_dir.h"

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

}  // namespace
}  // namespace sg::gateway
