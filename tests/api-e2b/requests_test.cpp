// The control plane's request parsers (api-e2b/requests.h): bounds, strict
// fields, and the kInvalid errors the HTTP layer turns into 400s.
#include "api-e2b/requests.h"

#include <doctest/doctest.h>

using namespace sg;
using namespace sg::api;

namespace {

http::HttpRequest body(std::string b, std::string content_type = "application/json") {
  http::HttpRequest r;
  r.method = "POST";
  r.body = std::move(b);
  if (!content_type.empty()) r.headers["content-type"] = std::move(content_type);
  return r;
}

template <typename R>
std::string invalid(const R& r) {
  REQUIRE_FALSE(r);
  CHECK(r.error().kind() == ErrorKind::kInvalid);
  return r.error().message();
}

}  // namespace

TEST_CASE("requests: create takes E2B's fields, refuses unknown ones and out-of-range values") {
  auto c = parse_create_request(body(R"({"templateID":"base","timeout":60,"envVars":{"A":"1"},"autoPause":true})"), true);
  REQUIRE(c);
  CHECK(c->template_ref == "base");
  CHECK(c->timeout_s == 60);
  CHECK(c->on_timeout_pause);
  CHECK_FALSE(c->on_timeout_pause_files);
  CHECK(c->env_vars.at("A") == "1");
  auto files = parse_create_request(body(R"({"templateID":"base","autoPause":true,"autoPauseMemory":false})"), true);
  REQUIRE(files);
  CHECK(files->on_timeout_pause_files);
  CHECK_FALSE(parse_create_request(body(R"({"templateID":"base","autoPauseMemory":false})"), true)->on_timeout_pause_files);
  CHECK(parse_create_request(body(R"({"templateID":"base"})"), false)->timeout_s == 15);  // v1 default
  CHECK(invalid(parse_create_request(body(R"({"templateID":"base","secure":true})"), true)).find("'secure'") !=
        std::string::npos);  // v1 only
  CHECK(invalid(parse_create_request(body(R"({"templateID":"base","timeout":86401})"), true)).find("between") !=
        std::string::npos);
  CHECK(invalid(parse_create_request(body(R"({"templateID":"base","envVars":{"A=B":"x"}})"), true))
            .find("invalid name") != std::string::npos);
  CHECK(invalid(parse_create_request(body("[1]"), true)).find("JSON object") != std::string::npos);
  CHECK(invalid(parse_create_request(body("", ""), true)).find("empty") != std::string::npos);
  CHECK(invalid(parse_create_request(body(R"({"templateID":"base"})", "text/plain"), true))
            .find("content type") != std::string::npos);
}

TEST_CASE("requests: create's network fields become the sandbox's egress policy") {
  auto c = parse_create_request(
      body(R"({"templateID":"base","allow_internet_access":false,"network":{"allowOut":["1.1.1.1","*.pypi.org"],"denyOut":["10.0.0.0/8"]}})"),
      true);
  REQUIRE(c);
  CHECK(c->network.asks_egress);
  CHECK_FALSE(c->network.egress.internet);
  CHECK(c->network.egress.allow_nets.size() == 1);
  CHECK(c->network.egress.allow_names == std::vector<std::string>{"*.pypi.org"});
  CHECK(c->network.egress.deny_nets.size() == 1);
  auto plain = parse_create_request(body(R"({"templateID":"base"})"), true);
  REQUIRE(plain);
  CHECK_FALSE(plain->network.asks_egress);
  CHECK(plain->network.egress.internet);  // E2B's default
  CHECK(invalid(parse_create_request(body(R"({"templateID":"base","network":{"allowOut":[1]}})"), true))
            .find("must hold strings") != std::string::npos);
  CHECK(invalid(parse_create_request(body(R"({"templateID":"base","network":{"denyOut":["example.com"]}})"), true))
            .find("denyOut") != std::string::npos);
  CHECK(invalid(parse_create_request(body(R"({"templateID":"base","network":{"rules":{"a.com":[{}]}}})"), true))
            .find("network.rules") != std::string::npos);
  CHECK(parse_create_request(body(R"({"templateID":"base","network":{"rules":{}}})"), true));
}

