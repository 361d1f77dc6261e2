// Query decoding: E2B's triple-encoded metadata filter and error mapping.
#include <doctest/doctest.h>

#include "api-e2b/control_plane.h"
#include "api-e2b/requests.h"

using namespace sg;

TEST_CASE("metadata filter: decode once (query), split, decode each part twice more") {
  std::vector<std::pair<std::string, std::string>> q;
  // JS: encodeURIComponent per key/value, join with & and =, encode again.
  REQUIRE(http::parse_query("metadata=user%3Da%2520b%2526c%253Dd%26n%3D1&state=running", q));
  REQUIRE(q.size() == 2);
  CHECK(q[0].first == "metadata");
  std::vector<std::pair<std::string, std::string>> md;
  REQUIRE(api::decode_metadata_query(q[0].second, md));
  REQUIRE(md.size() == 2);
  CHECK(md[0] == std::pair<std::string, std::string>("user", "a b&c=d"));
  CHECK(md[1] == std::pair<std::string, std::string>("n", "1"));
  CHECK_FALSE(api::decode_metadata_query("novalue", md));
  // Exactly what the JS SDK 2.51 sent for {"odd key": "a&b=c d", suite: "e2e"}.
  REQUIRE(http::parse_query("metadata=odd%252520key%3Da%252526b%25253Dc%252520d%26suite%3De2e", q));
  REQUIRE(api::decode_metadata_query(q[0].second, md));
  REQUIRE(md.size() == 2);
  CHECK(md[0] == std::pair<std::string, std::string>("odd key", "a&b=c d"));
  CHECK(md[1] == std::pair<std::string, std::string>("suite", "e2e"));
  // A client that encodes the parts once (urlencode, '+' for space).
  REQUIRE(http::parse_query("metadata=odd%2Bkey%3Da%2526b%253Dc%2Bd", q));
  REQUIRE(api::decode_metadata_query(q[0].second, md));
  REQUIRE(md.size() == 1);
  CHECK(md[0] == std::pair<std::string, std::string>("odd key", "a&b=c d"));
  CHECK_FALSE(api::decode_metadata_query("k=%zz", md));
}

TEST_CASE("percent_decode rejects truncated and bad escapes") {
  std::string out;
  CHECK(http::percent_decode("a%20b", out));
  CHECK(out == "a b");
  CHECK_FALSE(http::percent_decode("a%2", out));
  CHECK_FALSE(http::percent_decode("a%", out));
  CHECK_FALSE(http::percent_decode("%g0", out));
  CHECK(http::percent_decode("a+b", out));
  CHECK(out == "a+b");
  CHECK(http::percent_decode("a+b", out, true));
  CHECK(out == "a b");
}

TEST_CASE("error kinds map to the statuses the SDKs expect") {
  CHECK(api::status_for(invalid_error("x")) == 400);
  CHECK(api::status_for(Error(ErrorKind::kUnauthorized, "x")) == 401);
  CHECK(api::status_for(not_found_error("x")) == 404);
  CHECK(api::status_for(conflict_error("x")) == 409);
  CHECK(api::status_for(Error(ErrorKind::kQuota, "x")) == 429);
  CHECK(api::status_for(Error(ErrorKind::kUnavailable, "x")) == 503);
  http::HttpResponse r = api::error_response(Error(ErrorKind::kQuota, "full"));
  CHECK(r.status == 429);
  bool retry = false;
  for (auto& [k, v] : r.headers) retry |= k == "Retry-After";
  CHECK(retry);
  CHECK(r.body == R"({"code":429,"message":"full"})");
}
