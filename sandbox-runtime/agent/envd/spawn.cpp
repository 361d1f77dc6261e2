// Guarded thread creation (see spawn.h).
#include "sandbox-runtime/agent/envd/spawn.h"

#include <new>
#include <system_error>
#include <thread>

namespace sg::envd {

bool spawn_detached(std::function<void()> fn) noexcept {
  try {
    std::thread(std::move(fn)).detach();
    return true;
  } catch (const std::system_error&) {  // EAGAIN: no thread left under the pids limit
    return false;
  } catch (const std::bad_alloc&) {
    return false;
  }
}

}  // namespace sg::envd
