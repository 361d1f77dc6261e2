// ControlPlane (api-e2b/control_plane.h), the E2B routes, on plain HTTP
// values: a real store in a temp dir, real tenants and keys, rate limiters
// on an injected clock, and SandboxService on a FakeRuntime. No root, no
// server, no rootfs: the route table, authentication, status codes and
// JSON shapes, in milliseconds.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <memory>
#include <string>

#include "api-e2b/control_plane.h"
#include "sandbox-runtime/lifecycle/sandbox_service.h"
#include "storage/store.h"
#include "tenancy/rate_limiter.h"
#include "tenancy/tenants.h"
#include "tests/support/fake_runtime.h"
#include "tests/support/temp_dir.h"
#include "tests/support/test_store.h"

using json = nlohmann::json;
using sg::http::HttpRequest;
using sg::http::HttpResponse;

namespace {

struct Plane {
  sg::test::TempDir dir;
  std::unique_ptr<sg::storage::Store> store;
  sg::test::FakeRuntime rt;
  int64_t now = 1'700'000'000;
  uint64_t mono = 1;
  std::unique_ptr<sg::tenancy::Tenants> tenants;
  std::unique_ptr<sg::lifecycle::SandboxService> svc;
  std::unique_ptr<sg::tenancy::RateLimiter> requests, creates;
  std::unique_ptr<sg::api::ControlPlane> cp;
  std::string key, other_key;

  explicit Plane(double creates_per_s = 100) {
    store = sg::test::open_store_with_base(dir);
    tenants = std::make_unique<sg::tenancy::Tenants>(*store);
    auto k = tenants->create("alpha", sg::tenancy::Quota{});
    REQUIRE(k);
    key = k->key;
    auto k2 = tenants->create("beta", sg::tenancy::Quota{});
    REQUIRE(k2);
    other_key = k2->key;
    svc = std::make_unique<sg::lifecycle::SandboxService>(*store, rt, sg::lifecycle::ServiceConfig{}, [this] { return now; });
    auto clock = [this] { return mono; };
    requests = std::make_unique<sg::tenancy::RateLimiter>(1000, 1000, clock);
    creates = std::make_unique<sg::tenancy::RateLimiter>(creates_per_s, creates_per_s, clock);
    cp = std::make_unique<sg::api::ControlPlane>(*tenants, *svc, *requests, *creates, sg::api::ControlPlaneConfig{});
  }

  HttpResponse call(const std::string& method, const std::string& target, const std::string& body = "",
                    const std::string* api_key = nullptr) {
    HttpRequest r;
    r.method = method;
    r.target = target;
    size_t q = target.find('?');
    r.path = target.substr(0, q);
    r.query = q == std::string::npos ? "" : target.substr(q + 1);
    r.body = body;
    if (!body.empty()) r.headers["content-type"] = "application/json";
    r.headers["x-api-key"] = api_key ? *api_key : key;
    return cp->handle(r);
  }

  std::string create() {
    HttpResponse r = call("POST", "/sandboxes", R"({"templateID":"base","timeout":60})");
    REQUIRE_MESSAGE(r.status == 201, r.body);
    return json::parse(r.body).at("sandboxID").get<std::string>();
  }
};

json body(const HttpResponse& r) { return json::parse(r.body, nullptr, false); }

std::string header(const HttpResponse& r, const std::string& name) {
  for (const auto& [k, v] : r.headers)
    if (k == name) return v;
  return "";
}

}  // namespace

TEST_CASE("control plane: health needs no key; everything else does") {
  Plane p;
  HttpRequest h;
  h.method = "GET";
  h.path = h.target = "/health";
  CHECK(p.cp->handle(h).status == 200);
  h.method = "POST";
  CHECK(p.cp->handle(h).status == 405);
  std::string none;
  HttpResponse r = p.call("GET", "/sandboxes", "", &none);
  CHECK(r.status == 401);
  CHECK(body(r).at("code") == 401);
  std::string bad = "e2b_0000000000000000000000000000000000000000";
  CHECK(p.call("GET", "/sandboxes", "", &bad).status == 401);
}

