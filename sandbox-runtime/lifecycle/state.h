// The sandbox lifecycle as one state machine: every state a sandbox can be
// in, and the one table of legal transitions between them.
//
// A live sandbox holds exactly one State (api-e2b/sandboxes.h keeps it per
// sandbox, under that sandbox's operation lock); the state stored in SQLite
// is written from it (stored_state()), never kept beside it. Wait pauses and
// offloads are states too, so "paused by a client" and "frozen for a model
// wait" can no longer be true at once. docs/design.md ("Sandbox lifecycle")
// draws the table.
//
// Pure: no I/O, no locks. Thread-safe (constants only).
#pragma once

#include <cstdint>
#include <string_view>

namespace sg::lifecycle {

enum class State : uint8_t {
  kCreating,      // row inserted, the runtime is starting it
  kRunning,       // its processes run; traffic flows
  kPaused,        // stopped by a client (pause, connect resumes) or onTimeout=pause
  kWaitPaused,    // frozen for a model wait; clients still see it running
  kOffloading,    // wait-paused, its guest memory moving into the pool
  kOffloaded,     // wait-paused, (part of) its guest memory in the pool
  kSnapshotting,  // stopped while its state is written out (snapshots, fork, durable pause: issue 21)
  kPersisted,     // paused with its whole state on disk, no process left (durable pause: issue 21)
  kKilled,        // ended by a client, a timeout or a revoked tenant
  kLost,          // ended by itself (its processes died, memory lost) or by a sandgate stop
  kFailed,        // never ran: the runtime could not start it
};
inline constexpr int kStateCount = static_cast<int>(State::kFailed) + 1;

// Whether from -> to is a transition of the lifecycle (docs/design.md).
// A state to itself is not a transition. Terminal states have none.
bool legal(State from, State to);

// Killed, lost, failed: the sandbox is gone and holds nothing.
bool terminal(State s);

// The state clients see and SQLite stores ("running", "paused", ...): a
// wait pause, an offload and a snapshot in progress are invisible, as in
// E2B; a persisted sandbox is "paused".
std::string_view stored_state(State s);

// "creating", "running", "wait-paused", ... (logs, events, tests).
std::string_view name(State s);

}  // namespace sg::lifecycle
