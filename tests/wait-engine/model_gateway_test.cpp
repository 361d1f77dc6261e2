// ModelGateway (wait-engine/llm/model_gateway.h), the model proxy with its wait
// coordinator, without root: SandboxService on a FakeRuntime, SQLite in a
// temp dir, the gateway's StreamHooks on a real listener (port 0) and an
// upstream that is another HttpServer on 127.0.0.1 whose handler thinks
// for a while. A bound request must freeze the sandbox while the upstream
// thinks and thaw it before the answer is delivered; usage lands in SQLite.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "sandbox-runtime/lifecycle/sandbox_service.h"
#include "base/sys.h"
#include "gateway/http/server.h"
#include "wait-engine/llm/model_gateway.h"
#include "storage/batch_writer.h"
#include "storage/store.h"
#include "tenancy/llm_keys.h"
#include "tenancy/tenants.h"
#include "tests/support/eventually.h"
#include "tests/support/fake_runtime.h"
#include "tests/support/http_client.h"
#include "tests/support/temp_dir.h"
#include "tests/support/test_store.h"

using json = nlohmann::json;

namespace {

const char* kAnswer =
    R"({"id":"chatcmpl-1","object":"chat.completion","model":"mock-gpt",)"
    R"("choices":[{"index":0,"message":{"role":"assistant","content":"hello"},"finish_reason":"stop"}],)"
    R"("usage":{"prompt_tokens":4,"completion_tokens":5,"total_tokens":9}})";

struct Rig {
  sg::test::TempDir dir;
  std::unique_ptr<sg::storage::Store> store;
  std::unique_ptr<sg::storage::BatchWriter> rows;
  sg::test::FakeRuntime rt;
  std::unique_ptr<sg::lifecycle::SandboxService> svc;
  sg::storage::TenantRow tenant, other;
  std::string llm_key, other_llm_key;
  // The upstream: how many requests, what it was sent, how long it thinks.
  std::atomic<int> upstream_calls{0};
  std::mutex seen_mu;
  std::string seen_auth;
  std::atomic<int> think_ms{1200};
  std::unique_ptr<sg::http::HttpServer> upstream;
  std::unique_ptr<sg::llm::ModelGateway> models;
  std::unique_ptr<sg::http::HttpServer> gateway;

  Rig() {
    store = sg::test::open_store_with_base(dir);
    sg::tenancy::Tenants tenants(*store);
    REQUIRE(tenants.create("alpha", sg::tenancy::Quota{}));
    REQUIRE(tenants.create("beta", sg::tenancy::Quota{}));
    tenant = *tenants.by_name("alpha");
    other = *tenants.by_name("beta");
    sg::tenancy::LlmKeys keys(*store);
    auto k = keys.create("alpha", "test");
    REQUIRE(k);
    llm_key = k->key;
    auto k2 = keys.create("beta", "test");
    REQUIRE(k2);
    other_llm_key = k2->key;
    rows = std::make_unique<sg::storage::BatchWriter>(*store);
    sg::lifecycle::ServiceConfig sc;
    sc.waits.enabled = true;
    sc.waits.coordinator.wait.grace_ns = 20'000'000;
    sc.waits.coordinator.wait.cooldown_ns = 0;
    sc.record_event = [this](sg::storage::EventRow e) { rows->add_event(std::move(e)); };
    svc = std::make_unique<sg::lifecycle::SandboxService>(*store, rt, sc, [] { return sg::sys::unix_seconds(); });

    upstream = std::make_unique<sg::http::HttpServer>(sg::http::ServerConfig{}, [this](sg::http::HttpRequest& req) {
      upstream_calls.fetch_add(1);
      {
        std::lock_guard<std::mutex> g(seen_mu);
        seen_auth = req.header("authorization");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(think_ms.load()));
      return sg::http::json_body(200, kAnswer);
    });
    REQUIRE(upstream->start());
    REQUIRE(sg::sys::write_file_atomic(dir.sub("upstream.key"), "sk-upstream-secret\n"));

    sg::llm::ModelGatewayConfig cfg;
    cfg.openai_base_url = "http://127.0.0.1:" + std::to_string(upstream->port());
    cfg.openai_key_file = dir.sub("upstream.key");
    auto m = sg::llm::ModelGateway::create(cfg, *store, *svc, *rows);
    REQUIRE_MESSAGE(m, (m ? "" : m.error().message()));
    models = std::move(*m);
    gateway = std::make_unique<sg::http::HttpServer>(
        sg::http::ServerConfig{}, [](sg::http::HttpRequest&) { return sg::http::json_error(404, "no route"); },
        sg::http::ProxyHooks{}, models->hooks());
    REQUIRE(gateway->start());
  }

