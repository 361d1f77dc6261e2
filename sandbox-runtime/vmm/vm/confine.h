// Confinement of the VMM process, applied by sandgate-vmm before guest code
// runs (Firecracker's jailer is the model; docs/vmm.md "Confinement"). The
// VMM is the process a hostile guest reaches first (every device register,
// every virtqueue), so if it is ever taken over it should hold as little as
// possible:
//  - its own network, IPC and UTS namespaces: it talks only over the two
//    socketpairs it inherited, so it has no interface, no abstract socket
//    and no SysV object in common with the host;
//  - no_new_privs, and a seccomp allow list (vmm_syscall_policy): the
//    syscalls a running VMM makes and nothing else. ioctl only with the
//    KVM and userfaultfd requests it uses once the guest runs; clone only
//    for threads (no namespace flags; clone3 is ENOSYS so the C library
//    falls back to clone); tgkill only within the VMM; mmap and mprotect
//    never executable; prctl only for the parent-death signal and thread
//    names; opening and naming files (openat, mkdir, rename, unlink) only
//    for a VMM that is to write a snapshot; no socket, connect, bind or
//    accept (it has its two sockets),
//    no execve, no ptrace or process_vm_*, no namespaces, mounts or
//    identity changes. A refused syscall fails with EPERM and writes one
//    line, "sandgate-vmm: seccomp: refused syscall N", to the VMM's log
//    (the runtime reports such lines; the KVM harness fails on them).
//    Another ABI's syscalls kill it.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

#include "base/seccomp.h"
#include "base/status.h"

namespace sg::vmm {

// The allow list for a VMM whose pid is self (tgkill is checked against
// it); snapshot_files lets it create, open and rename the files of a
// snapshot.
sys::seccomp::Policy vmm_syscall_policy(pid_t self, bool snapshot_files);

// What a vCPU thread may not do beyond vmm_syscall_policy (Firecracker's
// per-thread filters are the model): a second filter, stacked on the
// process's for that thread alone, whose listed calls trap like the first
// one's (logged, EPERM; clone fails with EPERM unlogged, as the C library
// blocks every signal around it and SIGSYS would then kill). A vCPU thread runs the guest and the device code
// its exits reach (MMIO and port I/O: the serial log's write, the disk's
// pread, pwrite and fdatasync, the interrupt eventfds, the console's wake
// eventfd), so it opens and names no files, makes no threads, memfds,
// userfaultfds or eventfds, sends and receives on no socket (the channel
// and the control socket are other threads'), and truncates and allocates
// no file.
sys::seccomp::Policy vcpu_thread_policy();

// Installs vcpu_thread_policy on the calling thread only. Needs
// no_new_privs (confine_vmm sets it) or CAP_SYS_ADMIN.
Status confine_vcpu_thread();

// The jail (Firecracker's jailer is the model), for a VMM started as root
// once it has opened everything it needs (/dev/kvm, the disk, the
// snapshot, the serial log) and before its first thread:
//  - its own mount namespace whose root is an empty read-only tmpfs
//    mounted on `root` (pivot_root; the host's tree is detached), with
//    snapshot_dir bound at /snapshot when the VMM is to write a snapshot;
//  - uid and gid `uid`/`gid`, no supplementary groups, no capabilities;
//  - /dev/userfaultfd opened first, so its memory offload still gets
//    userfaultfds that KVM's own accesses wait on.
struct Jail {
  std::string root;          // an existing empty directory (host path)
  uint32_t uid = 0, gid = 0; // not 0
  std::string snapshot_dir;  // host directory seen at kJailSnapshotDir; "" none
};
inline constexpr const char* kJailSnapshotDir = "/snapshot";

// Unshares the namespaces (and enters the jail if one is given), sets
// no_new_privs and installs the filter (with snapshot_files, the file
// calls a snapshot needs). Call while the process is
// single-threaded: unshare and pivot_root act on the calling thread only,
// and every thread made later inherits the filter and the credentials.
// Needs CAP_SYS_ADMIN.
Status confine_vmm(const Jail* jail = nullptr, bool snapshot_files = false);

}  // namespace sg::vmm
