// The agent binary as sandboxes mount it: one private copy per Runtime on a
// detached tmpfs that no mount namespace shows, cloned into each sandbox at
// /.sandgate/sandgate-agent. A bind mount of the host file would do the same
// job, but /proc/self/mountinfo prints a bind mount's root as the file's path
// inside its filesystem (the host's build or install directory); the clone
// prints "/sandgate-agent" on tmpfs "sandgate" (issue 17 item 17).
//
// Thread safety: the functions keep no state; a tree descriptor may be
// cloned from several threads at once.
#pragma once

#include <string>

#include "base/fd.h"
#include "base/os.h"
#include "base/status.h"

namespace sg::process {

// A detached tmpfs mount holding a copy of agent_path as "sandgate-agent"
// (mode 0755), sized to it. kUnavailable where the kernel cannot make one
// or cannot clone from it (fsopen needs Linux 5.2; cloning a detached mount
// with open_tree needs 6.15): the caller then binds the host file.
Result<UniqueFd> make_agent_tree(const std::string& agent_path);

// A detached clone of the agent file in tree, for one sandbox's child to
// move_mount onto its /.sandgate/sandgate-agent. Close-on-exec, >= 10.
Result<UniqueFd> clone_agent(int tree, sys::Os& os = sys::Os::real());

}  // namespace sg::process
