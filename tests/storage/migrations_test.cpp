// Migrations: applied once, in order, refused when the file is newer.
#include <doctest/doctest.h>

#include "storage/migrations.h"
#include "storage/store.h"
#include "tests/support/temp_dir.h"

using namespace sg;
using namespace sg::storage;

TEST_CASE("migrate brings an empty database to the newest version and is idempotent") {
  test::TempDir dir;
  auto db = Db::open(dir.sub("a.db"));
  REQUIRE(db.ok());
  auto v = migrate(**db);
  REQUIRE(v.ok());
  CHECK(*v == migrations().back().version);
  auto again = migrate(**db);
  REQUIRE(again.ok());
  CHECK(*again == *v);
  auto tx = (*db)->lock();
  auto st = tx.prepare("SELECT count(*) FROM sqlite_master WHERE type='table' AND name IN "
                       "('tenants','api_keys','templates','sandboxes','events','llm_keys','llm_upstreams',"
                       "'llm_usage')");
  REQUIRE(st.ok());
  REQUIRE(*st->step());
  CHECK(st->int64(0) == 8);
  auto ix = tx.prepare("SELECT count(*) FROM sqlite_master WHERE type='index' AND name IN "
                       "('llm_keys_tenant','llm_usage_tenant_at','llm_usage_sandbox')");
  REQUIRE(ix.ok());
  REQUIRE(*ix->step());
  CHECK(ix->int64(0) == 3);
}

TEST_CASE("migration 2 applies to a database at version 1 and keeps its rows") {
  test::TempDir dir;
  std::string path = dir.sub("v1.db");
  {
    auto db = Db::open(path);
    REQUIRE(db.ok());
    std::vector<Migration> v1(migrations().begin(), migrations().begin() + 1);
    REQUIRE(*migrate(**db, v1) == 1);
    auto tx = (*db)->lock();
    REQUIRE(tx.exec("INSERT INTO tenants VALUES('t1','acme',1,5,1024,0);"
                    "INSERT INTO api_keys VALUES('k1','t1','h1','e2b_ab...',1,NULL);"
                    "INSERT INTO events(at, tenant_id, sandbox_id, kind, detail) VALUES(3,'t1','s1','created','{}');")
                .ok());
    auto none = tx.prepare("SELECT count(*) FROM sqlite_master WHERE name = 'llm_keys'");
    REQUIRE(*none->step());
    CHECK(none->int64(0) == 0);
  }
  auto db = Db::open(path);
  REQUIRE(db.ok());
  REQUIRE(*migrate(**db) == migrations().back().version);
  auto tx = (*db)->lock();
  auto t = tx.prepare("SELECT name, max_sandboxes FROM tenants WHERE id = 't1'");
  REQUIRE(*t->step());
  CHECK(t->text(0) == "acme");
  CHECK(t->int64(1) == 5);
  auto k = tx.prepare("SELECT key_hash FROM api_keys WHERE id = 'k1'");
  REQUIRE(*k->step());
  CHECK(k->text(0) == "h1");
  auto e = tx.prepare("SELECT count(*) FROM events");
  REQUIRE(*e->step());
  CHECK(e->int64(0) == 1);
  // The new tables work against the old rows: a key for the existing tenant
  // is accepted, one for an unknown tenant refused (foreign keys are on).
  CHECK(tx.exec("INSERT INTO llm_keys VALUES('lk1','t1','lh1','sk-sg-ab...','',2,NULL)").ok());
  CHECK_FALSE(tx.exec("INSERT INTO llm_keys VALUES('lk2','zz','lh2','sk-sg-ab...','',2,NULL)").ok());
  CHECK(tx.exec("INSERT INTO llm_upstreams VALUES('','openai','https://x',  'k', 2)").ok());
  CHECK(tx.exec("INSERT INTO llm_usage(at, tenant_id, provider, route, model, stream, status, outcome, "
                "input_tokens, output_tokens, cache_read_tokens, cache_write_tokens, usage_found, duration_ms, "
                "wait_paused_ms) VALUES(1,'t1','openai','/v1/x','m',0,200,'completed',1,2,3,4,1,5,0)")
            .ok());
}

TEST_CASE("the database is in WAL mode") {
  test::TempDir dir;
  auto db = Db::open(dir.sub("wal.db"));
  REQUIRE(db.ok());
  auto tx = (*db)->lock();
  auto st = tx.prepare("PRAGMA journal_mode");
  REQUIRE(st.ok());
  REQUIRE(*st->step());
  CHECK(st->text(0) == "wal");
}

