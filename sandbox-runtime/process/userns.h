// User namespaces for process sandboxes: sandbox root is an unprivileged
// host uid (docs/process-backend.md "User namespace").
//
// Each live sandbox holds a slot: a range of 65536 host uids and gids
// (base + slot * 65536) and a user namespace that maps 0..65535 onto it.
// The namespace is made once per slot by a short-lived helper process and
// kept by its descriptor, so creates do not pay for it again. The
// sandbox's agent joins it (setns) after the steps that need host root,
// and the template rootfs is the overlay's lower layer through an idmapped
// mount with the same mapping, so its root-owned files are root-owned
// inside. Every other namespace of the sandbox stays owned by the host's
// user namespace: root inside cannot mount, configure the network or
// change the hostname, whatever capabilities it holds in its own.
//
// Thread safety: UidSlots is internally synchronised.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "base/fd.h"
#include "base/os.h"
#include "base/status.h"

namespace sg::process {

inline constexpr uint32_t kUidsPerSandbox = 65536;

// Whether the kernel offers what this needs (user namespaces enabled,
// idmapped mounts, setns): kUnavailable saying what is missing otherwise.
// The filesystem of a template can still refuse idmapping (idmapped_tree).
Status user_namespaces_available();

// A user namespace mapping uid and gid 0..count-1 onto host_base.. .
Result<UniqueFd> make_user_namespace(uint32_t host_base, uint32_t count);

// A detached, read-only copy of the mount tree at dir whose file owners
// appear through userns's mapping (open_tree + mount_setattr
// MOUNT_ATTR_IDMAP). kUnavailable when dir's filesystem cannot be
// idmapped.
Result<UniqueFd> idmapped_tree(const std::string& dir, int userns_fd, sys::Os& os = sys::Os::real());

class UidSlots {
 public:
  UidSlots(uint32_t first_uid, uint32_t slots) : first_uid_(first_uid), used_(slots, false), ns_(slots) {}

  struct Slot {
    uint32_t index = 0;
    uint32_t uid_base = 0;
    int userns_fd = -1;  // owned by UidSlots, valid while the slot is held
  };
  // A free slot and its namespace (made on first use). kQuota when all
  // are in use.
  Result<Slot> acquire();
  // Marks slot index held by a sandbox a previous run of sandgate left
  // running, with that sandbox's user namespace (which maps the same
  // range) as the slot's from now on.
  Result<Slot> adopt(uint32_t index, UniqueFd userns);
  void release(uint32_t index);

 private:
  std::mutex mu_;
  uint32_t first_uid_;
  std::vector<bool> used_;    // GUARDED_BY(mu_)
  std::vector<UniqueFd> ns_;  // GUARDED_BY(mu_)
};

}  // namespace sg::process
