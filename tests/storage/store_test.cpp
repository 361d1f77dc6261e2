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

TEST_CASE("upserts (the cluster's mirror): insert, then update what may change; a name held by another id is refused") {
  test::TempDir dir;
  auto s = Store::open(dir.sub("u.db"));
  REQUIRE(s.ok());
  TenantRow t = tenant("t1");
  REQUIRE((*s)->upsert_tenant(t).ok());
  REQUIRE((*s)->upsert_key({"k1", "t1", "h1", "p", 1, std::nullopt}).ok());
  CHECK((*(*s)->tenant_for_key_hash("h1")).has_value());
  t.max_sandboxes = 7;
  REQUIRE((*s)->upsert_tenant(t).ok());
  CHECK((*(*s)->find_tenant("t1"))->max_sandboxes == 7);
  REQUIRE((*s)->upsert_key({"k1", "t1", "h1", "p", 1, int64_t{9}}).ok());
  CHECK_FALSE((*(*s)->tenant_for_key_hash("h1")).has_value());
  TenantRow other = tenant("t2");
  other.name = t.name;
  CHECK_FALSE((*s)->upsert_tenant(other).ok());
  CHECK((*(*s)->list_tenants()).size() == 1);
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

namespace {

// A build of the tenant's template `name` asking for `tags`, run to ready
// with `layers` as its files.
std::string built(Store& s, const std::string& tenant_id, const std::string& name, std::vector<std::string> tags,
                  const std::string& layers, int64_t now) {
  static int n = 0;
  TemplateRow fresh;
  fresh.id = "tpl-" + name;
  fresh.status = "building";
  BuildRow b;
  b.id = "build-" + std::to_string(++n);
  b.created_at = now;
  b.tags = std::move(tags);
  b.memory_mb = 1024 * static_cast<int64_t>(b.tags.size() + 1);
  REQUIRE(s.request_build(tenant_id, name, fresh, b).ok());
  REQUIRE(s.start_build(b.id, now).ok());
  REQUIRE(s.finish_build(b.id, "/rootfs", layers, "{}", now).ok());
  return b.id;
}

}  // namespace

TEST_CASE("tags: a build takes the tags it asked for, default moves the template, names resolve by tag") {
  auto opened = Store::open(":memory:");
  REQUIRE(opened.ok());
  Store& s = **opened;
  REQUIRE(s.insert_tenant(tenant("t1")).ok());
  REQUIRE(s.insert_tenant(tenant("t2")).ok());
  REQUIRE(s.upsert_template(base_template()).ok());

  std::string b1 = built(s, "t1", "app", {}, "[\"/l1\"]", 10);
  std::string b2 = built(s, "t1", "app", {"v2", "beta"}, "[\"/l2\"]", 20);
  auto tags = s.list_tags("tpl-app");
  REQUIRE(tags.ok());
  REQUIRE(tags->size() == 3);  // by tag: beta, default, v2
  CHECK(((*tags)[0].tag == "beta" && (*tags)[0].build_id == b2));
  CHECK(((*tags)[1].tag == "default" && (*tags)[1].build_id == b1));
  CHECK(((*tags)[2].tag == "v2" && (*tags)[2].build_id == b2));

  auto def = s.resolve_template("t1", "app");
  REQUIRE((def.ok() && def->has_value()));
  CHECK((*def)->layers == "[\"/l1\"]");
  CHECK((*def)->build_id == b1);
  auto v2 = s.resolve_template("t1", "app:v2");
  REQUIRE((v2.ok() && v2->has_value()));
  CHECK((*v2)->layers == "[\"/l2\"]");
  CHECK((*v2)->memory_mb == 3072);  // that build's shape, not the first build's
  CHECK((*v2)->id == "tpl-app");
  // team/name: the owner's name; another team's is no template at all.
  auto teamed = s.resolve_template("t1", "name-t1/app:beta");
  REQUIRE((teamed.ok() && teamed->has_value()));
  CHECK((*teamed)->build_id == b2);
  auto wrong_team = s.resolve_template("t1", "name-t2/app");
  REQUIRE(wrong_team.ok());
  CHECK_FALSE(wrong_team->has_value());
  auto missing = s.resolve_template("t1", "app:v9");
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.error().kind() == ErrorKind::kNotFound);
  CHECK(missing.error().message().find("no tag 'v9'") != std::string::npos);
  CHECK(s.resolve_template("t1", "app:bad tag").error().kind() == ErrorKind::kInvalid);
  CHECK(s.resolve_template("t1", "a/b/c").error().kind() == ErrorKind::kInvalid);
  // The server's base has no tags: its row is "default"; no other tag.
  auto base = s.resolve_template("t1", "base");
  REQUIRE((base.ok() && base->has_value()));
  CHECK((*base)->rootfs_path == "/x");
  CHECK(s.resolve_template("t1", "base:v1").error().kind() == ErrorKind::kNotFound);
  // Another tenant does not see a private template by any tag.
  auto other = s.resolve_template("t2", "app:v2");
  REQUIRE(other.ok());
  CHECK_FALSE(other->has_value());

  // Assigning moves tags (default moves the row); a bad one changes nothing.
  auto moved = s.assign_tags("t1", "app:v2", {"default", "stable"}, 30);
  REQUIRE(moved.ok());
  CHECK(*moved == b2);
  auto row = s.find_template("t1", "app");
  REQUIRE((row.ok() && row->has_value()));
  CHECK((*row)->layers == "[\"/l2\"]");
  CHECK((*row)->build_id == b2);
  CHECK((*row)->memory_mb == 3072);
  CHECK(s.assign_tags("t1", "app:v9", {"x"}, 31).error().kind() == ErrorKind::kNotFound);
  CHECK(s.assign_tags("t1", "app", {"ok", "bad tag"}, 31).error().kind() == ErrorKind::kInvalid);
  CHECK(s.assign_tags("t2", "app", {"x"}, 31).error().kind() == ErrorKind::kNotFound);
  CHECK(s.assign_tags("t1", "base", {"x"}, 31).error().kind() == ErrorKind::kInvalid);  // the server's
  REQUIRE(s.list_tags("tpl-app")->size() == 4);  // beta, default, stable, v2: no "ok"

  // Removing: all or nothing; never "default".
  CHECK(s.remove_tags("t1", "app", {"beta", "nope"}).error().kind() == ErrorKind::kNotFound);
  CHECK(s.list_tags("tpl-app")->size() == 4);
  CHECK(s.remove_tags("t1", "app", {"default"}).error().kind() == ErrorKind::kInvalid);
  CHECK(s.remove_tags("t1", "app:v2", {"beta"}).error().kind() == ErrorKind::kInvalid);
  REQUIRE(s.remove_tags("t1", "app", {"beta", "v2"}).ok());
  CHECK(s.list_tags("tpl-app")->size() == 2);
  CHECK(s.resolve_template("t1", "app:v2").error().kind() == ErrorKind::kNotFound);

  // A template whose only build is tagged is ready but has no default.
  built(s, "t1", "only", {"v1"}, "[]", 40);
  CHECK(s.resolve_template("t1", "only").error().message().find("no tag 'default'") != std::string::npos);
  auto v1 = s.resolve_template("t1", "only:v1");
  REQUIRE((v1.ok() && v1->has_value()));
  CHECK((*v1)->status == "ready");
}

