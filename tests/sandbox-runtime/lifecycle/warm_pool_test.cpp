// WarmPool (sandbox-runtime/lifecycle/warm_pool.h) on its own, with made-up
// sandboxes from a FakeRuntime, and through SandboxService: a hot template's
// next create takes a pooled sandbox and gives it its row's id, token and
// environment; the pool keeps within the tenant's quota, drops idle
// templates and kills what it holds when stopped. No root, no rootfs.
// Waits poll the pool's counters with a deadline (its thread refills).
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "sandbox-runtime/lifecycle/sandbox_service.h"
#include "sandbox-runtime/lifecycle/warm_pool.h"
#include "storage/store.h"
#include "tests/support/fake_runtime.h"
#include "tests/support/temp_dir.h"
#include "tests/support/test_store.h"

using sg::lifecycle::CreateParams;
using sg::lifecycle::SandboxService;
using sg::lifecycle::ServiceConfig;
using sg::lifecycle::WarmPool;
using sg::lifecycle::WarmPoolConfig;
using sg::test::FakeRuntime;

namespace {

// Polls cond until it holds or 10 s pass.
bool eventually(const std::function<bool()>& cond) {
  for (int i = 0; i < 2000; ++i) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return cond();
}

WarmPool::Recipe recipe(const std::string& tenant, int64_t max_sandboxes = 100) {
  WarmPool::Recipe r;
  r.tenant.id = tenant;
  r.tenant.name = tenant;
  r.tenant.max_sandboxes = max_sandboxes;
  r.tenant.max_memory_mb = 1 << 20;
  r.tpl.id = "tpl1";
  r.tpl.name = "with-start";
  return r;
}

struct PoolRig {
  FakeRuntime rt;
  std::atomic<int64_t> now{1'000'000};
  std::atomic<int> made{0}, admits{0};
  std::atomic<bool> admit{true};
  std::unique_ptr<WarmPool> pool;

  explicit PoolRig(size_t per_key = 2) {
    WarmPoolConfig c;
    c.per_key = per_key;
    c.idle = std::chrono::seconds(60);
    pool = std::make_unique<WarmPool>(
        c,
        [this](const WarmPool::Recipe&) -> sg::Result<WarmPool::Entry> {
          sg::runtime::SandboxSpec spec;
          spec.id = "p" + std::to_string(++made);
          auto sb = rt.create(spec);
          if (!sb) return sb.error();
          return WarmPool::Entry{spec.id, std::move(*sb)};
        },
        [this](const WarmPool::Recipe&, size_t) {
          ++admits;
          return admit.load();
        },
        [this] { return now.load(); }, [](WarmPool::Entry) {});
  }
};

}  // namespace

TEST_CASE("warm pool: a miss makes the key hot, the pool fills to per_key, take hands out live ones") {
  PoolRig rig(2);
  auto r = recipe("t1");
  std::string key = WarmPool::key_of("t1", r.tpl);
  CHECK_FALSE(rig.pool->take(key, r));  // cold: a miss
  REQUIRE(eventually([&] { return rig.pool->stats().ready == 2; }));
  CHECK(rig.made == 2);
  auto e = rig.pool->take(key, r);
  REQUIRE(e);
  CHECK(e->id == "p1");
  CHECK(e->sb->alive());
  // It refills; a dead one is skipped (and killed), never handed out.
  REQUIRE(eventually([&] { return rig.pool->stats().ready == 2; }));
  rig.rt.set_dead("p2");
  auto f = rig.pool->take(key, r);
  REQUIRE(f);
  CHECK(f->id == "p3");
  CHECK(rig.rt.record("p2").killed);
  WarmPool::Stats s = rig.pool->stats();
  CHECK(s.taken == 2);
  CHECK(s.missed == 1);
  // Another template version is another key: its own pool.
  auto r2 = r;
  r2.tpl.layers = R"(["/new"])";
  CHECK(WarmPool::key_of("t1", r2.tpl) != key);
  CHECK(WarmPool::key_of("t2", r.tpl) != key);
  // stop() kills what the pool holds; the taken ones are the taker's.
  REQUIRE(eventually([&] { return rig.pool->stats().ready == 2; }));
  rig.pool->stop();
  CHECK(rig.pool->stats().ready == 0);
  CHECK_FALSE(rig.pool->take(key, r));
  for (const std::string& id : rig.rt.unkilled()) CHECK_MESSAGE((id == "p1" || id == "p3"), id);
  (void)e->sb->kill();
  (void)f->sb->kill();
  CHECK(rig.rt.leaked().empty());
}

TEST_CASE("warm pool: nothing is made while admit() says the tenant has no room; idle keys are dropped") {
  PoolRig rig(2);
  rig.admit = false;
  auto r = recipe("t1");
  std::string key = WarmPool::key_of("t1", r.tpl);
  CHECK_FALSE(rig.pool->take(key, r));
  REQUIRE(eventually([&] { return rig.admits >= 1; }));
  CHECK(rig.made == 0);
  CHECK(rig.pool->stats().ready == 0);
  // Room again (after its retry pause).
  rig.admit = true;
  rig.now += 11;
  REQUIRE(eventually([&] { return rig.pool->stats().ready == 2; }));
  // Nobody creates from it for idle: its sandboxes are killed.
  rig.now += 61;
  REQUIRE(eventually([&] { return rig.pool->stats().dropped == 2; }));
  CHECK(rig.pool->stats().ready == 0);
  CHECK(rig.rt.unkilled().empty());
}

