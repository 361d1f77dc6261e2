// GuestMemoryStore: the memory offload engine as the lifecycle core sees it.
//
// wait-engine/memory/offload.h's MemoryEngine implements it; the core gets
// one at construction (or none: no offload), so it never names the engine
// and needs no hook back from it: sandboxes whose memory was lost are
// polled with take_lost() by the core's sweep.
//
// Thread safety: every method may be called from any thread; offload()
// blocks for as long as the encoding takes (seconds), prefetch() for the
// pages it installs.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "base/status.h"
#include "sandbox-runtime/runtime.h"

namespace sg::lifecycle {

// One offload: whose cohort the sandbox is in (hot sets and dictionaries
// are shared by a tenant's sandboxes of one template), where its VMM maps
// guest RAM, and how to make the VMM hand that RAM over.
struct OffloadRequest {
  std::string tenant_id;
  std::string template_id;
  runtime::GuestMemoryInfo memory;
  std::function<Result<runtime::GuestMemoryRelease>()> release;
};

class GuestMemoryStore {
 public:
  virtual ~GuestMemoryStore() = default;
  // Moves a paused microVM's RAM into the pool. Returns a one-line account
  // for the log. kConflict when cancel was set before the end (the pages
  // moved so far fault back), kUnavailable/kQuota when nothing was moved.
  virtual Result<std::string> offload(const std::string& sandbox, const OffloadRequest& r,
                                      const std::atomic<bool>& cancel) = 0;
  // Before the vCPUs resume: the predicted pages in. Returns how many.
  virtual Result<uint64_t> prefetch(const std::string& sandbox) = 0;
  // The sandbox is gone: its fault server and pool records can go.
  virtual void forget(const std::string& sandbox) = 0;
  // The pool's RAM for the sandbox (0 if none): cheap, sampled every second.
  virtual uint64_t pool_bytes(const std::string& sandbox) const = 0;
  // Sandboxes whose memory could not be served since the last call, with why.
  virtual std::vector<std::pair<std::string, std::string>> take_lost() = 0;
};

// PauseMemoryPacker: a microVM paused to disk keeps its RAM as only what
// differs from the memory it was restored from, compressed, every page
// checksummed (wait-engine/memory/pause_pack.h, docs/vmm.md "Pause memory").
// The core packs a pause's snapshot layer once the VMM is gone and unpacks
// it before the restore; it never names the codecs.
//
// Thread safety: calls on different directories may run at once.
class PauseMemoryPacker {
 public:
  virtual ~PauseMemoryPacker() = default;
  // dir is a microVM snapshot (memory, vm.state); base the memory file the
  // sandbox was restored from. Replaces dir/memory with its packed form
  // (nothing is lost on any failure: dir/memory stays until the packed
  // form is whole). Returns a one-line account for the log and events.
  virtual Result<std::string> pack(const std::string& dir, const std::string& base) = 0;
  // Makes dir/memory from its packed form again, checking every page, the
  // base and the file's own checksums; a no-op when dir/memory is there.
  // Damage is an error (kInternal, naming what failed) and leaves no
  // dir/memory.
  virtual Status unpack(const std::string& dir) = 0;
};

}  // namespace sg::lifecycle
