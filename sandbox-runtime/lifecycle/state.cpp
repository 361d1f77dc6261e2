// The lifecycle's transition table (docs/design.md, "Sandbox lifecycle").
#include "sandbox-runtime/lifecycle/state.h"

namespace sg::lifecycle {
namespace {

constexpr uint32_t bit(State s) { return 1u << static_cast<unsigned>(s); }

// kNext[from]: the states from may move to. The only place transitions are
// written down; the table test (tests/sandbox-runtime/lifecycle_state_test
// .cpp) spells out the same matrix by hand.
constexpr uint32_t kEnd = bit(State::kKilled) | bit(State::kLost);
constexpr uint32_t kNext[kStateCount] = {
    /* creating     */ bit(State::kRunning) | bit(State::kFailed),
    /* running      */ bit(State::kPaused) | bit(State::kWaitPaused) | bit(State::kSnapshotting) | kEnd,
    /* paused       */ bit(State::kRunning) | bit(State::kSnapshotting) | kEnd,
    // A client's pause during a wait wins: the wait's resume leaves it paused.
    /* wait-paused  */ bit(State::kRunning) | bit(State::kPaused) | bit(State::kOffloading) | kEnd,
    // An offload that moved nothing (cancelled, refused) leaves it wait-paused.
    /* offloading   */ bit(State::kOffloaded) | bit(State::kWaitPaused) | kEnd,
    // Resumed with the predicted pages in, the rest faulting back on demand.
    /* offloaded    */ bit(State::kRunning) | bit(State::kPaused) | kEnd,
    /* snapshotting */ bit(State::kRunning) | bit(State::kPaused) | bit(State::kPersisted) | kEnd,
    /* persisted    */ bit(State::kRunning) | kEnd,
    /* killed       */ 0,
    /* lost         */ 0,
    /* failed       */ 0,
};

}  // namespace

bool legal(State from, State to) {
  auto f = static_cast<unsigned>(from), t = static_cast<unsigned>(to);
  if (f >= kStateCount || t >= kStateCount) return false;
  return (kNext[f] & bit(to)) != 0;
}

bool terminal(State s) { return s == State::kKilled || s == State::kLost || s == State::kFailed; }

std::string_view stored_state(State s) {
  switch (s) {
    case State::kCreating: return "creating";
    case State::kRunning:
    case State::kWaitPaused:
    case State::kOffloading:
    case State::kOffloaded: return "running";
    case State::kPaused:
    case State::kPersisted: return "paused";
    // A snapshot is taken of a running or a paused sandbox; the caller
    // keeps the row as it was (snapshotting never changes it).
    case State::kSnapshotting: return "";
    case State::kKilled: return "killed";
    case State::kLost: return "lost";
    case State::kFailed: return "failed";
  }
  return "";
}

std::string_view name(State s) {
  switch (s) {
    case State::kCreating: return "creating";
    case State::kRunning: return "running";
    case State::kPaused: return "paused";
    case State::kWaitPaused: return "wait-paused";
    case State::kOffloading: return "offloading";
    case State::kOffloaded: return "offloaded";
    case State::kSnapshotting: return "snapshotting";
    case State::kPersisted: return "persisted";
    case State::kKilled: return "killed";
    case State::kLost: return "lost";
    case State::kFailed: return "failed";
  }
  return "?";
}

}  // namespace sg::lifecycle