TEST_CASE("a later migration applies on top of an existing database, keeping its rows") {
  test::TempDir dir;
  std::vector<Migration> v1 = {{1, "one", "CREATE TABLE t(a INTEGER); INSERT INTO t VALUES(7);"}};
  std::vector<Migration> v2 = v1;
  v2.push_back({2, "two", "ALTER TABLE t ADD COLUMN b TEXT DEFAULT 'x';"});
  {
    auto db = Db::open(dir.sub("m.db"));
    REQUIRE(db.ok());
    REQUIRE(*migrate(**db, v1) == 1);
  }
  auto db = Db::open(dir.sub("m.db"));
  REQUIRE(db.ok());
  REQUIRE(*migrate(**db, v2) == 2);
  auto tx = (*db)->lock();
  auto st = tx.prepare("SELECT a, b FROM t");
  REQUIRE(*st->step());
  CHECK(st->int64(0) == 7);
  CHECK(st->text(1) == "x");
}

TEST_CASE("a failing migration rolls back and leaves the version unchanged") {
  test::TempDir dir;
  std::vector<Migration> list = {{1, "one", "CREATE TABLE t(a INTEGER);"},
                                 {2, "broken", "CREATE TABLE u(a INTEGER); THIS IS NOT SQL;"}};
  auto db = Db::open(dir.sub("f.db"));
  REQUIRE(db.ok());
  auto r = migrate(**db, list);
  REQUIRE(!r.ok());
  CHECK(r.error().message().find("migration 2 (broken)") != std::string::npos);
  CHECK(*schema_version(**db) == 1);
  auto tx = (*db)->lock();
  auto st = tx.prepare("SELECT count(*) FROM sqlite_master WHERE name = 'u'");
  REQUIRE(*st->step());
  CHECK(st->int64(0) == 0);
}

TEST_CASE("a database newer than the binary is refused") {
  test::TempDir dir;
  auto db = Db::open(dir.sub("n.db"));
  REQUIRE(db.ok());
  {
    auto tx = (*db)->lock();
    REQUIRE(tx.exec("PRAGMA user_version = 999").ok());
  }
  auto r = migrate(**db);
  REQUIRE(!r.ok());
  CHECK(r.error().message().find("newer than this sandgate knows") != std::string::npos);
}

TEST_CASE("migration 7: a template built before tags keeps its build as 'default'") {
  test::TempDir dir;
  std::string path = dir.sub("v6.db");
  {
    auto db = Db::open(path);
    REQUIRE(db.ok());
    std::vector<Migration> v6(migrations().begin(), migrations().begin() + 6);
    REQUIRE(*migrate(**db, v6) == 6);
    auto tx = (*db)->lock();
    REQUIRE(tx.exec("INSERT INTO tenants VALUES('t1','acme',1,5,1024,0);"
                    "INSERT INTO templates(id, name, tenant_id, status, rootfs_path, cpu_count, memory_mb, "
                    "disk_size_mb, created_at, updated_at, layers, config, build_id) "
                    "VALUES('tp1','app','t1','ready','/base',2,512,0,1,2,'[\"/l1\"]','{\"user\":\"root\"}','b1');"
                    "INSERT INTO template_builds(id, template_id, tenant_id, status, cpu_count, memory_mb, "
                    "created_at, updated_at) VALUES('b0','tp1','t1','ready',2,512,1,1);"
                    "INSERT INTO template_builds(id, template_id, tenant_id, status, cpu_count, memory_mb, "
                    "created_at, updated_at) VALUES('b1','tp1','t1','ready',2,512,2,2);")
                .ok());
  }
  auto store = Store::open(path);
  REQUIRE(store.ok());
  auto tags = (*store)->list_tags("tp1");
  REQUIRE(tags.ok());
  REQUIRE(tags->size() == 1);
  CHECK((*tags)[0].tag == "default");
  CHECK((*tags)[0].build_id == "b1");
  auto t = (*store)->resolve_template("t1", "app");
  REQUIRE((t.ok() && t->has_value()));
  CHECK((*t)->layers == "[\"/l1\"]");
  CHECK((*t)->config == "{\"user\":\"root\"}");
  CHECK((*t)->rootfs_path == "/base");
  // Its default build can take more tags.
  CHECK((*store)->assign_tags("t1", "app", {"v1"}, 3).ok());
  CHECK((*store)->list_tags("tp1")->size() == 2);
}
