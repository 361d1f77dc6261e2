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
    cp = std::make_unique<sg::api::ControlPlane>(*tenants, *store, *svc, nullptr, *requests, *creates,
                                                 sg::api::ControlPlaneConfig{});
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

TEST_CASE("control plane: E2B routes this server does not serve are 501 with a message, never 404") {
  Plane p;
  std::string id = p.create();
  struct Case {
    const char* method;
    std::string path;
  };
  const Case cases[] = {
      {"GET", "/sandboxes/" + id + "/logs"},      {"GET", "/v2/sandboxes/" + id + "/logs"},
      {"POST", "/sandboxes/" + id + "/refreshes"}, {"GET", "/sandboxes/metrics?sandbox_ids=" + id},
      {"GET", "/secrets"},
      {"DELETE", "/secrets/s1"},                  {"GET", "/volumes"},
      {"POST", "/volumes"},                       {"GET", "/teams"},
      {"GET", "/teams/t1/metrics/max"},           {"POST", "/v3/templates"},
      {"POST", "/v2/templates/tpl-base/builds/b1"}, {"GET", "/templates/tpl-base/builds/b1/status"},
      {"GET", "/templates/tpl-base/files/abc"},   {"GET", "/templates/tpl-base/builds/b1/logs"},
  };
  for (const Case& c : cases) {
    CAPTURE(std::string(c.method));
    CAPTURE(c.path);
    HttpResponse r = p.call(c.method, c.path, std::string(c.method) == "GET" ? "" : "{}");
    CHECK(r.status == 501);
    json j = json::parse(r.body);
    CHECK(j["code"] == 501);
    CHECK(j["message"].get<std::string>().find("not supported by this server") != std::string::npos);
  }
  // Without a key they are 401 like every other route; a method no row has
  // is still a 405.
  std::string none = "";
  CHECK(p.call("GET", "/snapshots", "", &none).status == 401);
  CHECK(p.call("DELETE", "/snapshots").status == 405);
  CHECK(sg::api::ControlPlane::owns(HttpRequest{.method = "GET", .path = "/volumes/v1"}));
  CHECK_FALSE(sg::api::ControlPlane::owns(HttpRequest{.method = "GET", .path = "/files"}));  // envd's
}