  ~Rig() {
    // serve()'s stop order.
    gateway->stop();
    svc->shutdown();
    models->shutdown();
    svc->stop_waits();
    gateway.reset();
    models.reset();
    upstream->stop();
  }

  std::string sandbox(const sg::storage::TenantRow& who) {
    sg::lifecycle::CreateParams p;
    p.template_ref = "base";
    auto row = svc->create(who, p);
    REQUIRE(row);
    return row->id;
  }

  sg::test::Response chat(const std::string& key, const std::string& bind) {
    sg::test::HttpClient c("127.0.0.1", gateway->port());
    std::map<std::string, std::string> h = {{"authorization", "Bearer " + key}, {"content-type", "application/json"}};
    if (!bind.empty()) h["x-sandgate-sandbox"] = bind;
    return c.request("POST", "/v1/chat/completions",
                     R"({"model":"mock-gpt","messages":[{"role":"user","content":"hi"}]})", h);
  }
};

}  // namespace

TEST_CASE("model gateway: a bound request freezes its sandbox while the upstream thinks, thaws it before the answer") {
  Rig rig;
  std::string id = rig.sandbox(rig.tenant);
  sg::test::Response r = rig.chat(rig.llm_key, id);
  REQUIRE_MESSAGE(r.status == 200, (r.body + r.error));
  CHECK(r.body == kAnswer);
  {
    std::lock_guard<std::mutex> g(rig.seen_mu);
    CHECK(rig.seen_auth == "Bearer sk-upstream-secret");  // the upstream's key, never the caller's
  }
  sg::test::FakeRuntime::Record rec = rig.rt.record(id);
  CHECK(rec.pauses >= 1);
  CHECK(rec.resumes == rec.pauses);
  CHECK_FALSE(rec.paused);  // running when the answer came
  CHECK(rig.svc->state(id).value() == sg::lifecycle::State::kRunning);
  // The wait's transitions, recorded by the lifecycle core, written in a batch.
  CHECK(sg::test::eventually([&] {
    auto ev = rig.store->events_for_sandbox(id);
    if (!ev) return false;
    bool paused = false, running = false;
    for (auto& e : *ev)
      if (e.kind == "wait") {
        paused |= e.detail.find(R"("to":"paused")") != std::string::npos;
        running |= e.detail.find(R"("to":"running")") != std::string::npos;
      }
    return paused && running;
  }));
  // Usage is written by the gateway's writer thread.
  sg::storage::LlmUsageQuery q;
  q.tenant_id = rig.tenant.id;
  CHECK(sg::test::eventually([&] {
    auto rows = rig.store->list_llm_usage(q);
    return rows && rows->size() == 1 && (*rows)[0].input_tokens == 4 && (*rows)[0].output_tokens == 5 &&
           (*rows)[0].sandbox_id == id;
  }));
}

TEST_CASE("model gateway: an unbound request waits without touching any sandbox") {
  Rig rig;
  rig.think_ms = 100;
  std::string id = rig.sandbox(rig.tenant);
  sg::test::Response r = rig.chat(rig.llm_key, "");
  CHECK(r.status == 200);
  CHECK(rig.rt.record(id).pauses == 0);
}

TEST_CASE("model gateway: bad keys and other tenants' sandboxes never reach the upstream") {
  Rig rig;
  std::string mine = rig.sandbox(rig.tenant);
  std::string theirs = rig.sandbox(rig.other);
  sg::test::Response bad = rig.chat("sk-sg-notakey", mine);
  CHECK(bad.status == 401);
  sg::test::Response cross = rig.chat(rig.llm_key, theirs);
  CHECK(cross.status == 404);
  CHECK(rig.upstream_calls.load() == 0);
  CHECK(rig.rt.record(theirs).pauses == 0);
  CHECK(rig.rt.record(mine).pauses == 0);
}

TEST_CASE("model gateway: a sandbox killed during the wait ends the wait; the caller still gets the answer") {
  Rig rig;
  rig.think_ms = 1500;
  std::string id = rig.sandbox(rig.tenant);
  std::thread killer([&] {
    // Once it is frozen for the wait, a client kills it.
    REQUIRE(sg::test::eventually([&] { return rig.rt.record(id).pauses >= 1; }, 10));
    REQUIRE(rig.svc->kill(rig.tenant.id, id));
  });
  sg::test::Response r = rig.chat(rig.llm_key, id);
  killer.join();
  CHECK(r.status == 200);
  CHECK(r.body == kAnswer);
  CHECK(rig.rt.record(id).killed);
  CHECK(rig.rt.leaked().empty());
}
