// The process backend: each sandbox is a process tree in its own PID, mount,
// UTS, IPC, network and cgroup namespaces, on an overlay of the template rootfs,
// limited by cgroups, with sandgate-agent as its PID 1. Used where /dev/kvm
// is missing. docs/process-backend.md describes the namespaces, mounts,
// cgroups, user namespace, seccomp filter, disk limit, lifecycle and the
// isolation it does not give.
//
// Thread safety: as runtime.h. create() calls clone() on one long-lived
// thread owned by the Runtime, because PR_SET_PDEATHSIG fires when the
// *thread* that created a child exits; sandboxes therefore die with the
// sandgate process, or when the Runtime object is destroyed.
#pragma once

#include <memory>
#include <string_view>

#include "sandbox-runtime/runtime.h"

namespace sg::process {

// Needs root and cgroups (v1 with memory, cpu, cpuacct, pids, freezer, or
// v2 with memory, cpu, pids). Never fails itself: when the host lacks what
// the backend needs, create() and cleanup_stale() return a kUnavailable
// error that says what is missing.
std::unique_ptr<runtime::Runtime> make_process_runtime(const runtime::RuntimeConfig& cfg);

// Sandbox ids the backend accepts: [a-z0-9]{1,64} (they become path
// components and a hostname).
bool valid_sandbox_id(std::string_view id);

}  // namespace sg::process