TEST_CASE("control plane: templates: list, get, alias, tags; the owner's visibility and delete") {
  Plane p;
  // base: the server's own, public.
  HttpResponse l = p.call("GET", "/templates");
  REQUIRE(l.status == 200);
  json list = json::parse(l.body);
  REQUIRE(list.size() == 1);
  CHECK(list[0]["templateID"] == "tpl-base");
  CHECK(list[0]["names"] == json::array({"base"}));
  CHECK(list[0]["aliases"] == json::array({"base"}));
  CHECK(list[0]["public"] == true);
  CHECK(list[0]["buildStatus"] == "ready");
  CHECK(list[0]["buildCount"] == 1);
  CHECK(list[0]["spawnCount"] == 0);
  CHECK(list[0]["lastSpawnedAt"].is_null());
  CHECK(list[0]["envdVersion"] == "0.6.13");
  std::string build = list[0]["buildID"];
  CHECK(build.size() == 36);
  CHECK(build[14] == '4');
  CHECK(json::parse(p.call("GET", "/v2/templates").body) == list);

  std::string sb = p.create();
  json after = json::parse(p.call("GET", "/templates").body);
  CHECK(after[0]["spawnCount"] == 1);
  CHECK(after[0]["lastSpawnedAt"].is_string());

  // By id and by name.
  for (std::string ref : {"tpl-base", "base"}) {
    HttpResponse g = p.call("GET", "/templates/" + ref);
    REQUIRE(g.status == 200);
    json t = json::parse(g.body);
    CHECK(t["templateID"] == "tpl-base");
    REQUIRE(t["builds"].size() == 1);
    CHECK(t["builds"][0]["buildID"] == build);
    CHECK(t["builds"][0]["status"] == "ready");
  }
  HttpResponse a = p.call("GET", "/templates/aliases/base");
  REQUIRE(a.status == 200);
  CHECK(json::parse(a.body) == json{{"templateID", "tpl-base"}, {"public", true}});
  CHECK(p.call("GET", "/templates/aliases/nope").status == 404);
  CHECK(p.call("GET", "/templates/aliases/tpl-base").status == 404);  // an id is not an alias
  HttpResponse tags = p.call("GET", "/templates/base/tags");
  REQUIRE(tags.status == 200);
  CHECK(json::parse(tags.body)[0]["tag"] == "default");
  CHECK(json::parse(tags.body)[0]["buildID"] == build);
  CHECK(p.call("GET", "/templates/nope").status == 404);

  // The server's template is nobody's to change or delete.
  CHECK(p.call("PATCH", "/v2/templates/base", R"({"public":false})").status == 400);
  CHECK(p.call("DELETE", "/templates/base").status == 400);
  CHECK(p.call("PATCH", "/templates/base", R"({"public":"yes"})").status == 400);
  CHECK(p.call("PATCH", "/templates/base", R"({"other":1})").status == 400);

  // A tenant's own template: private until it says otherwise.
  sg::storage::TemplateRow own;
  own.id = "tpl-own";
  own.name = "mine";
  own.tenant_id = p.tenants->authenticate(p.key)->id;
  own.status = "ready";
  own.rootfs_path = p.dir.sub("rootfs");
  own.created_at = own.updated_at = 1'700'000'000;
  REQUIRE(p.store->upsert_template(own));
  CHECK(json::parse(p.call("GET", "/templates").body).size() == 2);
  CHECK(json::parse(p.call("GET", "/templates", "", &p.other_key).body).size() == 1);
  CHECK(p.call("GET", "/templates/mine", "", &p.other_key).status == 404);
  CHECK(p.call("GET", "/templates/aliases/mine", "", &p.other_key).status == 404);
  CHECK(p.call("DELETE", "/templates/tpl-own", "", &p.other_key).status == 404);
  HttpResponse pub = p.call("PATCH", "/v2/templates/mine", R"({"public":true})");
  REQUIRE(pub.status == 200);
  CHECK(json::parse(pub.body) == json{{"names", json::array({"mine"})}});
  CHECK(json::parse(p.call("GET", "/templates/aliases/mine", "", &p.other_key).body)["public"] == true);
  CHECK(p.call("DELETE", "/templates/tpl-own", "", &p.other_key).status == 400);  // visible, not its own
  CHECK(p.call("PATCH", "/templates/tpl-own", R"({"public":false})").status == 200);
  CHECK(p.call("GET", "/templates/mine", "", &p.other_key).status == 404);

  // Delete: refused while a sandbox of it lives, then gone, its name free.
  HttpResponse made = p.call("POST", "/sandboxes", R"({"templateID":"mine"})");
  REQUIRE(made.status == 201);
  std::string user = json::parse(made.body)["sandboxID"];
  HttpResponse busy = p.call("DELETE", "/templates/mine");
  CHECK(busy.status == 409);
  CHECK(json::parse(busy.body)["message"].get<std::string>().find("in use by 1 sandboxes") != std::string::npos);
  REQUIRE(p.call("DELETE", "/sandboxes/" + user).status == 204);
  CHECK(p.call("DELETE", "/templates/mine").status == 204);
  CHECK(p.call("GET", "/templates/mine").status == 404);
  CHECK(p.call("GET", "/templates/tpl-own").status == 404);
  CHECK(p.call("DELETE", "/templates/tpl-own").status == 404);
  CHECK(json::parse(p.call("GET", "/templates").body).size() == 1);
  own.id = "tpl-own2";
  CHECK(p.store->upsert_template(own));  // the name is free again
  CHECK(p.call("GET", "/sandboxes/" + sb).status == 200);  // base's sandbox was never touched
}

