// The wait history (wait_history.cpp): the EWMA of wait lengths per tenant
// and model that the coordinator's offload decision reads.
#include <doctest/doctest.h>

#include "wait-engine/coordinator/wait_history.h"

using namespace sg::wait;

TEST_CASE("wait history: EWMA per tenant and model, unknown until enough samples, bounded") {
  WaitHistory h(0.5, 2, 3);
  h.record("t1", "gpt", 1000);
  CHECK_FALSE(h.mean_ns("t1", "gpt"));
  h.record("t1", "gpt", 3000);
  CHECK(h.mean_ns("t1", "gpt") == 2000);
  CHECK(h.expected_remaining_ns("t1", "gpt", 500) == 1500);
  CHECK(h.expected_remaining_ns("t1", "gpt", 5000) == 0);
  CHECK_FALSE(h.mean_ns("t2", "gpt"));
  h.record("a", "m", 1);
  h.record("b", "m", 1);
  h.record("c", "m", 1);  // evicts the least recently updated: t1/gpt
  CHECK(h.keys() == 3);
  CHECK_FALSE(h.mean_ns("t1", "gpt"));
}
