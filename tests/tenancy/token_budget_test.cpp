// TokenBudget with an injected clock.
#include <doctest/doctest.h>

#include "tenancy/token_budget.h"

using sg::tenancy::TokenBudget;

TEST_CASE("token budget: spend, refuse with a retry time, refill, per tenant") {
  uint64_t now = 1'000'000'000;
  TokenBudget b(600, [&] { return now; });  // 600 tokens a minute: 10 per second
  CHECK(b.admit("a") == 0);
  b.charge("a", 600);
  // Balance 0: refused; 1 token comes after 0.1 s, so retry in 1 s.
  CHECK(b.admit("a") == 1);
  CHECK(b.admit("b") == 0);  // other tenants are untouched
  // A response bigger than the budget drives it negative: 300 over = 30 s.
  b.charge("a", 300);
  int64_t wait = b.admit("a");
  CHECK(wait >= 30);
  CHECK(wait <= 31);
  now += 29'000'000'000ull;
  CHECK(b.admit("a") > 0);
  now += 2'000'000'000ull;
  CHECK(b.admit("a") == 0);
  // Refill stops at the cap.
  now += 3600'000'000'000ull;
  CHECK(b.balance("a") == doctest::Approx(600));
}

TEST_CASE("token budget: per_min <= 0 disables it") {
  uint64_t now = 0;
  TokenBudget b(0, [&] { return now; });
  b.charge("a", 1'000'000);
  CHECK(b.admit("a") == 0);
}
