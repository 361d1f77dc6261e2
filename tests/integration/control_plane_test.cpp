// The control plane over real HTTP against the real binary: routes, shapes,
// auth, quota, tenant isolation, bad input.
#include <doctest/doctest.h>

#include <atomic>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "tests/support/sandgate_process.h"
#include "base/sys.h"

using namespace sg;
using namespace sg::test;
using json = nlohmann::json;

namespace {

json body_of(const Response& r) {
  json j = json::parse(r.body, nullptr, false);
  return j;
}

// Asserts E2B's error shape: JSON {"code": status, "message": non-empty}.
void check_error(const Response& r, int status) {
  CHECK(r.status == status);
  json j = body_of(r);
  REQUIRE_MESSAGE(j.is_object(), "body: " << r.body);
  CHECK(j["code"] == status);
  CHECK(j["message"].is_string());
  CHECK_FALSE(j["message"].get<std::string>().empty());
  CHECK(r.header("content-type").find("application/json") != std::string::npos);
}

std::string create(const SandgateProcess& s, const std::string& body = R"({"templateID":"base"})",
                   const std::string& key = "") {
  Response r = s.post("/v2/sandboxes", body, key);
  REQUIRE_MESSAGE(r.status == 201, r.status << " " << r.body << "\n" << s.log());
  return body_of(r)["sandboxID"].get<std::string>();
}

std::string make_tenant(const SandgateProcess& s, const std::string& name, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> args = {"tenant", "create", name, "--data-dir", s.data_dir()};
  args.insert(args.end(), extra.begin(), extra.end());
  CliResult r = run_sandgate(args);
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  std::string key = r.out.substr(0, r.out.find('\n'));
  REQUIRE(key.size() == 44);
  return key;
}

}  // namespace