TEST_CASE("requests: connect, resume, pause and timeout bodies") {
  CHECK_FALSE(parse_connect_request(body("", ""))->has_value());  // empty body: no timeout
  CHECK(**parse_connect_request(body(R"({"timeout":30,"memory":true})")) == 30);
  CHECK(invalid(parse_connect_request(body(R"({"autoPause":true})"))).find("'autoPause'") != std::string::npos);
  CHECK(**parse_resume_request(body(R"({"timeout":15,"autoPause":false})")) == 15);
  CHECK(invalid(parse_resume_request(body(R"({"timeout":"15"})"))).find("integer") != std::string::npos);
  CHECK(parse_pause_request(body(R"({"memory":false})")).value() == false);
  CHECK(parse_pause_request(body(R"({"memory":true})")).value() == true);
  CHECK(parse_pause_request(body("")).value() == true);
  CHECK_FALSE(parse_pause_request(body(R"({"memory":1})")));
  CHECK(*parse_timeout_request(body(R"({"timeout":0})")) == 0);
  CHECK(invalid(parse_timeout_request(body("{}"))).find("required") != std::string::npos);
  CHECK(invalid(parse_timeout_request(body(R"({"timeout":18446744073709551615})"))).find("between") !=
        std::string::npos);
}

TEST_CASE("requests: list and metrics queries") {
  auto q = parse_list_query("state=paused&limit=5&order=desc&nextToken=7&template=base", true);
  REQUIRE(q);
  CHECK(q->states == std::vector<std::string>{"paused"});
  CHECK(q->limit == 5);
  CHECK(q->descending);
  CHECK(q->after_seq == 7);
  CHECK(q->template_id == "base");
  CHECK(parse_list_query("", false)->states == std::vector<std::string>{"running"});  // v1: running only
  CHECK(parse_list_query("limit=500", false)->limit == 100);  // v1 ignores v2 parameters
  CHECK(invalid(parse_list_query("limit=0", true)).find("1 to 100") != std::string::npos);
  CHECK(invalid(parse_list_query("state=killed", true)).find("running and/or paused") != std::string::npos);
  CHECK(invalid(parse_list_query("startedAfter=yesterday", true)).find("RFC 3339") != std::string::npos);
  CHECK(invalid(parse_list_query("metadata=novalue", true)).find("metadata") != std::string::npos);
  auto m = parse_metrics_query("start=10&end=20&other=x");
  REQUIRE(m);
  CHECK(*m->start == 10);
  CHECK(*m->end == 20);
  CHECK(invalid(parse_metrics_query("start=-1")).find("unix seconds") != std::string::npos);
  CHECK(path_segments("//v2//sandboxes/abc/") == std::vector<std::string>{"v2", "sandboxes", "abc"});
}

TEST_CASE("requests: updateNetwork's body replaces the egress configuration") {
  auto put = [](const std::string& b) { return parse_network_update(body(b)); };
  auto n = put(R"({"allowOut":["1.1.1.1","*.pypi.org"],"denyOut":["0.0.0.0/0"],"allow_internet_access":false})");
  REQUIRE(n);
  CHECK(n->asks_egress);
  CHECK(n->allow_out == std::vector<std::string>{"1.1.1.1", "*.pypi.org"});
  CHECK(n->deny_out == std::vector<std::string>{"0.0.0.0/0"});
  CHECK(n->allow_internet == std::optional<bool>(false));
  CHECK_FALSE(n->egress.internet);
  CHECK(n->egress.allow_names == std::vector<std::string>{"*.pypi.org"});
  // Everything omitted: cleared, E2B's defaults.
  auto empty = put("{}");
  REQUIRE(empty);
  CHECK_FALSE(empty->asks_egress);
  CHECK_FALSE(empty->allow_internet.has_value());
  CHECK(empty->egress.internet);
  CHECK(put(R"({"rules":{}})"));
  CHECK(invalid(put(R"({"allowOut":[1]})")).find("'allowOut' must hold strings") != std::string::npos);
  CHECK(invalid(put(R"({"allowOut":"1.1.1.1"})")).find("'allowOut' must be an array") != std::string::npos);
  CHECK(invalid(put(R"({"denyOut":["example.com"]})")).find("field 'denyOut': 'example.com'") != std::string::npos);
  CHECK(invalid(put(R"({"allowOut":["no such name!"]})")).find("field 'allowOut'") != std::string::npos);
  CHECK(invalid(put(R"({"rules":{"a.com":[{}]}})")).find("'rules'") != std::string::npos);
  CHECK(invalid(put(R"({"egressProxy":{"address":"10.0.0.1:3128"}})")).find("egressProxy") != std::string::npos);
  CHECK(invalid(put(R"({"allow_internet_access":"no"})")).find("allow_internet_access") != std::string::npos);
  CHECK(invalid(put(R"({"maskRequestHost":"x"})")).find("maskRequestHost") != std::string::npos);
  CHECK(invalid(put("[]")).size() > 0);
}
