// Store: rows survive reopening; quota is atomic; state transitions are CAS.
#include <doctest/doctest.h>

#include <thread>

#include "storage/store.h"
#include "tests/support/temp_dir.h"

using namespace sg;
using namespace sg::storage;

namespace {

TenantRow tenant(const std::string& id) {
  TenantRow t;
  t.id = id;
  t.name = "name-" + id;
  t.created_at = 1;
  t.max_sandboxes = 2;
  t.max_memory_mb = 1024;
  return t;
}

TemplateRow base_template() {
  TemplateRow t;
  t.id = "tpl1";
  t.name = "base";
  t.status = "ready";
  t.rootfs_path = "/x";
  return t;
}

SandboxRow sandbox(const std::string& id, const std::string& tenant_id, int64_t mem = 512) {
  SandboxRow r;
  r.id = id;
  r.tenant_id = tenant_id;
  r.template_id = "tpl1";
  r.state = kStateCreating;
  r.backend = "process";
  r.envd_token = "tok";
  r.envd_version = "0.6.13";
  r.memory_mb = mem;
  r.cpu_count = 2;
  r.timeout_s = 300;
  r.started_at = 100;
  r.end_at = 400;
  return r;
}

}  // namespace

TEST_CASE("tenants, keys, templates, sandboxes and events survive reopening the file") {
  test::TempDir dir;
  std::string path = dir.sub("s.db");
  {
    auto s = Store::open(path);
    REQUIRE(s.ok());
    REQUIRE((*s)->insert_tenant(tenant("t1")).ok());
    ApiKeyRow k{"k1", "t1", "hash1", "e2b_ab...", 5, std::nullopt};
    REQUIRE((*s)->insert_key(k).ok());
    REQUIRE((*s)->upsert_template(base_template()).ok());
    REQUIRE((*s)->insert_sandbox_within_quota(sandbox("sb1", "t1"), 10, 10000).ok());
    REQUIRE((*s)->set_running("sb1", 42, "0.6.13").ok());
    REQUIRE((*s)->add_event(std::string("t1"), std::string("sb1"), "created", "{}", 7).ok());
  }
  auto s = Store::open(path);
  REQUIRE(s.ok());
  auto t = (*s)->tenant_for_key_hash("hash1");
  REQUIRE(t.ok());
  REQUIRE(t->has_value());
  CHECK((*t)->id == "t1");
  auto tpl = (*s)->find_template("t1", "base");
  REQUIRE(tpl.ok());
  REQUIRE(tpl->has_value());
  CHECK((*tpl)->id == "tpl1");
  auto sb = (*s)->get_sandbox("t1", "sb1");
  REQUIRE(sb.ok());
  REQUIRE(sb->has_value());
  CHECK((*sb)->state == "running");
  CHECK((*sb)->init_pid == 42);
  auto ev = (*s)->events_for_sandbox("sb1");
  REQUIRE(ev.ok());
  REQUIRE(ev->size() == 1);
  CHECK((*ev)[0].kind == "created");
}

TEST_CASE("a revoked key or a disabled tenant no longer authenticates") {
  test::TempDir dir;
  auto s = Store::open(dir.sub("k.db"));
  REQUIRE(s.ok());
  REQUIRE((*s)->insert_tenant(tenant("t1")).ok());
  REQUIRE((*s)->insert_key({"k1", "t1", "h1", "p", 1, std::nullopt}).ok());
  REQUIRE((*s)->insert_key({"k2", "t1", "h2", "p", 1, std::nullopt}).ok());
  CHECK(*(*s)->revoke_key("k1", 9));
  CHECK_FALSE(*(*s)->revoke_key("k1", 9));
  CHECK_FALSE((*(*s)->tenant_for_key_hash("h1")).has_value());
  CHECK((*(*s)->tenant_for_key_hash("h2")).has_value());
  CHECK(*(*s)->revoke_tenant("t1", 10) == 1);
  CHECK_FALSE((*(*s)->tenant_for_key_hash("h2")).has_value());
}

TEST_CASE("quota: the count and memory limits refuse the insert and change nothing") {
  test::TempDir dir;
  auto s = Store::open(dir.sub("q.db"));
  REQUIRE(s.ok());
  REQUIRE((*s)->insert_tenant(tenant("t1")).ok());
  REQUIRE((*s)->upsert_template(base_template()).ok());
  REQUIRE((*s)->insert_sandbox_within_quota(sandbox("a", "t1"), 2, 1024).ok());
  Status mem = (*s)->insert_sandbox_within_quota(sandbox("b", "t1", 600), 2, 1024);
  REQUIRE(!mem.ok());
  CHECK(mem.error().kind() == ErrorKind::kQuota);
  CHECK(mem.error().message().find("MB") != std::string::npos);
  REQUIRE((*s)->insert_sandbox_within_quota(sandbox("b", "t1"), 2, 1024).ok());
  Status count = (*s)->insert_sandbox_within_quota(sandbox("c", "t1", 1), 2, 100000);
  REQUIRE(!count.ok());
  CHECK(count.error().kind() == ErrorKind::kQuota);
  CHECK_FALSE((*(*s)->get_sandbox("t1", "c")).has_value());
  // A finished sandbox frees its share.
  CHECK(*(*s)->finish("a", kStateKilled, "deleted", 5));
  CHECK((*s)->insert_sandbox_within_quota(sandbox("c", "t1"), 2, 1024).ok());
}

