// Cgroups for process sandboxes: one sandbox cgroup across the hierarchies
// it needs, on cgroup v1 (one hierarchy per controller, possibly co-mounted)
// or cgroup v2 (one unified hierarchy). The layout is read from
// /proc/self/mountinfo at runtime rather than assumed, because hosts differ
// (this project's CI has cpu and cpuacct as separate v1 hierarchies).
//
// Thread safety: a Cgroup is not synchronised; its owner (the Sandbox)
// serialises calls. CgroupLayout is immutable after detection.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "base/os.h"
#include "base/status.h"

namespace sg::process {

enum class CgroupVersion { kV1, kV2 };

// The controllers a sandbox needs on v1; on v2: memory, cpu, pids (+ the
// built-in freezer and cpu.stat).
inline constexpr const char* kV1Controllers[] = {"memory", "cpu", "cpuacct", "pids", "freezer"};

struct CgroupLayout {
  CgroupVersion version = CgroupVersion::kV1;
  std::string unified;                        // v2: mount point of the unified hierarchy
  std::map<std::string, std::string> v1_mounts;  // v1: controller -> hierarchy mount point
};

// Parses mountinfo text. v2 when /sys/fs/cgroup itself is a cgroup2 mount;
// otherwise v1 with every controller in kV1Controllers required.
Result<CgroupLayout> parse_cgroup_layout(std::string_view mountinfo);
Result<CgroupLayout> detect_cgroup_layout();

struct CgroupLimits {
  uint32_t cpu_count = 1;
  uint64_t memory_bytes = 0;
  uint32_t max_pids = 0;
};

struct CgroupStats {
  uint64_t cpu_usage_ns = 0;
  uint64_t mem_used_bytes = 0;
  uint64_t mem_cache_bytes = 0;
  uint64_t mem_limit_bytes = 0;
};

class Cgroup {
 public:
  Cgroup() = default;
  // Creates <root>/<parent>/<name> in every needed hierarchy and applies
  // limits. Fails if it already exists. On failure nothing is left behind.
  // Every change it makes to the host, then and later, goes through os.
  static Result<Cgroup> create(const CgroupLayout& layout, const std::string& parent, const std::string& name,
                               const CgroupLimits& limits, sys::Os& os = sys::Os::real());
  // Attaches to an existing cgroup (no limits applied): cleanup uses it.
  static Cgroup attach(const CgroupLayout& layout, const std::string& parent, const std::string& name,
                       sys::Os& os = sys::Os::real());

  Status add_process(int pid);
  Status freeze(std::chrono::milliseconds timeout);
  Status thaw();
  Result<bool> frozen();
  // Pids of every task in the cgroup (union over hierarchies).
  Result<std::vector<int>> pids();
  Result<CgroupStats> stats();
  // Tasks the memory controller's OOM killer killed in this cgroup (v2
  // memory.events, v1 memory.oom_control "oom_kill": Linux 4.13 and later).
  Result<uint64_t> oom_kills();
  // SIGKILLs every task, thaws, waits for it to be empty, removes the
  // directories. Idempotent (missing directories are fine).
  Status destroy(std::chrono::milliseconds timeout);

  // The distinct directories of this cgroup (one per hierarchy on v1).
  const std::vector<std::string>& dirs() const { return dirs_; }
  // Directory of the hierarchy holding a controller ("freezer", "memory", ...).
  const std::string& dir_for(const std::string& controller) const;

 private:
  CgroupVersion version_ = CgroupVersion::kV1;
  sys::Os* os_ = &sys::Os::real();
  std::vector<std::string> dirs_;
  std::map<std::string, std::string> by_controller_;
};

// Removes every cgroup under <root>/<parent> in every hierarchy (killing
// their tasks first), then the parent directories themselves.
Status remove_cgroup_parent(const CgroupLayout& layout, const std::string& parent, std::chrono::milliseconds timeout,
                            sys::Os& os = sys::Os::real());
// The same for every cgroup under it but those named in keep (sandboxes
// taken back after a restart); the parent stays when keep is not empty.
Status remove_cgroups_except(const CgroupLayout& layout, const std::string& parent, const std::set<std::string>& keep,
                             std::chrono::milliseconds timeout, sys::Os& os = sys::Os::real());

}  // namespace sg::process
