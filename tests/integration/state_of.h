// state_of(): a sandbox's stored state for an integration test, which
// fails the test when the row is missing.
#pragma once

#include <doctest/doctest.h>

#include "tests/support/sandgate_process.h"

namespace sg::test {

inline SandboxState state_of(const std::string& data_dir, const std::string& id) {
  std::optional<SandboxState> st = sandbox_state(data_dir, id);
  REQUIRE_MESSAGE(st.has_value(), "no row for sandbox " << id);
  return *st;
}

}  // namespace sg::test