TEST_CASE("create, get, list, pause, connect, timeout, metrics and kill with E2B's shapes") {
  TempDir dir;
  SandgateProcess s(dir.sub("data"));
  REQUIRE(s.started());

  Response c = s.post("/v2/sandboxes", R"({"templateID":"base","metadata":{"user":"a b&c=d","n":"1"},"envVars":{"FOO":"bar"}})");
  REQUIRE_MESSAGE(c.status == 201, c.body << s.log());
  json sb = body_of(c);
  std::string id = sb["sandboxID"];
  CHECK(id.size() == 20);
  CHECK(id.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789") == std::string::npos);
  CHECK(sb["templateID"].is_string());
  CHECK(sb["clientID"].is_string());
  CHECK(sb["envdVersion"] == "0.6.13");
  CHECK(sb["envdAccessToken"].is_string());
  CHECK(sb.contains("trafficAccessToken"));
  CHECK(sb["domain"].is_null());

  // v1 create (Python SDK, JS <= 2.50) sends secure and allow_internet_access.
  Response c1 = s.post("/sandboxes", R"({"templateID":"base","timeout":300,"secure":true,"allow_internet_access":true,"metadata":{},"envVars":{}})");
  REQUIRE_MESSAGE(c1.status == 201, c1.body);
  std::string id1 = body_of(c1)["sandboxID"];

  Response g = s.get("/sandboxes/" + id);
  REQUIRE(g.status == 200);
  json d = body_of(g);
  for (const char* f : {"templateID", "sandboxID", "clientID", "startedAt", "endAt", "envdVersion", "cpuCount",
                        "memoryMB", "diskSizeMB", "state"})
    CHECK_MESSAGE(d.contains(f), f);
  CHECK(d["state"] == "running");
  CHECK(d["metadata"]["user"] == "a b&c=d");
  CHECK(d["lifecycle"]["onTimeout"] == "kill");

  // v2 list with the triple-encoded metadata filter ({user: "a b&c=d"}).
  Response l = s.get("/v2/sandboxes?metadata=user%3Da%2520b%2526c%253Dd&state=running,paused");
  REQUIRE(l.status == 200);
  json arr = body_of(l);
  REQUIRE(arr.is_array());
  REQUIRE(arr.size() == 1);
  CHECK(arr[0]["sandboxID"] == id);
  CHECK(arr[0]["state"] == "running");
  // Unfiltered: both; v1 list: both running.
  CHECK(body_of(s.get("/v2/sandboxes")).size() == 2);
  CHECK(body_of(s.get("/sandboxes")).size() == 2);
  // Pagination: one per page, X-Next-Token until the last page.
  Response p1 = s.get("/v2/sandboxes?limit=1");
  REQUIRE(p1.status == 200);
  CHECK(body_of(p1).size() == 1);
  std::string tok = p1.header("x-next-token");
  REQUIRE_FALSE(tok.empty());
  Response p2 = s.get("/v2/sandboxes?limit=1&nextToken=" + tok);
  REQUIRE(p2.status == 200);
  REQUIRE(body_of(p2).size() == 1);
  CHECK(body_of(p2)[0]["sandboxID"] != body_of(p1)[0]["sandboxID"]);
  CHECK(p2.header("x-next-token").empty());
  // startedAfter (RFC 3339, inclusive as the SDK means it).
  CHECK(body_of(s.get("/v2/sandboxes?startedAfter=2000-01-01T00%3A00%3A00.000Z")).size() == 2);
  CHECK(body_of(s.get("/v2/sandboxes?startedAfter=2999-01-01T00%3A00%3A00Z")).empty());
  CHECK(body_of(s.get("/v2/sandboxes?startedAfter=" + d["startedAt"].get<std::string>())).size() == 2);

  // Pause: 204, then 409 with code 409 (JS reads the body's code).
  CHECK(s.post("/sandboxes/" + id + "/pause", "").status == 204);
  check_error(s.post("/sandboxes/" + id + "/pause", "{}"), 409);
  CHECK(body_of(s.get("/sandboxes/" + id))["state"] == "paused");
  json paused = body_of(s.get("/v2/sandboxes?state=paused"));
  REQUIRE(paused.size() == 1);
  CHECK(paused[0]["sandboxID"] == id);
  CHECK(body_of(s.get("/sandboxes")).size() == 1);  // v1 list: running only

  // Connect resumes (201), then 200 when already running.
  Response cn = s.post("/v2/sandboxes/" + id + "/connect", "{}");
  CHECK(cn.status == 201);
  CHECK(body_of(cn)["sandboxID"] == id);
  CHECK(s.post("/sandboxes/" + id + "/connect", R"({"timeout":300})").status == 200);
  CHECK(body_of(s.get("/sandboxes/" + id))["state"] == "running");

  CHECK(s.post("/sandboxes/" + id + "/timeout", R"({"timeout":600})").status == 204);

  // updateNetwork replaces the egress configuration; bad ones change
  // nothing. This server runs without --egress: an allowOut is refused.
  HttpClient hc = s.client();
  auto put_network = [&](const std::string& body) {
    return hc.request("PUT", "/sandboxes/" + id + "/network", body, {{"X-API-KEY", s.key()}, {"Content-Type", "application/json"}});
  };
  CHECK(put_network(R"({"allow_internet_access":false,"denyOut":["10.0.0.0/8"]})").status == 204);
  json nd = body_of(s.get("/sandboxes/" + id));
  CHECK(nd["allowInternetAccess"] == false);
  CHECK(nd["network"]["denyOut"] == json::array({"10.0.0.0/8"}));
  CHECK(nd["network"]["allowOut"] == json::array());
  check_error(put_network(R"({"allowOut":["1.1.1.1"]})"), 400);
  check_error(put_network(R"({"denyOut":["example.com"]})"), 400);
  check_error(put_network(R"({"egressProxy":{"address":"10.0.0.1:3128"}})"), 400);
  check_error(put_network(R"({"allowOut":"1.1.1.1"})"), 400);
  check_error(put_network(R"({"allowPublicTraffic":false})"), 400);
  check_error(put_network("[1]"), 400);
  check_error(hc.request("PUT", "/sandboxes/aaaaaaaaaaaaaaaaaaaa/network", "{}", {{"X-API-KEY", s.key()}}), 404);
  CHECK(body_of(s.get("/sandboxes/" + id)) == nd);
  // Omitted fields are cleared.
  CHECK(put_network("{}").status == 204);
  json cleared = body_of(s.get("/sandboxes/" + id));
  CHECK(cleared["allowInternetAccess"].is_null());
  CHECK_FALSE(cleared.contains("network"));

  Response m = s.get("/sandboxes/" + id + "/metrics");
  REQUIRE(m.status == 200);
  json ms = body_of(m);
  REQUIRE(ms.is_array());
  REQUIRE(ms.size() >= 1);
  CHECK(ms.back()["memUsed"].get<uint64_t>() > 0);
  CHECK(ms.back()["memTotal"].get<uint64_t>() == 512ull << 20);
  CHECK(ms.back()["memPool"].get<uint64_t>() == 0);  // nothing offloaded on the process backend
  CHECK(ms.back().contains("cpuUsedPct"));
  CHECK(ms.back().contains("timestamp"));

  CHECK(s.del("/sandboxes/" + id).status == 204);
  check_error(s.del("/sandboxes/" + id), 404);
  check_error(s.get("/sandboxes/" + id), 404);
  check_error(s.post("/sandboxes/" + id + "/pause", ""), 404);
  CHECK(s.del("/sandboxes/" + id1).status == 204);
  CHECK(body_of(s.get("/v2/sandboxes")).empty());
}

TEST_CASE("authentication: missing, malformed, unknown and revoked keys get 401") {
  TempDir dir;
  SandgateProcess s(dir.sub("data"));
  REQUIRE(s.started());
  check_error(s.client().request("GET", "/v2/sandboxes"), 401);
  check_error(s.get("/v2/sandboxes", "nonsense"), 401);
  check_error(s.get("/v2/sandboxes", "e2b_" + std::string(40, '0')), 401);
  std::string k = make_tenant(s, "acme");
  CHECK(s.get("/v2/sandboxes", k).status == 200);
  CliResult list = run_sandgate({"key", "list", "acme", "--data-dir", s.data_dir()});
  REQUIRE(list.exit_code == 0);
  size_t at = list.out.find("key_");
  REQUIRE(at != std::string::npos);
  std::string key_id = list.out.substr(at, list.out.find('\t', at) - at);
  CHECK(list.out.find(k) == std::string::npos);  // listings never show the key
  REQUIRE(run_sandgate({"key", "revoke", key_id, "--data-dir", s.data_dir()}).exit_code == 0);
  check_error(s.get("/v2/sandboxes", k), 401);
  CHECK(run_sandgate({"key", "revoke", key_id, "--data-dir", s.data_dir()}).exit_code != 0);
}

TEST_CASE("tenant isolation: another tenant's sandbox is 404 on every route and stays untouched") {
  TempDir dir;
  SandgateProcess s(dir.sub("data"));
  REQUIRE(s.started());
  std::string a = make_tenant(s, "alice");
  std::string b = make_tenant(s, "bob");
  std::string id = create(s, R"({"templateID":"base"})", a);

  HttpClient c = s.client();
  auto as_b = [&](const std::string& method, const std::string& path, const std::string& body = "") {
    return c.request(method, path, body, {{"X-API-KEY", b}});
  };
  check_error(as_b("GET", "/sandboxes/" + id), 404);
  check_error(as_b("DELETE", "/sandboxes/" + id), 404);
  check_error(as_b("POST", "/sandboxes/" + id + "/pause", "{}"), 404);
  check_error(as_b("POST", "/sandboxes/" + id + "/connect", R"({"timeout":10})"), 404);
  check_error(as_b("POST", "/v2/sandboxes/" + id + "/connect", "{}"), 404);
  check_error(as_b("POST", "/sandboxes/" + id + "/timeout", R"({"timeout":1})"), 404);
  check_error(as_b("GET", "/sandboxes/" + id + "/metrics"), 404);
  check_error(as_b("PUT", "/sandboxes/" + id + "/network", R"({"allow_internet_access":false})"), 404);
  // The 404 for a real id reads exactly like the one for an id that never existed.
  Response fake = as_b("GET", "/sandboxes/aaaaaaaaaaaaaaaaaaaa");
  Response real = as_b("GET", "/sandboxes/" + id);
  std::string fake_msg = body_of(fake)["message"], real_msg = body_of(real)["message"];
  CHECK(fake_msg.replace(fake_msg.find("aaaaaaaaaaaaaaaaaaaa"), 20, id) == real_msg);
  CHECK(body_of(as_b("GET", "/v2/sandboxes")).empty());
  CHECK(body_of(as_b("GET", "/sandboxes")).empty());
  // Still running, still alice's, timeout unchanged by bob's attempt.
  json d = body_of(s.get("/sandboxes/" + id, a));
  CHECK(d["state"] == "running");
  CHECK(d["allowInternetAccess"].is_null());  // bob's network update did not land
  CHECK(body_of(s.get("/v2/sandboxes", a)).size() == 1);
  CHECK(s.del("/sandboxes/" + id, a).status == 204);
}

TEST_CASE("quota: concurrent sandboxes and memory get 429 with Retry-After and change nothing") {
  TempDir dir;
  SandgateProcess s(dir.sub("data"));
  REQUIRE(s.started());
  std::string one = make_tenant(s, "one", {"--max-sandboxes", "1"});
  std::string id = create(s, R"({"templateID":"base"})", one);
  Response r = s.post("/v2/sandboxes", R"({"templateID":"base"})", one);
  check_error(r, 429);
  CHECK_FALSE(r.header("retry-after").empty());
  CHECK(body_of(s.get("/v2/sandboxes", one)).size() == 1);
  std::string small = make_tenant(s, "small", {"--max-memory-mb", "100"});
  Response m = s.post("/v2/sandboxes", R"({"templateID":"base"})", small);
  check_error(m, 429);
  CHECK(body_of(m)["message"].get<std::string>().find("MB") != std::string::npos);
  CHECK(body_of(s.get("/v2/sandboxes", small)).empty());
  // Freeing the slot lets the next create through.
  CHECK(s.del("/sandboxes/" + id, one).status == 204);
  std::string id2 = create(s, R"({"templateID":"base"})", one);
  CHECK(s.del("/sandboxes/" + id2, one).status == 204);
}

TEST_CASE("a burst of 200 simultaneous creates: each is served or gets 429 with Retry-After, none is dropped") {
  TempDir dir;
  SandgateProcess s(dir.sub("data"));
  REQUIRE(s.started());
  constexpr int kBurst = 200;
  std::vector<Response> got(kBurst);
  {
    // Every thread connects and sends at once (one connection each).
    std::vector<std::thread> threads;
    std::atomic<int> ready{0};
    std::atomic<bool> go{false};
    for (int i = 0; i < kBurst; ++i)
      threads.emplace_back([&, i] {
        ready.fetch_add(1);
        while (!go.load()) std::this_thread::yield();
        got[i] = s.post("/v2/sandboxes", R"({"templateID":"base"})");
      });
    while (ready.load() < kBurst) std::this_thread::yield();
    go.store(true);
    for (auto& t : threads) t.join();
  }
  int created = 0, limited = 0;
  std::vector<std::string> ids;
  for (const Response& r : got) {
    INFO(r.status << " " << r.error << " " << r.body.substr(0, 200));
    REQUIRE(r.status != 0);  // a dropped or reset connection
    if (r.status == 201) {
      ++created;
      ids.push_back(body_of(r)["sandboxID"].get<std::string>());
    } else {
      check_error(r, 429);
      CHECK_FALSE(r.header("retry-after").empty());
      ++limited;
    }
  }
  MESSAGE("burst of " << kBurst << ": " << created << " created, " << limited << " answered 429");
  CHECK(created > 0);
  CHECK(created + limited == kBurst);
  // What was created exists and runs; the listing agrees.
  CHECK(body_of(s.get("/v2/sandboxes")).size() == ids.size());
  for (const std::string& id : ids) CHECK(s.del("/sandboxes/" + id).status == 204);
}

TEST_CASE("secrets never reach the log, at debug level: API, envd, virtual and provider keys") {
  TempDir dir;
  const std::string provider_key = "sk-provider-SECRET-7f3c9a1e5b2d4c6a8e0f";
  REQUIRE(sys::write_file(dir.sub("upstream.key"), provider_key + "\n"));
  // An upstream nobody listens on: the model call fails (502) after the key
  // has been looked up and put in the upstream request.
  SandgateProcess s(dir.sub("data"), {"--log-level", "debug", "--openai-base-url", "http://127.0.0.1:1",
                                      "--openai-key-file", dir.sub("upstream.key")});
  REQUIRE(s.started());
  const std::string wrong = "e2b_0123456789abcdef0123456789abcdef01234567";
  CHECK(s.get("/v2/sandboxes", wrong).status == 401);
  Response c = s.post("/v2/sandboxes", R"({"templateID":"base"})");
  REQUIRE(c.status == 201);
  std::string id = body_of(c)["sandboxID"].get<std::string>();
  std::string token = body_of(c)["envdAccessToken"].get<std::string>();
  CliResult vk = run_sandgate({"llm", "key", "create", "local", "--data-dir", s.data_dir()});
  REQUIRE_MESSAGE(vk.exit_code == 0, vk.err);
  std::string vkey = vk.out.substr(0, vk.out.find('\n'));
  REQUIRE(vkey.rfind("sk-sg-", 0) == 0);
  HttpClient http = s.client();
  std::string body = R"({"model":"gpt-x","messages":[{"role":"user","content":"hi"}]})";
  Response m = http.request("POST", "/v1/chat/completions", body,
                            {{"Authorization", "Bearer " + vkey}, {"Content-Type", "application/json"},
                             {"X-Sandgate-Sandbox", id}});
  CHECK(m.status == 502);
  Response bad = http.request("POST", "/v1/chat/completions", body,
                              {{"Authorization", "Bearer sk-sg-" + std::string(48, 'a')},
                               {"Content-Type", "application/json"}});
  CHECK(bad.status == 401);
  Response e = http.request("GET", "/health", "", {{"X-Access-Token", token}});
  (void)e;
  CHECK(s.del("/sandboxes/" + id).status == 204);
  std::string log = s.log();
  CHECK(log.find("debug") != std::string::npos);  // the level took effect
  CHECK(log.find(id) != std::string::npos);       // and this is the server's log
  for (const std::string& secret : {s.key(), wrong, token, vkey, provider_key, std::string(48, 'a')}) {
    INFO("secret " << secret.substr(0, 8) << "...");
    CHECK(log.find(secret) == std::string::npos);
  }
}

TEST_CASE("/metrics with --metrics-token-file: only the bearer of the token reads it; the token is not logged") {
  TempDir dir;
  const std::string token = "metrics-SECRET-9c1d7e3a5f";
  REQUIRE(sys::write_file(dir.sub("metrics.token"), token + "\n"));
  SandgateProcess s(dir.sub("data"), {"--log-level", "debug", "--metrics-token-file", dir.sub("metrics.token")});
  REQUIRE(s.started());
  HttpClient http = s.client();
  for (const std::string& auth : {std::string(), "Bearer wrong-" + token, "Bearer " + token + "x",
                                  "Basic " + token, std::string("Bearer "), token, "bearer " + token}) {
    CAPTURE(auth);
    std::map<std::string, std::string> h;
    if (!auth.empty()) h["Authorization"] = auth;
    Response r = http.request("GET", "/metrics", "", h);
    check_error(r, 401);
    CHECK(r.header("www-authenticate").rfind("Bearer", 0) == 0);
    CHECK(r.body.find("sandgate_") == std::string::npos);
  }
  // An API key is not the metrics token either.
  Response k = http.request("GET", "/metrics", "", {{"Authorization", "Bearer " + s.key()}});
  CHECK(k.status == 401);
  Response ok = http.request("GET", "/metrics", "", {{"Authorization", "Bearer " + token}});
  CHECK(ok.status == 200);
  CHECK(ok.body.find("sandgate_") != std::string::npos);
  // The API is not affected.
  CHECK(s.get("/v2/sandboxes").status == 200);
  CHECK(s.log().find(token) == std::string::npos);

  // A token file that cannot be used stops the start, naming the file.
  REQUIRE(sys::write_file(dir.sub("empty.token"), "\n"));
  for (const std::string& f : {dir.sub("empty.token"), dir.sub("missing.token")}) {
    CliResult r = run_sandgate({"serve", "--listen", "127.0.0.1:0", "--data-dir", dir.sub("data2"),
                                "--metrics-token-file", f});
    CHECK(r.exit_code == 1);
    CHECK_MESSAGE(r.err.find(f) != std::string::npos, r.err);
  }
}

TEST_CASE("bad input gets a clear JSON error and creates nothing") {
  TempDir dir;
  SandgateProcess s(dir.sub("data"), {"--body-limit", "4096"});
  REQUIRE(s.started());
  struct Case {
    const char* body;
    int status;
    const char* needle;
  };
  const Case cases[] = {
      {"{not json", 400, "not valid JSON"},
      {"[1,2]", 400, "JSON object"},
      {R"({"templateID":"base","bogus":1})", 400, "unknown field 'bogus'"},
      {R"({"templateID":7})", 400, "templateID"},
      {R"({})", 400, "templateID"},
      {R"({"templateID":"base","timeout":"soon"})", 400, "timeout"},
      {R"({"templateID":"base","timeout":-1})", 400, "timeout"},
      {R"({"templateID":"base","timeout":99999999999})", 400, "timeout"},
      {R"({"templateID":"base","metadata":{"a":1}})", 400, "metadata.a"},
      {R"({"templateID":"base","envVars":[]})", 400, "envVars"},
      {R"({"templateID":"base","autoPause":"yes"})", 400, "autoPause"},
      {R"({"templateID":"base","volumeMounts":[{"name":"v","path":"/v"}]})", 400, "volume"},
      {R"({"templateID":"base","network":{"allowOut":["1.1.1.1"]}})", 400, "network.allowOut"},
      {R"({"templateID":"base","network":{"egressProxy":{"address":"p:1"}}})", 400, "network.egressProxy"},
      {R"({"templateID":"base","network":{"denyOut":"x"}})", 400, "network.denyOut"},
      {R"({"templateID":"base","secure":true})", 400, "unknown field 'secure'"},  // v1-only field on v2
      {R"({"templateID":"no-such-template"})", 404, "no-such-template"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.body);
    Response r = s.post("/v2/sandboxes", c.body);
    check_error(r, c.status);
    CHECK(body_of(r)["message"].get<std::string>().find(c.needle) != std::string::npos);
  }
  // Denying egress is what every sandbox here gets: accepted.
  Response deny = s.post("/v2/sandboxes", R"({"templateID":"base","network":{"denyOut":["0.0.0.0/0"],"allowOut":[]}})");
  REQUIRE_MESSAGE(deny.status == 201, deny.body);
  CHECK(s.del("/sandboxes/" + body_of(deny)["sandboxID"].get<std::string>()).status == 204);
  Response big = s.post("/v2/sandboxes", std::string(R"({"templateID":"base","metadata":{"x":")") +
                                             std::string(8000, 'y') + "\"}}");
  check_error(big, 413);
  // The same limit holds for a chunked body, which announces no length.
  std::string big_chunk(8000, 'y');
  char hex[16];
  snprintf(hex, sizeof hex, "%zx", big_chunk.size());
  Response bigc = s.client().raw("POST /v2/sandboxes HTTP/1.1\r\nHost: x\r\nX-API-KEY: " + s.key() +
                                 "\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n" +
                                 hex + "\r\n" + big_chunk + "\r\n0\r\n\r\n");
  check_error(bigc, 413);
  check_error(s.client().request("POST", "/v2/sandboxes", "x", {{"X-API-KEY", s.key()}, {"Content-Type", "text/plain"}}), 400);
  // What `curl -d` sends without -H: form content type, JSON body.
  Response form = s.client().request("POST", "/v2/sandboxes", R"({"templateID":"base"})",
                                     {{"X-API-KEY", s.key()}, {"Content-Type", "application/x-www-form-urlencoded"}});
  REQUIRE_MESSAGE(form.status == 201, form.body);
  CHECK(s.del("/sandboxes/" + body_of(form)["sandboxID"].get<std::string>()).status == 204);
  check_error(s.post("/sandboxes/abc/timeout", R"({"timeout":"x"})"), 400);
  check_error(s.get("/v2/sandboxes?state=exploded"), 400);
  check_error(s.get("/v2/sandboxes?limit=0"), 400);
  check_error(s.get("/v2/sandboxes?nextToken=zz"), 400);
  check_error(s.get("/v2/sandboxes?startedAfter=yesterday"), 400);
  check_error(s.get("/v2/sandboxes?metadata=%25zz"), 400);
  check_error(s.get("/nowhere"), 404);
  check_error(s.client().request("PUT", "/v2/sandboxes", "{}", {{"X-API-KEY", s.key()}}), 405);
  CHECK(body_of(s.get("/v2/sandboxes")).empty());
  // Chunked request bodies (the JS SDK sends them) are accepted.
  std::string chunked = "POST /v2/sandboxes HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-API-KEY: " + s.key() +
                        "\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                        "c\r\n{\"templateID\r\n9\r\n\":\"base\"}\r\n0\r\n\r\n";
  Response ch = s.client().raw(chunked);
  REQUIRE_MESSAGE(ch.status == 201, ch.body);
  CHECK(s.del("/sandboxes/" + body_of(ch)["sandboxID"].get<std::string>()).status == 204);
}

TEST_CASE("a slow client is disconnected at the read deadline; malformed HTTP gets 400") {
  TempDir dir;
  SandgateProcess s(dir.sub("data"), {"--read-timeout-ms", "300"});
  REQUIRE(s.started());
  long long ms = s.client().wait_for_close("GET /v2/sandboxes HTTP/1.1\r\nHost: x\r\n", std::chrono::seconds(10));
  CHECK(ms >= 0);
  CHECK(ms < 5000);
  Response bad = s.client().raw("NOT HTTP AT ALL\r\n\r\n");
  CHECK(bad.status == 400);
  // The server still serves.
  CHECK(s.get("/v2/sandboxes").status == 200);
}
