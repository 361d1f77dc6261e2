// The microVM backend: every sandbox is one sandgate-vmm process (a KVM
// microVM, sandbox-runtime/vmm) whose PID 1 is the same sandgate-agent the
// process backend runs, reached over the same channel (the VM's virtio
// console). See docs/vmm.md.
//
// Create path: the template's root filesystem directory is turned into an
// ext4 image once (<rootfs>.ext4, mkfs.ext4 -d), shared read-only by all
// its sandboxes. The first create for a (template image, guest image,
// memory, vCPUs) key boots a template VM to agent-ready, snapshots it and
// stops it; every create then restores a clone of that snapshot (RAM mapped
// MAP_PRIVATE, so creating a sandbox does not boot) and sends the agent
// "configure" (id, token, environment, wall clock, fresh entropy).
//
// Thread safety: as runtime.h. Snapshot building is serialised per key.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "sandbox-runtime/runtime.h"

namespace sg::microvm {

struct MicrovmConfig {
  std::string state_root;  // <state_root>/<id>/ per sandbox, <state_root>/snapshots/
  std::string vmm_path;    // sandgate-vmm
  std::string agent_path;  // sandgate-agent (static), appended to the initramfs
  std::string guest_dir;   // vmlinuz + initramfs.cpio (scripts/guest-image.sh)
  bool use_snapshots = true;
  // Booting a template VM: generous, a nested TCG guest takes ~10 s.
  std::chrono::milliseconds boot_timeout{180000};
  std::string extra_cmdline;  // appended to the guest kernel command line
  // Gateway services for streams the agent opens (runtime.h); empty: refused.
  runtime::ServiceOpener open_service;
  // Each VMM runs in a cgroup <controller root>/<cgroup_parent>/<sandbox id>
  // (memory: guest RAM + 256 MiB, CPU: vCPUs + 1, pids: vCPUs + 32), which
  // it joins itself before it maps guest memory. Empty, or no cgroups on
  // the host (logged once): none.
  std::string cgroup_parent;
  // The VMM's jail (sandbox-runtime/vmm/vm/confine.h, docs/vmm.md
  // "Confinement"): an empty read-only root of its own and an unprivileged
  // uid and gid of its own, first_vmm_uid + k for the k-th VMM alive.
  // kAuto jails every VMM where a probe at the first create succeeds
  // (sandgate runs as root, the kernel has /dev/userfaultfd, mounts work)
  // and otherwise runs them unjailed (logged once); kOn fails creates
  // that cannot have one; kOff never.
  enum class Jail { kAuto, kOn, kOff };
  Jail jail = Jail::kAuto;
  // Sandboxes' VMMs outlive sandgate (--keep-sandboxes on): they run on
  // when it goes (sandgate-vmm --outlive) and the next run takes them back
  // (Runtime::recover, docs/vmm.md "Restarts"). Off: they die with it.
  bool sandboxes_outlive_host = false;
  // Each sandbox's own network (runtime.h): a TAP device per sandbox,
  // its VMM's virtio-net the guest end, eth0 configured by the agent at
  // "configure". Null: sandboxes' microVMs have an unplugged eth0.
  runtime::SandboxNetworks* networks = nullptr;
  uint32_t first_vmm_uid = (1u << 30) - 65536;
  uint32_t vmm_uids = 65536;
};

// Whether /dev/kvm can run sandgate's microVMs here; why not, if not.
bool kvm_usable(std::string* why);

// What the guest image needs: vmlinuz and initramfs.cpio in guest_dir.
Status check_guest_dir(const std::string& guest_dir);

// Builds <rootfs_dir>.ext4 from the directory if it is missing or older
// than the template's marker file; returns its path.
Result<std::string> ensure_rootfs_image(const std::string& rootfs_dir);

// A template's image: for a template directory, ensure_rootfs_image; for a
// built template, its layers (lowest first) merged over rootfs by a
// read-only overlay mount, as <top layer>.ext4 (built once: layers never
// change; again if the base's marker is newer); for an image's unpacked
// root with no layers, <rootfs>.ext4. The template-file collector removes
// the image with its directory.
Result<std::string> ensure_template_image(const std::string& rootfs, const std::vector<std::string>& layers);

std::unique_ptr<runtime::Runtime> make_microvm_runtime(const MicrovmConfig& cfg);

}  // namespace sg::microvm