TEST_CASE("control plane: create, get, list, pause, connect, timeout, metrics, kill through the routes") {
  Plane p;
  std::string id = p.create();
  HttpResponse got = p.call("GET", "/sandboxes/" + id);
  REQUIRE(got.status == 200);
  json g = body(got);
  CHECK(g.at("sandboxID") == id);
  CHECK(g.at("state") == "running");
  CHECK(g.at("templateID") == "tpl-base");
  CHECK(g.at("envdAccessToken").get<std::string>().size() == 32);
  CHECK(g.at("lifecycle").at("onTimeout") == "kill");

  json listed = body(p.call("GET", "/v2/sandboxes"));
  REQUIRE(listed.is_array());
  CHECK(listed.size() == 1);
  CHECK(listed[0].at("sandboxID") == id);

  CHECK(p.call("POST", "/sandboxes/" + id + "/pause").status == 204);
  CHECK(p.call("POST", "/sandboxes/" + id + "/pause").status == 409);
  CHECK(body(p.call("GET", "/sandboxes/" + id)).at("state") == "paused");
  CHECK(p.call("POST", "/sandboxes/" + id + "/connect", R"({"timeout":30})").status == 201);  // resumed
  CHECK(p.call("POST", "/v2/sandboxes/" + id + "/connect", R"({"timeout":30})").status == 200);  // running
  CHECK(p.call("POST", "/sandboxes/" + id + "/resume", "{}").status == 409);  // already running
  CHECK(p.call("POST", "/sandboxes/" + id + "/timeout", R"({"timeout":120})").status == 204);
  HttpResponse m = p.call("GET", "/sandboxes/" + id + "/metrics");
  REQUIRE(m.status == 200);
  REQUIRE(body(m).is_array());
  CHECK(body(m).size() == 1);  // the reading taken now
  CHECK(body(m)[0].at("memUsed") == 64ull << 20);
  CHECK(p.call("DELETE", "/sandboxes/" + id).status == 204);
  CHECK(p.call("GET", "/sandboxes/" + id).status == 404);
  CHECK(p.call("DELETE", "/sandboxes/" + id).status == 404);
  CHECK(p.rt.unkilled().empty());
}

TEST_CASE("control plane: another tenant's sandbox does not exist for it") {
  Plane p;
  std::string id = p.create();
  CHECK(p.call("GET", "/sandboxes/" + id, "", &p.other_key).status == 404);
  CHECK(p.call("DELETE", "/sandboxes/" + id, "", &p.other_key).status == 404);
  CHECK(p.call("POST", "/sandboxes/" + id + "/pause", "", &p.other_key).status == 404);
  CHECK(body(p.call("GET", "/sandboxes", "", &p.other_key)).empty());
  CHECK(body(p.call("GET", "/sandboxes/" + id)).at("state") == "running");
}

TEST_CASE("control plane: unknown paths are 404, known paths with another method 405 with Allow") {
  Plane p;
  std::string id = p.create();
  CHECK(p.call("GET", "/sandboxes/" + id + "/nope").status == 404);
  CHECK(p.call("GET", "/sandboxes/" + id + "/a/b").status == 404);
  CHECK(p.call("GET", "/v2/sandboxes/" + id).status == 404);          // v2 has no single-sandbox GET
  CHECK(p.call("POST", "/v2/sandboxes/" + id + "/pause").status == 404);  // nor pause
  HttpResponse r = p.call("GET", "/sandboxes/" + id + "/pause");
  CHECK(r.status == 405);
  CHECK(header(r, "Allow") == "POST");
  HttpResponse c = p.call("PUT", "/sandboxes");
  CHECK(c.status == 405);
  CHECK(header(c, "Allow") == "POST, GET");
  CHECK(p.call("PATCH", "/sandboxes/" + id).status == 405);
  CHECK(p.call("GET", "/sandboxes/" + std::string(65, 'a')).status == 404);
}

TEST_CASE("control plane: bad bodies are 400 and change nothing") {
  Plane p;
  CHECK(p.call("POST", "/sandboxes", R"({"templateID":"base","timeout":"soon"})").status == 400);
  CHECK(p.call("POST", "/sandboxes", "{not json").status == 400);
  CHECK(p.call("POST", "/sandboxes", R"({"templateID":"nope"})").status == 404);
  CHECK(p.rt.calls(sg::test::FakeRuntime::Op::kCreate) == 0);
  std::string id = p.create();
  CHECK(p.call("POST", "/sandboxes/" + id + "/timeout", R"({"timeout":-5})").status == 400);
  CHECK(p.call("PUT", "/sandboxes/" + id + "/network", R"({"allowOut":["10.0.0.1"]})").status == 400);  // no egress
  CHECK(body(p.call("GET", "/sandboxes/" + id)).at("state") == "running");
}

TEST_CASE("control plane: a runtime failure is a 500 with a reference, not the runtime's words") {
  Plane p;
  p.rt.fail_at(sg::test::FakeRuntime::Op::kCreate, 1);
  HttpResponse r = p.call("POST", "/sandboxes", R"({"templateID":"base"})");
  CHECK(r.status == 500);
  CHECK(r.body.find("injected fault") == std::string::npos);
}

TEST_CASE("control plane: the create budget answers 429 with Retry-After") {
  Plane p(1);  // one create a second, burst one
  p.create();
  HttpResponse r = p.call("POST", "/sandboxes", R"({"templateID":"base"})");
  CHECK(r.status == 429);
  CHECK(header(r, "Retry-After") == "1");
  p.mono += 1'000'000'000;
  p.create();
}
