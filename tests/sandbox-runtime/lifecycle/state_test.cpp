// The lifecycle's transition table, spelled out by hand: every (from, to)
// pair of the 11 states is checked against this matrix, so a transition
// added to or dropped from sandbox-runtime/lifecycle/state.cpp without
// changing the documented lifecycle fails here.
#include <doctest/doctest.h>

#include <string>

#include "sandbox-runtime/lifecycle/state.h"

using sg::lifecycle::State;

namespace {

// Rows: from; columns: to, in enum order
// (creating running paused wait-paused offloading offloaded snapshotting
//  persisted killed lost failed). 'x' = legal.
const char* const kMatrix[sg::lifecycle::kStateCount] = {
    // cr ru pa wp of od sn pe ki lo fa
    ". x . . . . . . . . x",  // creating
    ". . x x . . x . x x .",  // running
    ". x . . . . x . x x .",  // paused
    ". x x . x . . . x x .",  // wait-paused
    ". . . x . x . . x x .",  // offloading
    ". x x . . . . . x x .",  // offloaded
    ". x x . . . . x x x .",  // snapshotting
    ". x . . . . . . x x .",  // persisted
    ". . . . . . . . . . .",  // killed
    ". . . . . . . . . . .",  // lost
    ". . . . . . . . . . .",  // failed
};

State st(int i) { return static_cast<State>(i); }

}  // namespace

TEST_CASE("lifecycle: the transition table is the documented matrix") {
  int legal_count = 0;
  for (int f = 0; f < sg::lifecycle::kStateCount; ++f) {
    std::string row = kMatrix[f];
    for (int t = 0; t < sg::lifecycle::kStateCount; ++t) {
      bool want = row.at(static_cast<size_t>(t) * 2) == 'x';
      INFO(std::string(sg::lifecycle::name(st(f))) << " -> " << std::string(sg::lifecycle::name(st(t))));
      CHECK(sg::lifecycle::legal(st(f), st(t)) == want);
      legal_count += want;
    }
  }
  CHECK(legal_count == 32);
}

TEST_CASE("lifecycle: terminal states have no way out, and only they") {
  for (int f = 0; f < sg::lifecycle::kStateCount; ++f) {
    bool any = false;
    for (int t = 0; t < sg::lifecycle::kStateCount; ++t) any |= sg::lifecycle::legal(st(f), st(t));
    INFO(std::string(sg::lifecycle::name(st(f))));
    CHECK(sg::lifecycle::terminal(st(f)) == !any);
  }
  // Every live state can end: a kill or a death is always possible.
  for (int f = 0; f < sg::lifecycle::kStateCount; ++f) {
    if (sg::lifecycle::terminal(st(f)) || st(f) == State::kCreating) continue;
    CHECK(sg::lifecycle::legal(st(f), State::kKilled));
    CHECK(sg::lifecycle::legal(st(f), State::kLost));
  }
  CHECK_FALSE(sg::lifecycle::legal(static_cast<State>(200), State::kRunning));
  CHECK_FALSE(sg::lifecycle::legal(State::kRunning, static_cast<State>(200)));
}

TEST_CASE("lifecycle: clients see a wait pause and an offload as running") {
  CHECK(sg::lifecycle::stored_state(State::kCreating) == "creating");
  CHECK(sg::lifecycle::stored_state(State::kRunning) == "running");
  CHECK(sg::lifecycle::stored_state(State::kWaitPaused) == "running");
  CHECK(sg::lifecycle::stored_state(State::kOffloading) == "running");
  CHECK(sg::lifecycle::stored_state(State::kOffloaded) == "running");
  CHECK(sg::lifecycle::stored_state(State::kPaused) == "paused");
  CHECK(sg::lifecycle::stored_state(State::kPersisted) == "paused");
  CHECK(sg::lifecycle::stored_state(State::kSnapshotting).empty());
  CHECK(sg::lifecycle::stored_state(State::kKilled) == "killed");
  CHECK(sg::lifecycle::stored_state(State::kLost) == "lost");
  CHECK(sg::lifecycle::stored_state(State::kFailed) == "failed");
  CHECK(sg::lifecycle::name(State::kWaitPaused) == "wait-paused");
}
