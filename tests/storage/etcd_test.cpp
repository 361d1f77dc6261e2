// The etcd client against real etcd members (tests/support/etcd_server.h):
// reads and writes, transactions, leases, watches, and a member lost.
#include "storage/etcd.h"

#include <doctest/doctest.h>

#include <atomic>
#include <mutex>
#include <thread>

#include "tests/support/etcd_server.h"
#include "tests/support/eventually.h"
#include "tests/support/temp_dir.h"

namespace sg::etcd {
namespace {

TEST_CASE("etcd: prefix_end and endpoint URLs") {
  CHECK(prefix_end("/a/") == "/a0");
  CHECK(prefix_end(std::string("a\xff", 2)) == "b");
  Result<std::vector<net::Endpoint>> eps = parse_endpoints("etcd://10.0.0.1:2379,h2:2380");
  REQUIRE(eps);
  REQUIRE(eps->size() == 2);
  CHECK((*eps)[0].str() == "10.0.0.1:2379");
  CHECK((*eps)[1].host == "h2");
  CHECK(!parse_endpoints("etcd://"));
  CHECK(!parse_endpoints("etcd://host"));
  CHECK(!parse_endpoints("etcd://host:99999"));
  CHECK(!parse_endpoints("https://h:2379"));
}

TEST_CASE("etcd: keys, ranges, transactions, leases and a watch on a real member") {
  test::TempDir dir;
  test::EtcdCluster etcd(dir.path(), 1);
  REQUIRE_MESSAGE(etcd.ok(), "etcd did not start (is etcd-server installed?)");
  Client c(etcd.endpoints());

  Result<int64_t> rev = c.put("/t/a", "1");
  REQUIRE(rev);
  CHECK(*rev > 0);
  REQUIRE(c.put("/t/b", std::string("bin\0ary", 7)));
  REQUIRE(c.put("/u/c", "3"));
  Result<RangeResult> one = c.get("/t/a");
  REQUIRE(one);
  REQUIRE(one->kvs.size() == 1);
  CHECK(one->kvs[0].value == "1");
  CHECK(one->kvs[0].version == 1);
  Result<RangeResult> none = c.get("/t/zz");
  REQUIRE(none);
  CHECK(none->kvs.empty());
  Result<RangeResult> t = c.get_prefix("/t/");
  REQUIRE(t);
  REQUIRE(t->kvs.size() == 2);
  CHECK(t->kvs[1].value == std::string("bin\0ary", 7));
  CHECK(t->revision >= *rev);

  // Create-if-absent: the first wins, the second sees the key.
  Result<TxnResult> first = c.txn({Compare{"/t/new", "VERSION", "EQUAL", 0, {}}}, {Op::put("/t/new", "x")});
  REQUIRE(first);
  CHECK(first->succeeded);
  Result<TxnResult> second =
      c.txn({Compare{"/t/new", "VERSION", "EQUAL", 0, {}}}, {Op::put("/t/new", "y")}, {Op::put("/t/lost", "1")});
  REQUIRE(second);
  CHECK_FALSE(second->succeeded);
  CHECK(c.get("/t/new")->kvs[0].value == "x");
  CHECK(c.get("/t/lost")->kvs.size() == 1);
  CHECK(*c.remove("/t/lost") == 1);
  CHECK(*c.remove("/t/lost") == 0);

  // A lease: its keys go when it is revoked.
  Result<int64_t> lease = c.grant(30);
  REQUIRE(lease);
  REQUIRE(c.put("/t/leased", "v", *lease));
  CHECK(c.get("/t/leased")->kvs[0].lease == *lease);
  Result<int64_t> ttl = c.keep_alive(*lease);
  REQUIRE(ttl);
  CHECK(*ttl > 0);
  REQUIRE(c.revoke(*lease));
  CHECK(c.get("/t/leased")->kvs.empty());
  Result<int64_t> gone = c.keep_alive(*lease);
  REQUIRE_FALSE(gone);
  CHECK(gone.error().kind() == ErrorKind::kNotFound);

  // A watch from a revision sees puts and deletes in order, then stops.
  int64_t from = c.get_prefix("/w/")->revision + 1;
  std::mutex mu;
  std::vector<Event> seen;
  std::atomic<bool> stop{false};
  Status watch_status;
  std::thread w([&] {
    watch_status = c.watch_prefix("/w/", from,
                                  [&](const std::vector<Event>& evs, int64_t) {
                                    std::lock_guard<std::mutex> g(mu);
                                    seen.insert(seen.end(), evs.begin(), evs.end());
                                    return true;
                                  },
                                  stop);
  });
  REQUIRE(c.put("/w/1", "a"));
  REQUIRE(c.put("/x/ignored", "a"));
  REQUIRE(c.remove("/w/1"));
  CHECK(test::eventually([&] {
    std::lock_guard<std::mutex> g(mu);
    return seen.size() >= 2;
  }, 10));
  stop = true;
  w.join();
  CHECK(watch_status);
  std::lock_guard<std::mutex> g(mu);
  REQUIRE(seen.size() == 2);
  CHECK(seen[0].type == Event::Type::kPut);
  CHECK(seen[0].kv.key == "/w/1");
  CHECK(seen[0].kv.value == "a");
  CHECK(seen[1].type == Event::Type::kDelete);
  CHECK(seen[1].kv.key == "/w/1");
}

TEST_CASE("etcd: a dead endpoint first in the list, and a member of three lost") {
  test::TempDir dir;
  test::EtcdCluster etcd(dir.path(), 3);
  REQUIRE_MESSAGE(etcd.ok(), "etcd did not start (is etcd-server installed?)");
  std::vector<net::Endpoint> eps = etcd.endpoints();
  // Nothing listens on the first one.
  eps.insert(eps.begin(), net::Endpoint{"127.0.0.1", test::free_port()});
  Client c(eps, std::chrono::milliseconds(1500));
  REQUIRE(c.put("/k", "1"));
  etcd.kill_member(0);
  // Two of three keep the quorum: writes go on through the others.
  Result<int64_t> after = c.put("/k", "2");
  REQUIRE_MESSAGE(after, (after ? "" : after.error().message()));
  CHECK(c.get("/k")->kvs[0].value == "2");
}

}  // namespace
}  // namespace sg::etcd
