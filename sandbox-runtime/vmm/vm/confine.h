// Confinement of the VMM process, applied by sandgate-vmm before it opens
// anything of the guest's (Firecracker's jailer is the model; what is not
// done yet is in docs/vmm.md "Confinement"). The VMM is the process a
// hostile guest reaches first (every device register, every virtqueue), so
// if it is ever taken over it should hold as little as possible:
//  - its own network, IPC and UTS namespaces: it talks only over the two
//    socketpairs it inherited, so it has no interface, no abstract socket
//    and no SysV object in common with the host;
//  - no_new_privs, and a seccomp filter (vmm_syscall_policy) that refuses
//    what a VMM never does after start: running programs (execve), making
//    processes (fork, clone without CLONE_THREAD; clone3 is ENOSYS so the
//    C library falls back to clone for threads), new sockets, ptrace and
//    process_vm_*, namespaces and mounts, uid/gid/capability changes,
//    keyrings, bpf, perf, io_uring, module and kexec loading, file handles.
//    Another ABI's syscalls kill it.
#pragma once

#include "sys/seccomp.h"
#include "sys/status.h"

namespace sg::vmm {

sys::seccomp::Policy vmm_syscall_policy();

// Unshares the namespaces, sets no_new_privs and installs the filter on
// the calling thread. Call while the process is single-threaded (unshare
// of namespaces needs it for none of these, but the filter is then
// inherited by every thread made later). Needs CAP_SYS_ADMIN.
Status confine_vmm();

}  // namespace sg::vmm