TEST_CASE("quota holds under concurrent inserts") {
  test::TempDir dir;
  auto s = Store::open(dir.sub("c.db"));
  REQUIRE(s.ok());
  REQUIRE((*s)->insert_tenant(tenant("t1")).ok());
  REQUIRE((*s)->upsert_template(base_template()).ok());
  std::atomic<int> ok{0};
  std::vector<std::thread> ts;
  for (int i = 0; i < 8; ++i)
    ts.emplace_back([&, i] {
      if ((*s)->insert_sandbox_within_quota(sandbox("x" + std::to_string(i), "t1", 1), 3, 100000).ok()) ++ok;
    });
  for (auto& t : ts) t.join();
  CHECK(ok == 3);
}

TEST_CASE("sandboxes are visible only to their tenant") {
  test::TempDir dir;
  auto s = Store::open(dir.sub("i.db"));
  REQUIRE(s.ok());
  REQUIRE((*s)->insert_tenant(tenant("a")).ok());
  REQUIRE((*s)->insert_tenant(tenant("b")).ok());
  REQUIRE((*s)->upsert_template(base_template()).ok());
  REQUIRE((*s)->insert_sandbox_within_quota(sandbox("sa", "a"), 5, 5000).ok());
  REQUIRE((*s)->set_running("sa", 1, "v").ok());
  CHECK((*(*s)->get_sandbox("a", "sa")).has_value());
  CHECK_FALSE((*(*s)->get_sandbox("b", "sa")).has_value());
  SandboxQuery q;
  q.tenant_id = "b";
  CHECK((*s)->list_sandboxes(q)->empty());
  q.tenant_id = "a";
  CHECK((*s)->list_sandboxes(q)->size() == 1);
}

TEST_CASE("list filters by state and metadata and pages by cursor") {
  test::TempDir dir;
  auto s = Store::open(dir.sub("l.db"));
  REQUIRE(s.ok());
  REQUIRE((*s)->insert_tenant(tenant("a")).ok());
  REQUIRE((*s)->upsert_template(base_template()).ok());
  for (int i = 0; i < 5; ++i) {
    SandboxRow r = sandbox("s" + std::to_string(i), "a", 1);
    r.metadata = i % 2 ? R"({"k":"odd","x":"1"})" : R"({"k":"even"})";
    REQUIRE((*s)->insert_sandbox_within_quota(r, 10, 10000).ok());
    REQUIRE((*s)->set_running(r.id, 1, "v").ok());
  }
  REQUIRE(*(*s)->transition("s4", {kStateRunning}, kStatePaused));
  CHECK_FALSE(*(*s)->transition("s4", {kStateRunning}, kStatePaused));
  SandboxQuery q;
  q.tenant_id = "a";
  q.states = {kStatePaused};
  auto paused = (*s)->list_sandboxes(q);
  REQUIRE(paused->size() == 1);
  CHECK((*paused)[0].id == "s4");
  q.states = {};
  q.metadata = {{"k", "odd"}, {"x", "1"}};
  auto odd = (*s)->list_sandboxes(q);
  REQUIRE(odd->size() == 2);
  CHECK((*odd)[0].id == "s1");
  CHECK((*odd)[1].id == "s3");
  q.metadata = {};
  q.limit = 2;
  auto p1 = *(*s)->list_sandboxes(q);
  REQUIRE(p1.size() == 2);
  q.after_seq = p1.back().seq;
  auto p2 = *(*s)->list_sandboxes(q);
  REQUIRE(p2.size() == 2);
  CHECK(p2[0].id == "s2");
  q.after_seq = p2.back().seq;
  auto p3 = *(*s)->list_sandboxes(q);
  REQUIRE(p3.size() == 1);
  CHECK(p3[0].id == "s4");
}

TEST_CASE("finish is final: a killed sandbox cannot be resurrected") {
  test::TempDir dir;
  auto s = Store::open(dir.sub("f.db"));
  REQUIRE(s.ok());
  REQUIRE((*s)->insert_tenant(tenant("a")).ok());
  REQUIRE((*s)->upsert_template(base_template()).ok());
  REQUIRE((*s)->insert_sandbox_within_quota(sandbox("z", "a"), 5, 5000).ok());
  CHECK(*(*s)->finish("z", kStateFailed, "boom", 3));
  CHECK_FALSE(*(*s)->finish("z", kStateKilled, "again", 4));
  CHECK_FALSE((*s)->set_running("z", 1, "v").ok());
  CHECK_FALSE(*(*s)->transition("z", {kStateRunning}, kStatePaused));
  auto row = *(*s)->get_sandbox("a", "z");
  CHECK(row->state == "failed");
  CHECK(row->end_reason == "boom");
}