TEST_CASE("control plane: tags: a build's tags, assign, list, create by name:tag, remove") {
  Plane p;
  std::string tenant = p.tenants->authenticate(p.key)->id;
  int n = 0;
  auto build = [&](std::vector<std::string> tags, const std::string& layer) {
    sg::storage::TemplateRow fresh;
    fresh.id = "tpl-app";
    fresh.status = "building";
    fresh.rootfs_path = p.dir.sub("rootfs");
    sg::storage::BuildRow b;
    b.id = "00000000-0000-4000-8000-00000000000" + std::to_string(++n);
    b.created_at = p.now;
    b.tags = std::move(tags);
    REQUIRE(p.store->request_build(tenant, "app", fresh, b));
    REQUIRE(p.store->start_build(b.id, p.now));
    REQUIRE(p.store->finish_build(b.id, p.dir.sub("rootfs"), "[\"" + layer + "\"]", "{}", p.now));
    return b.id;
  };
  std::string b1 = build({}, "/l1");
  std::string b2 = build({"v2"}, "/l2");

  HttpResponse t = p.call("GET", "/templates/app/tags");
  REQUIRE(t.status == 200);
  json tags = json::parse(t.body);
  REQUIRE(tags.size() == 2);
  CHECK(tags[0] == json{{"tag", "default"}, {"buildID", b1}, {"createdAt", "2023-11-14T22:13:20Z"}});
  CHECK(tags[1]["tag"] == "v2");
  CHECK(tags[1]["buildID"] == b2);

  // Sandboxes by tag run that build's layers; a missing tag is 404.
  auto layers_of = [&](const std::string& ref) {
    HttpResponse r = p.call("POST", "/sandboxes", json{{"templateID", ref}}.dump());
    REQUIRE_MESSAGE(r.status == 201, r.body);
    auto rec = p.rt.record(json::parse(r.body)["sandboxID"].get<std::string>() + "");
    return rec.spec.layers;
  };
  CHECK(layers_of("app") == std::vector<std::string>{"/l1"});
  CHECK(layers_of("app:v2") == std::vector<std::string>{"/l2"});
  CHECK(layers_of("alpha/app:default") == std::vector<std::string>{"/l1"});
  HttpResponse missing = p.call("POST", "/sandboxes", R"({"templateID":"app:v3"})");
  CHECK(missing.status == 404);
  CHECK(json::parse(missing.body)["message"].get<std::string>().find("no tag 'v3'") != std::string::npos);
  CHECK(p.call("POST", "/sandboxes", R"({"templateID":"beta/app"})").status == 404);
  CHECK(p.call("POST", "/sandboxes", R"({"templateID":"app:bad tag"})").status == 400);

  // Assign: 201 {buildID, tags}; "default" moves what "app" runs.
  HttpResponse a = p.call("POST", "/templates/tags", R"({"target":"app:v2","tags":["default","prod"]})");
  REQUIRE(a.status == 201);
  CHECK(json::parse(a.body) == json{{"buildID", b2}, {"tags", {"default", "prod"}}});
  CHECK(layers_of("app") == std::vector<std::string>{"/l2"});
  CHECK(json::parse(p.call("GET", "/templates/app/tags").body).size() == 3);
  CHECK(p.call("POST", "/templates/tags", R"({"target":"app:v9","tags":["x"]})").status == 404);
  CHECK(p.call("POST", "/templates/tags", R"({"target":"app","tags":[]})").status == 400);
  CHECK(p.call("POST", "/templates/tags", R"({"target":"app","tags":["no spaces"]})").status == 400);
  CHECK(p.call("POST", "/templates/tags", R"({"tags":["x"]})").status == 400);
  CHECK(p.call("POST", "/templates/tags", R"({"target":"app","tags":["x"]})", &p.other_key).status == 404);
  CHECK(p.call("POST", "/templates/tags", R"({"target":"base","tags":["x"]})").status == 400);

  // Remove: 204; all or nothing; default stays.
  CHECK(p.call("DELETE", "/templates/tags", R"({"name":"app","tags":["prod","nope"]})").status == 404);
  CHECK(p.call("DELETE", "/templates/tags", R"({"name":"app","tags":["default"]})").status == 400);
  CHECK(json::parse(p.call("GET", "/templates/app/tags").body).size() == 3);
  CHECK(p.call("DELETE", "/templates/tags", R"({"name":"app","tags":["prod","v2"]})").status == 204);
  json left = json::parse(p.call("GET", "/templates/app/tags").body);
  REQUIRE(left.size() == 1);
  CHECK(left[0]["tag"] == "default");
  CHECK(p.call("POST", "/sandboxes", R"({"templateID":"app:v2"})").status == 404);
}