TEST_CASE("build logs: by time, in either direction, from a level up") {
  auto opened = Store::open(":memory:");
  REQUIRE(opened.ok());
  Store& s = **opened;
  std::vector<BuildLogRow> rows;
  const char* levels[] = {"debug", "info", "warn", "error"};
  for (int i = 0; i < 8; ++i) rows.push_back(BuildLogRow{0, 1000 + i * 10, levels[i % 4], "1", "line " + std::to_string(i)});
  REQUIRE(s.append_build_logs("b1", rows).ok());
  auto all = s.build_logs("b1", BuildLogQuery{});
  REQUIRE(all.ok());
  CHECK(all->size() == 8);
  auto later = s.build_logs("b1", BuildLogQuery{.cursor_ms = 1050, .forward = true, .min_level = 0, .limit = 100});
  REQUIRE(later->size() == 3);
  CHECK(later->front().message == "line 5");
  auto back = s.build_logs("b1", BuildLogQuery{.cursor_ms = 1050, .forward = false, .min_level = 2, .limit = 2});
  REQUIRE(back->size() == 2);  // warn and error lines at or before 1050, newest first
  CHECK((*back)[0].message == "line 3");
  CHECK((*back)[1].message == "line 2");
}

TEST_CASE("template copies: shared with their tags, installed whole, refusing changes, dropped") {
  auto opened = Store::open(":memory:");
  REQUIRE(opened.ok());
  Store& s = **opened;
  REQUIRE(s.insert_tenant(tenant("t1")).ok());
  REQUIRE(s.upsert_template(base_template()).ok());
  std::string b1 = built(s, "t1", "app", {}, "[\"/l1\"]", 10);
  std::string b2 = built(s, "t1", "app", {"v2"}, "[\"/l2\"]", 20);

  // What this node shares: the tenant's template, not the server's base.
  auto shared = s.shared_templates();
  REQUIRE(shared.ok());
  REQUIRE(shared->size() == 1);
  SharedTemplate t = (*shared)[0];
  CHECK(t.row.id == "tpl-app");
  CHECK(t.team == "name-t1");
  REQUIRE(t.tags.size() == 2);
  CHECK(((t.tags[0].tag == "default" && t.tags[0].build_id == b1 && t.tags[0].layers == "[\"/l1\"]")));
  CHECK(((t.tags[1].tag == "v2" && t.tags[1].build_id == b2 && t.tags[1].memory_mb == 2048)));

  // Another node installs it as a copy.
  auto other_opened = Store::open(":memory:");
  REQUIRE(other_opened.ok());
  Store& o = **other_opened;
  REQUIRE(o.insert_tenant(tenant("t1")).ok());
  SharedTemplate copy = t;
  copy.row.origin_node = "n1";
  copy.row.origin_revision = 7;
  CHECK(o.install_template_copy(t).error().kind() == ErrorKind::kInvalid);  // no origin
  REQUIRE(o.install_template_copy(copy).ok());
  REQUIRE(o.install_template_copy(copy).ok());  // again: the same, no duplicate builds
  auto v2 = o.resolve_template("t1", "app:v2");
  REQUIRE((v2.ok() && v2->has_value()));
  CHECK((*v2)->layers == "[\"/l2\"]");
  CHECK((*v2)->status == "ready");
  CHECK(o.list_tags("tpl-app")->size() == 2);
  CHECK(o.list_builds("tpl-app")->size() == 2);
  auto copies = o.template_copies();
  REQUIRE(copies.ok());
  CHECK(*copies == std::map<std::string, int64_t>{{"tpl-app", 7}});
  // A copy is not shared on by the node that holds it.
  CHECK(o.shared_templates()->empty());

  // Changes go through the origin: each refused here, nothing changed.
  Error del = o.delete_template("t1", "tpl-app", 30).error();
  CHECK(del.kind() == ErrorKind::kConflict);
  CHECK(del.message().find("cluster node n1") != std::string::npos);
  CHECK(o.set_template_public("t1", "tpl-app", true, 30).error().kind() == ErrorKind::kConflict);
  CHECK(o.assign_tags("t1", "app", {"x"}, 30).error().kind() == ErrorKind::kConflict);
  TemplateRow fresh;
  fresh.id = "tpl-app2";
  fresh.status = "building";
  BuildRow b;
  b.id = "build-copy";
  b.created_at = 30;
  CHECK(o.request_build("t1", "app", fresh, b).error().kind() == ErrorKind::kConflict);
  CHECK(o.list_tags("tpl-app")->size() == 2);
  CHECK_FALSE(o.find_template("t1", "app")->value().is_public);

  // A newer revision with one tag fewer replaces the tags exactly.
  copy.row.origin_revision = 8;
  copy.tags.pop_back();
  REQUIRE(o.install_template_copy(copy).ok());
  CHECK(o.list_tags("tpl-app")->size() == 1);
  CHECK(o.resolve_template("t1", "app:v2").error().kind() == ErrorKind::kNotFound);
  CHECK(o.template_copies()->at("tpl-app") == 8);

  // The origin made "app" again under a new id: the old copy gives way.
  SharedTemplate again = copy;
  again.row.id = "tpl-app-new";
  REQUIRE(o.install_template_copy(again).ok());
  CHECK(*o.template_copies() == std::map<std::string, int64_t>{{"tpl-app-new", 8}});
  CHECK(o.find_template("t1", "app")->value().id == "tpl-app-new");

  // A template made here keeps its name and id against any copy.
  REQUIRE(o.upsert_template(base_template()).ok());
  std::string local = built(o, "t1", "mine", {}, "[]", 40);
  (void)local;
  SharedTemplate clash = copy;
  clash.row.id = "tpl-other";
  clash.row.name = "mine";
  Error refused = o.install_template_copy(clash).error();
  CHECK(refused.kind() == ErrorKind::kConflict);
  CHECK(refused.message().find("has its name") != std::string::npos);
  clash.row.id = "tpl-mine";
  clash.row.name = "elsewhere";
  CHECK(o.install_template_copy(clash).error().kind() == ErrorKind::kConflict);
  CHECK(o.find_template("t1", "mine")->value().origin_node == std::nullopt);

  // Dropped: gone by name, its row kept for the sandboxes that ran it.
  REQUIRE(o.drop_template_copy("tpl-app-new", 50).ok());
  CHECK(o.template_copies()->empty());
  CHECK_FALSE(o.find_template("t1", "app")->has_value());
  REQUIRE(o.drop_template_copy("tpl-mine", 50).ok());  // not a copy: untouched
  CHECK(o.find_template("t1", "mine")->has_value());
}
