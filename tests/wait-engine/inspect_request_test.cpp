// inspect_request: the model proxy's streaming read of a request body.
#include <doctest/doctest.h>

#include <string>

#include "wait-engine/llm/proxy.h"

using sg::llm::inspect_request;
using sg::llm::RequestFields;

TEST_CASE("inspect_request finds the top-level model and stream") {
  RequestFields f = inspect_request(R"({"messages":[{"role":"user","content":"hi","model":"inner"}],"model":"gpt-x","stream":true})");
  CHECK(f.valid_json);
  CHECK(f.object);
  REQUIRE(f.model);
  CHECK(*f.model == "gpt-x");
  REQUIRE(f.stream);
  CHECK(*f.stream);
  CHECK_FALSE(f.model_not_string);
  CHECK_FALSE(f.stream_not_bool);

  f = inspect_request(R"({"model":"m"})");
  CHECK(f.model == std::optional<std::string>("m"));
  CHECK_FALSE(f.stream);
  // Nested "model"/"stream" keys do not count.
  f = inspect_request(R"({"metadata":{"model":"x","stream":"y"},"tools":[{"stream":1}]})");
  CHECK(f.valid_json);
  CHECK_FALSE(f.model);
  CHECK_FALSE(f.model_not_string);
  CHECK_FALSE(f.stream_not_bool);
}

TEST_CASE("inspect_request reports wrong types, non-objects and malformed JSON") {
  CHECK(inspect_request(R"({"model":42})").model_not_string);
  CHECK(inspect_request(R"({"model":{"name":"x"}})").model_not_string);
  CHECK(inspect_request(R"({"model":["x"]})").model_not_string);
  CHECK(inspect_request(R"({"model":null})").model_not_string);
  CHECK(inspect_request(R"({"model":"m","stream":"yes"})").stream_not_bool);
  CHECK(inspect_request(R"({"model":"m","stream":{}})").stream_not_bool);
  RequestFields arr = inspect_request(R"([{"model":"m"}])");
  CHECK(arr.valid_json);
  CHECK_FALSE(arr.object);
  CHECK_FALSE(arr.model);
  for (const char* bad : {"", "{", R"({"model": )", R"({"model":"m",})", R"({"model":"m"} x)", "\xff", "nul"}) {
    RequestFields b = inspect_request(bad);
    CHECK_MESSAGE(!b.valid_json, bad);
    CHECK_FALSE(b.object);
  }
}

TEST_CASE("inspect_request refuses nesting deeper than 512 without recursion trouble") {
  std::string deep = R"({"model":"m","x":)" + std::string(100000, '[') + std::string(100000, ']') + "}";
  CHECK_FALSE(inspect_request(deep).valid_json);
  std::string ok = R"({"model":"m","x":)" + std::string(500, '[') + std::string(500, ']') + "}";
  RequestFields f = inspect_request(ok);
  CHECK(f.valid_json);
  CHECK(f.model == std::optional<std::string>("m"));
}

TEST_CASE("inspect_request on a large body keeps only the fields") {
  std::string big = R"({"model":"m","messages":[)";
  for (int i = 0; i < 20000; ++i) big += std::string(i ? "," : "") + R"({"role":"user","content":"0123456789abcdef"})";
  big += "]}";
  RequestFields f = inspect_request(big);
  CHECK(f.valid_json);
  CHECK(f.model == std::optional<std::string>("m"));
}
