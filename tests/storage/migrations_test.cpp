// Migrations: applied once, in order, refused when the file is newer.
#include <doctest/doctest.h>

#include "storage/migrations.h"
#include "support/temp_dir.h"

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
                       "('tenants','api_keys','templates','sandboxes','events')");
  REQUIRE(st.ok());
  REQUIRE(*st->step());
  CHECK(st->int64(0) == 5);
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
