// The model proxy's pure helpers — classify() (which model API route a
// request head is) and provider_error() (the provider's error shape) — and
// the Prometheus histogram it and the coordinator export.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>
#include <map>
#include <optional>
#include <sstream>
#include <string>

#include "wait-engine/llm/proxy.h"
#include "wait-engine/metrics/histogram.h"

using namespace sg;
using namespace sg::llm;
using json = nlohmann::json;

namespace {

http::HttpRequest head(std::string method, std::string path, std::map<std::string, std::string> headers = {}) {
  http::HttpRequest r;
  r.method = std::move(method);
  r.path = path;
  r.target = std::move(path);
  r.headers = std::move(headers);
  return r;
}

std::optional<RouteInfo> route(std::string method, std::string path, std::map<std::string, std::string> h = {}) {
  return classify(head(std::move(method), std::move(path), std::move(h)));
}

}  // namespace

TEST_CASE("classify: the POST routes of both providers") {
  for (const char* p : {"/v1/chat/completions", "/v1/responses", "/v1/completions", "/v1/embeddings"}) {
    CAPTURE(p);
    auto ri = route("POST", p);
    REQUIRE(ri);
    CHECK(ri->provider == Provider::kOpenAI);
    CHECK(ri->route == p);
    CHECK(ri->needs_body);
    // The Anthropic headers do not move an OpenAI route.
    auto with_key = route("POST", p, {{"x-api-key", "k"}, {"anthropic-version", "2023-06-01"}});
    REQUIRE(with_key);
    CHECK(with_key->provider == Provider::kOpenAI);
  }
  for (const char* p : {"/v1/messages", "/v1/messages/count_tokens"}) {
    CAPTURE(p);
    auto ri = route("POST", p);
    REQUIRE(ri);
    CHECK(ri->provider == Provider::kAnthropic);
    CHECK(ri->route == p);
    CHECK(ri->needs_body);
  }
}

TEST_CASE("classify: the POST routes with any other method are not model routes") {
  for (const char* p : {"/v1/chat/completions", "/v1/responses", "/v1/completions", "/v1/embeddings", "/v1/messages",
                        "/v1/messages/count_tokens"})
    for (const char* m : {"GET", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "post"}) {
      CAPTURE(p);
      CAPTURE(m);
      CHECK_FALSE(route(m, p));
    }
}

TEST_CASE("classify: GET /v1/models, by provider") {
  auto openai = route("GET", "/v1/models");
  REQUIRE(openai);
  CHECK(openai->provider == Provider::kOpenAI);
  CHECK(openai->route == "/v1/models");
  CHECK_FALSE(openai->needs_body);
  auto bearer = route("GET", "/v1/models", {{"authorization", "Bearer sk-x"}});
  REQUIRE(bearer);
  CHECK(bearer->provider == Provider::kOpenAI);
  for (const auto& h : std::map<std::string, std::string>{{"anthropic-version", "2023-06-01"}, {"x-api-key", "k"}}) {
    CAPTURE(h.first);
    auto a = route("GET", "/v1/models", {h});
    REQUIRE(a);
    CHECK(a->provider == Provider::kAnthropic);
    CHECK(a->route == "/v1/models");
    CHECK_FALSE(a->needs_body);
  }
  // An empty header value is no evidence.
  auto empty = route("GET", "/v1/models", {{"x-api-key", ""}});
  REQUIRE(empty);
  CHECK(empty->provider == Provider::kOpenAI);

  auto one = route("GET", "/v1/models/gpt-4o-mini");
  REQUIRE(one);
  CHECK(one->provider == Provider::kOpenAI);
  CHECK(one->route == "/v1/models/{id}");
  CHECK_FALSE(one->needs_body);
  auto claude = route("GET", "/v1/models/claude-sonnet-4-5", {{"anthropic-version", "2023-06-01"}});
  REQUIRE(claude);
  CHECK(claude->provider == Provider::kAnthropic);
  CHECK(claude->route == "/v1/models/{id}");
}

TEST_CASE("classify: near misses are not model routes") {
  for (const char* p : {"/v1/models/a/b", "/v1/models/", "/v1/models//x", "/v1/modelsX", "/v1/model", "/v2/models",
                        "/V1/models", "v1/models", "/v1/models/a/"}) {
    CAPTURE(p);
    CHECK_FALSE(route("GET", p));
  }
  for (const char* m : {"POST", "PUT", "DELETE", "HEAD"}) {
    CAPTURE(m);
    CHECK_FALSE(route(m, "/v1/models"));
    CHECK_FALSE(route(m, "/v1/models/gpt-4o"));
  }
  for (const char* p : {"/v1/chat/completions/", "/v1/chat/completion", "/v1/chat", "/v1/messagesX", "/v1/messages/",
                        "/v1/messages/count_tokens/", "/v1/messages/batches", "/v1//messages", "/v1/Messages",
                        "/chat/completions", "/v1/embeddings/x", "", "/", "/v1", "/v1/"}) {
    CAPTURE(p);
    CHECK_FALSE(route("POST", p));
  }
}

namespace {

struct Shape {
  int status;
  const char* openai_type;
  std::optional<const char*> openai_code;  // nullopt: null
  const char* anthropic_type;
};

}  // namespace

