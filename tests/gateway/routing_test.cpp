// Routing of sandbox traffic by headers and by host.
#include <doctest/doctest.h>

#include "base/http/routing.h"

using namespace sg;
using namespace sg::http;

namespace {
HttpRequest req(std::map<std::string, std::string> h) {
  HttpRequest r;
  r.headers = std::move(h);
  return r;
}
}  // namespace

TEST_CASE("headers route to a sandbox, default port 49983") {
  auto t = route_to_sandbox(req({{"e2b-sandbox-id", "abc123"}}), "");
  REQUIRE(t.ok());
  REQUIRE(t->has_value());
  CHECK((*t)->sandbox_id == "abc123");
  CHECK((*t)->port == 49983);
  auto p = route_to_sandbox(req({{"e2b-sandbox-id", "abc123"}, {"e2b-sandbox-port", "8080"}}), "");
  REQUIRE(p.ok());
  CHECK((*p)->port == 8080);
}

TEST_CASE("bad routing headers are client errors") {
  for (const char* port : {"0", "65536", "-1", "80a", "", "999999"}) {
    if (!*port) continue;
    CAPTURE(port);
    auto t = route_to_sandbox(req({{"e2b-sandbox-id", "abc"}, {"e2b-sandbox-port", port}}), "");
    CHECK_FALSE(t.ok());
  }
  CHECK_FALSE(route_to_sandbox(req({{"e2b-sandbox-id", "../etc"}}), "").ok());
  CHECK_FALSE(route_to_sandbox(req({{"e2b-sandbox-id", "ABC"}}), "").ok());
}

TEST_CASE("host-based routing only with a configured domain") {
  auto none = route_to_sandbox(req({{"host", "49983-abc.sg.test"}}), "");
  REQUIRE(none.ok());
  CHECK_FALSE(none->has_value());
  auto t = route_to_sandbox(req({{"host", "8080-abc123.SG.test:8443"}}), "sg.test");
  REQUIRE(t.ok());
  REQUIRE(t->has_value());
  CHECK((*t)->sandbox_id == "abc123");
  CHECK((*t)->port == 8080);
  // The API host and other hosts are not sandbox traffic.
  for (const char* h : {"api.sg.test", "sg.test", "a.b.sg.test", "other.example", "x-abc.sg.test.evil"}) {
    CAPTURE(h);
    auto r = route_to_sandbox(req({{"host", h}}), "sg.test");
    if (r.ok()) CHECK_FALSE(r->has_value());
  }
  CHECK_FALSE(route_to_sandbox(req({{"host", "0-abc.sg.test"}}), "sg.test").ok());
}

TEST_CASE("the unavailable answer has E2B's proxy shape") {
  HttpResponse r = sandbox_unavailable("abc", "The sandbox was not found");
  CHECK(r.status == 502);
  CHECK(r.body == R"({"code":502,"message":"The sandbox was not found","sandboxId":"abc"})");
}

TEST_CASE("a port that does not answer is 502, the code interpreter's 404 naming its template") {
  HttpResponse r = port_unanswered(ProxyTarget{"abc", 8080});
  CHECK(r.status == 502);
  CHECK(r.body.find("no answer from port 8080") != std::string::npos);
  r = port_unanswered(ProxyTarget{"abc", kCodeInterpreterPort});
  CHECK(r.status == 404);
  CHECK(r.body.find("code-interpreter-v1") != std::string::npos);
}
