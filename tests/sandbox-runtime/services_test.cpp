// Agent OPEN payloads for gateway services (channel/services.h): what the
// host accepts from the sandbox, and what the agent sends.
#include "sandbox-runtime/channel/services.h"

#include <doctest/doctest.h>

#include <string>

using namespace sg;

TEST_CASE("parse_service_open accepts exactly {\"service\":\"[a-z0-9-]{1,32}\"}") {
  for (auto [payload, name] : {std::pair<std::string, std::string>{R"({"service":"llm"})", "llm"},
                               {R"( { "service" : "model-api-2" } )", "model-api-2"},
                               {R"({"service":"-"})", "-"},
                               {"{\"service\":\"" + std::string(32, 'a') + "\"}", std::string(32, 'a')}}) {
    CAPTURE(payload);
    auto r = channel::parse_service_open(payload);
    REQUIRE_MESSAGE(r, (r ? "" : r.error().message()));
    CHECK(*r == name);
  }
  auto llm = channel::parse_service_open(channel::service_open_payload(channel::kServiceLlm));
  REQUIRE(llm);
  CHECK(*llm == channel::kServiceLlm);
  CHECK(channel::service_open_payload(channel::kServiceLlm) == R"({"service":"llm"})");
}

TEST_CASE("parse_service_open rejects everything else as kInvalid") {
  for (std::string bad : {
           std::string(""),
           std::string("llm"),
           std::string("[]"),
           std::string("{}"),
           std::string("null"),
           std::string(R"("llm")"),
           std::string(R"({"service":"llm")"),  // truncated
           std::string(R"({"service":""})"),
           "{\"service\":\"" + std::string(33, 'a') + "\"}",
           std::string(R"({"service":"LLM"})"),
           std::string(R"({"service":"ll m"})"),
           std::string(R"({"service":"a_b"})"),
           std::string(R"({"service":"a/b"})"),
           std::string(R"({"service":"llm\u0000"})"),
           std::string("{\"service\":\"ll\xc3\xa9\"}"),
           std::string(R"({"service":1})"),
           std::string(R"({"service":null})"),
           std::string(R"({"service":["llm"]})"),
           std::string(R"({"service":"llm","extra":1})"),
           std::string(R"({"port":80})"),
           std::string(R"({"Service":"llm"})"),
           std::string("{\"service\":\"llm\"}\x01"),
       }) {
    CAPTURE(bad);
    auto r = channel::parse_service_open(bad);
    REQUIRE_FALSE(r);
    CHECK(r.error().kind() == ErrorKind::kInvalid);
    CHECK_FALSE(r.error().message().empty());
  }
}