TEST_CASE("provider_error: each provider's shape, with the type for the status") {
  const Shape shapes[] = {
      {400, "invalid_request_error", std::nullopt, "invalid_request_error"},
      {401, "invalid_request_error", "invalid_api_key", "authentication_error"},
      {403, "invalid_request_error", std::nullopt, "permission_error"},
      {404, "invalid_request_error", "not_found", "not_found_error"},
      {413, "invalid_request_error", std::nullopt, "request_too_large"},
      {429, "rate_limit_exceeded", "rate_limit_exceeded", "rate_limit_error"},
      {500, "server_error", std::nullopt, "api_error"},
      {502, "server_error", std::nullopt, "api_error"},
      {503, "server_error", std::nullopt, "api_error"},
      {529, "server_error", std::nullopt, "overloaded_error"},
  };
  const std::string msg = "what failed: \"quoted\", a\nnewline and ünïcode";
  for (const Shape& s : shapes) {
    CAPTURE(s.status);
    http::HttpResponse o = provider_error(Provider::kOpenAI, s.status, msg);
    CHECK(o.status == s.status);
    CHECK(o.content_type == "application/json");
    json ob = json::parse(o.body, nullptr, false);
    REQUIRE(ob.is_object());
    CHECK(ob.size() == 1);
    REQUIRE(ob.contains("error"));
    const json& oe = ob["error"];
    REQUIRE(oe.is_object());
    CHECK(oe.size() == 4);
    CHECK(oe.value("message", "") == msg);
    CHECK(oe.value("type", "") == s.openai_type);
    REQUIRE(oe.contains("param"));
    CHECK(oe["param"].is_null());
    REQUIRE(oe.contains("code"));
    if (s.openai_code)
      CHECK(oe["code"] == *s.openai_code);
    else
      CHECK(oe["code"].is_null());

    http::HttpResponse a = provider_error(Provider::kAnthropic, s.status, msg);
    CHECK(a.status == s.status);
    CHECK(a.content_type == "application/json");
    json ab = json::parse(a.body, nullptr, false);
    REQUIRE(ab.is_object());
    CHECK(ab.size() == 2);
    CHECK(ab.value("type", "") == "error");
    REQUIRE(ab.contains("error"));
    const json& ae = ab["error"];
    REQUIRE(ae.is_object());
    CHECK(ae.size() == 2);
    CHECK(ae.value("type", "") == s.anthropic_type);
    CHECK(ae.value("message", "") == msg);
  }
}

TEST_CASE("provider_error: a message with bytes that are not UTF-8 still gives a JSON body") {
  // Messages quote client input (a path, an X-Sandgate-Sandbox id cut at 64
  // bytes): nlohmann's dump() throws on invalid UTF-8 unless told otherwise.
  const std::string bad = "X-Sandgate-Sandbox: sandbox \"\xff\xfe\xc3\" is not running";
  for (Provider p : {Provider::kOpenAI, Provider::kAnthropic}) {
    std::string provider = provider_name(p);
    CAPTURE(provider);
    http::HttpResponse r(provider_error(p, 404, "ok"));
    CHECK_NOTHROW(r = provider_error(p, 404, bad));
    CHECK(r.status == 404);
    json b = json::parse(r.body, nullptr, false);
    REQUIRE(b.is_object());
    std::string m = b["error"].value("message", "");
    CHECK(m.find("X-Sandgate-Sandbox: sandbox") == 0);
    CHECK(m.find("is not running") != std::string::npos);
  }
}

TEST_CASE("histogram: cumulative buckets, +Inf is the count, and the sum") {
  metrics::Histogram h({1, 2, 5});
  for (double v : {0.5, 1.0, 1.5, 5.0, 7.0, 0.0}) h.observe(v);
  CHECK(h.count() == 6);
  std::string out;
  h.render(out, "t_seconds", "A test histogram.");
  std::istringstream in(out);
  std::string line;
  std::vector<std::string> lines;
  while (std::getline(in, line)) lines.push_back(line);
  REQUIRE(lines.size() == 2 + 4 + 2);
  CHECK(lines[0] == "# HELP t_seconds A test histogram.");
  CHECK(lines[1] == "# TYPE t_seconds histogram");
  CHECK(lines[2] == "t_seconds_bucket{le=\"1\"} 3");  // an observation equal to a bound is in its bucket
  CHECK(lines[3] == "t_seconds_bucket{le=\"2\"} 4");
  CHECK(lines[4] == "t_seconds_bucket{le=\"5\"} 5");
  CHECK(lines[5] == "t_seconds_bucket{le=\"+Inf\"} 6");
  CHECK(lines[6] == "t_seconds_sum 15");
  CHECK(lines[7] == "t_seconds_count 6");

  metrics::Histogram empty(metrics::latency_bounds());
  std::string e;
  empty.render(e, "e", "Empty.");
  CHECK(e.find("e_bucket{le=\"+Inf\"} 0\n") != std::string::npos);
  CHECK(e.find("e_sum 0\ne_count 0\n") != std::string::npos);
  CHECK(e.find("e_bucket{le=\"0.0001\"} 0\n") != std::string::npos);
}

TEST_CASE("histogram: sub-second sums keep their precision") {
  metrics::Histogram h(metrics::latency_bounds());
  for (int i = 0; i < 1000; ++i) h.observe(0.000123);
  std::string out;
  h.render(out, "x", "X.");
  CHECK(out.find("x_sum 0.123\n") != std::string::npos);
  CHECK(out.find("x_bucket{le=\"0.0001\"} 0\n") != std::string::npos);
  CHECK(out.find("x_bucket{le=\"0.00025\"} 1000\n") != std::string::npos);
}

TEST_CASE("metrics: samples, headers and label escaping") {
  std::string out;
  metrics::render_header(out, "a_total", "counter", "Things.");
  metrics::render_sample(out, "a_total", "", 3);
  metrics::render_sample(out, "a_total", "k=\"" + metrics::escape_label("q\"b\\s\nn") + "\"", 0.5);
  CHECK(out == "# HELP a_total Things.\n# TYPE a_total counter\na_total 3\na_total{k=\"q\\\"b\\\\s\\nn\"} 0.5\n");
}
