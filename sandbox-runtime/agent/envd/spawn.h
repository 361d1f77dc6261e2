// Thread creation that cannot take the agent down. The agent is PID 1 of
// its sandbox and shares the sandbox's pids limit with the sandbox user, who
// can exhaust it (a fork bomb); std::thread then throws std::system_error
// (EAGAIN), and an uncaught throw would end PID 1 and the sandbox with it.
// Every thread the agent starts after start-up goes through a SpawnFn, so a
// refusal is one failed request, never a dead agent, and tests can inject
// the refusal (tests/sandbox-runtime/envd_limits_test.cpp).
#pragma once

#include <functional>

namespace sg::envd {

// Starts fn on a new detached thread. Returns false when the system refuses
// a thread (EAGAIN under a pids limit or RLIMIT_NPROC, ENOMEM): fn was not
// run and has been destroyed, and the caller fails its request instead.
using SpawnFn = std::function<bool(std::function<void()>)>;

// The real SpawnFn: std::thread(...).detach(), refusals caught.
bool spawn_detached(std::function<void()> fn) noexcept;

}  // namespace sg::envd
