// Attach: how a new sandgate takes a running sandgate-vmm back after the
// one that started it went (sandgate-vmm --outlive; docs/vmm.md,
// "Restarts").
//
// At start the VMM makes an AF_UNIX SOCK_SEQPACKET pair and keeps one end
// on descriptor kAttachFd for its whole life, the other for itself. A new
// host copies kAttachFd out of the VMM with pidfd_getfd (ptrace rights over
// the VMM: the host's root; never the guest, which cannot reach the VMM's
// descriptors), and sends one message: the 8 bytes kAttachHello with two
// descriptors (SCM_RIGHTS), its new console socket and its new control
// socket. The VMM answers "ok" once both are in use, or "error: ...".
// The console takes the new socket from frame boundaries (VirtioConsole);
// the control thread, which waits once its socket closes, serves the new one.
//
// Thread safety: ControlHandOff is shared by the attach and control threads.
#pragma once

#include <condition_variable>
#include <mutex>
#include <vector>

#include "base/fd.h"
#include "base/status.h"
#include "sandbox-runtime/vmm/vm/attach_protocol.h"
#include "sandbox-runtime/vmm/vm/machine.h"

namespace sg::vmm {

// The control socket a new host brings, handed from the attach thread to
// the control thread.
class ControlHandOff {
 public:
  void put(UniqueFd fd);
  // Blocks until a new host's control socket arrives.
  UniqueFd take();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  UniqueFd fd_;  // GUARDED_BY(mu_)
};

// One message from a SOCK_SEQPACKET socket with at most two descriptors
// (SCM_RIGHTS) into fds; descriptors that came with a truncated control
// part are closed and *truncated set. Returns recvmsg's result (EINTR
// retried).
ssize_t recv_with_fds(int sock, char* buf, size_t len, std::vector<UniqueFd>* fds, bool* truncated);

// Makes the pair: one end on kAttachFd (which must be free), the other
// returned.
Result<UniqueFd> make_attach_pair();

// Serves attach requests on `mine` for the VMM's life.
void serve_attach(Machine& m, int mine, ControlHandOff& control);

}  // namespace sg::vmm