TEST_CASE("warm pool off: take() is always a miss and nothing is made") {
  PoolRig rig(0);
  auto r = recipe("t1");
  CHECK_FALSE(rig.pool->take(WarmPool::key_of("t1", r.tpl), r));
  CHECK(rig.made == 0);
  CHECK(rig.pool->stats().missed == 0);
}

namespace {

// SandboxService with a pool over a FakeRuntime that runs start commands
// itself (as kvm clones do), and a template with one.
struct ServiceRig {
  sg::test::TempDir dir;
  std::unique_ptr<sg::storage::Store> store = sg::test::open_store_with_base(dir);
  FakeRuntime rt;
  std::atomic<int64_t> now{1'700'000'000};
  sg::storage::TenantRow tenant;
  std::unique_ptr<SandboxService> svc;

  explicit ServiceRig(int64_t max_sandboxes = 100) {
    rt.set_runs_start_command(true);
    tenant.id = "t1";
    tenant.name = "tenant-one";
    tenant.created_at = now;
    tenant.max_sandboxes = max_sandboxes;
    tenant.max_memory_mb = 1 << 20;
    REQUIRE(store->insert_tenant(tenant));
    auto base = store->find_template("", "base");
    REQUIRE(base);
    REQUIRE(*base);
    sg::storage::TemplateRow t = **base;
    t.id = "tplstart";
    t.name = "with-start";
    t.config = R"({"startCmd":"serve","readyCmd":"check","user":"user","workdir":"/home/user","env":{"FROM_TPL":"1"}})";
    REQUIRE(store->upsert_template(t));
    ServiceConfig c;
    c.warm_pool.per_key = 1;
    svc = std::make_unique<SandboxService>(*store, rt, c, [this] { return now.load(); });
  }
  CreateParams params(const std::string& tpl) {
    CreateParams p;
    p.template_ref = tpl;
    p.timeout_s = 300;
    return p;
  }
};

}  // namespace

TEST_CASE("service: a hot template's next create takes the pooled sandbox with its own id, token and envVars") {
  ServiceRig rig;
  auto first = rig.svc->create(rig.tenant, rig.params("with-start"));
  REQUIRE(first);
  REQUIRE(eventually([&] { return rig.svc->warm_pool_stats().ready == 1; }));
  std::vector<std::string> before = rig.rt.unkilled();
  REQUIRE(before.size() == 2);
  std::string pooled_id = before[0] == first->id ? before[1] : before[0];
  CreateParams p = rig.params("with-start");
  p.env_vars = {{"WHO", "creator"}};
  auto second = rig.svc->create(rig.tenant, p);
  REQUIRE(second);
  CHECK(second->id == pooled_id);
  FakeRuntime::Record rec = rig.rt.record(pooled_id);
  REQUIRE(rec.configures.size() == 1);
  nlohmann::json cfg = nlohmann::json::parse(rec.configures[0]);
  CHECK(cfg["sandboxId"] == pooled_id);
  CHECK(cfg["envdAccessToken"] == second->envd_token);
  CHECK(cfg["env"]["WHO"] == "creator");
  CHECK(cfg["env"]["FROM_TPL"] == "1");
  // The pooled sandbox was started without the creator's envVars.
  bool had_who = false;
  for (auto& [k, v] : rec.spec.env) had_who = had_who || k == "WHO";
  CHECK_FALSE(had_who);
  CHECK(rig.svc->warm_pool_stats().taken == 1);
  // base has no start command: never pooled.
  auto plain = rig.svc->create(rig.tenant, rig.params("base"));
  REQUIRE(plain);
  CHECK(rig.rt.record(plain->id).configures.empty());
  // Shutdown kills the live ones and what the pool holds.
  REQUIRE(eventually([&] { return rig.svc->warm_pool_stats().ready == 1; }));
  rig.svc->shutdown();
  CHECK(rig.rt.unkilled().empty());
  CHECK(rig.rt.leaked().empty());
}

TEST_CASE("service: a pooled sandbox that refuses its configuration is replaced by a fresh one") {
  ServiceRig rig;
  REQUIRE(rig.svc->create(rig.tenant, rig.params("with-start")));
  REQUIRE(eventually([&] { return rig.svc->warm_pool_stats().ready == 1; }));
  rig.rt.fail_next(FakeRuntime::Op::kControl, 1);
  auto second = rig.svc->create(rig.tenant, rig.params("with-start"));
  REQUIRE(second);
  // Same id (the pooled one's, killed first), a fresh runtime sandbox.
  CHECK(rig.rt.record(second->id).configures.empty());
  auto st = rig.svc->state(second->id);
  REQUIRE(st);
  CHECK(*st == sg::lifecycle::State::kRunning);
  rig.svc->shutdown();
  CHECK(rig.rt.leaked().empty());
}

TEST_CASE("service: the pool holds nothing the tenant's quota has no room for") {
  // 2 sandboxes at most: one live leaves room for one more create, none
  // for a pooled one beside it.
  ServiceRig rig(2);
  REQUIRE(rig.svc->create(rig.tenant, rig.params("with-start")));
  REQUIRE(eventually([&] {
    return rig.svc->warm_pool_stats().missed == 1 && rig.svc->warm_pool_stats().starting == 0;
  }));
  CHECK(rig.svc->warm_pool_stats().made == 0);
  // The second create still fits.
  REQUIRE(rig.svc->create(rig.tenant, rig.params("with-start")));
  rig.svc->shutdown();
  CHECK(rig.rt.leaked().empty());
}
