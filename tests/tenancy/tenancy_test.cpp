// Tenancy: key format, hashing, authentication, rate limiting.
#include <doctest/doctest.h>

#include <regex>

#include "tests/support/temp_dir.h"
#include "tenancy/api_key.h"
#include "tenancy/rate_limiter.h"
#include "tenancy/tenants.h"

using namespace sg;
using namespace sg::tenancy;

TEST_CASE("generated keys are e2b_ plus 40 lowercase hex and distinct") {
  std::string a = generate_api_key(), b = generate_api_key();
  CHECK(std::regex_match(a, std::regex("e2b_[0-9a-f]{40}")));
  CHECK(a != b);
  CHECK(is_well_formed_api_key(a));
  CHECK_FALSE(is_well_formed_api_key("e2b_" + std::string(40, 'A')));
  CHECK_FALSE(is_well_formed_api_key("e2b_" + std::string(39, 'a')));
  CHECK_FALSE(is_well_formed_api_key("xyz_" + std::string(40, 'a')));
  CHECK_FALSE(is_well_formed_api_key(""));
}

TEST_CASE("the key hash is SHA-256") {
  // SHA-256("abc"), FIPS 180-2 test vector.
  CHECK(hash_api_key("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST_CASE("tenants: create returns a key that authenticates; the key is not stored") {
  test::TempDir dir;
  auto store = storage::Store::open(dir.sub("t.db"));
  REQUIRE(store.ok());
  Tenants tenants(**store);
  auto k = tenants.create("acme", Quota{});
  REQUIRE(k.ok());
  auto t = tenants.authenticate(k->key);
  REQUIRE(t.ok());
  CHECK(t->name == "acme");
  CHECK(k->row.key_hash != k->key);
  // No column of the key table holds the key itself.
  auto keys = (*store)->list_keys(t->id);
  REQUIRE(keys->size() == 1);
  CHECK((*keys)[0].key_hash.find(k->key.substr(4)) == std::string::npos);
  CHECK((*keys)[0].key_prefix.size() < k->key.size());

  auto dup = tenants.create("acme", Quota{});
  REQUIRE(!dup.ok());
  CHECK(dup.error().kind() == ErrorKind::kConflict);
  auto bad = tenants.create("a b", Quota{});
  REQUIRE(!bad.ok());
  CHECK(bad.error().kind() == ErrorKind::kInvalid);

  auto unknown = tenants.authenticate(generate_api_key());
  REQUIRE(!unknown.ok());
  CHECK(unknown.error().kind() == ErrorKind::kUnauthorized);
  auto malformed = tenants.authenticate("nonsense");
  REQUIRE(!malformed.ok());
  CHECK(malformed.error().kind() == ErrorKind::kUnauthorized);

  auto k2 = tenants.add_key("acme");
  REQUIRE(k2.ok());
  REQUIRE(*(*store)->revoke_key(k->row.id, 1));
  CHECK_FALSE(tenants.authenticate(k->key).ok());
  CHECK(tenants.authenticate(k2->key).ok());
}

TEST_CASE("rate limiter: burst, then Retry-After, then refill with the clock") {
  uint64_t now = 1'000'000'000;
  RateLimiter rl(2.0, 3.0, [&] { return now; });
  CHECK(rl.acquire("a") == 0);
  CHECK(rl.acquire("a") == 0);
  CHECK(rl.acquire("a") == 0);
  int64_t wait = rl.acquire("a");
  CHECK(wait == 1);
  CHECK(rl.acquire("b") == 0);  // buckets are per key
  now += 500'000'000;             // half a second: one token at 2/s
  CHECK(rl.acquire("a") == 0);
  CHECK(rl.acquire("a") >= 1);
  RateLimiter off(0, 0, [&] { return now; });
  for (int i = 0; i < 100; ++i) CHECK(off.acquire("x") == 0);
}
