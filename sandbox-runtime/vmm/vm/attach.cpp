// Attach: a new host takes a running VMM back (attach.h).
#include "sandbox-runtime/vmm/vm/attach.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "base/log.h"
#include "base/sys.h"

namespace sg::vmm {

void ControlHandOff::put(UniqueFd fd) {
  std::lock_guard<std::mutex> l(mu_);
  fd_ = std::move(fd);
  cv_.notify_all();
}

UniqueFd ControlHandOff::take() {
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait(l, [&] { return fd_.valid(); });
  return std::move(fd_);
}

Result<UniqueFd> make_attach_pair() {
  if (::fcntl(kAttachFd, F_GETFD) >= 0)
    return internal_error("descriptor " + std::to_string(kAttachFd) + " is in use at start");
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) return sys::errno_error("socketpair", "attach");
  UniqueFd mine(sv[0]), theirs(sv[1]);
  if (mine.get() == kAttachFd) mine.reset(::fcntl(sv[0], F_DUPFD_CLOEXEC, kAttachFd + 1));
  if (!mine) return sys::errno_error("fcntl F_DUPFD", "attach");
  if (theirs.get() != kAttachFd) {
    if (::dup3(theirs.get(), kAttachFd, O_CLOEXEC) < 0) return sys::errno_error("dup3", "attach");
    theirs.reset();  // the copy on kAttachFd stays open for the VMM's life
  } else {
    (void)theirs.release();
  }
  return mine;
}

ssize_t recv_with_fds(int sock, char* buf, size_t len, std::vector<UniqueFd>* fds, bool* truncated) {
  fds->clear();
  *truncated = false;
  for (;;) {
    struct iovec iov = {buf, len};
    alignas(struct cmsghdr) char cbuf[CMSG_SPACE(2 * sizeof(int))];
    struct msghdr mh {};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cbuf;
    mh.msg_controllen = sizeof cbuf;
    ssize_t n = ::recvmsg(sock, &mh, MSG_CMSG_CLOEXEC);
    if (n < 0 && errno == EINTR) continue;
    for (struct cmsghdr* c = CMSG_FIRSTHDR(&mh); n >= 0 && c; c = CMSG_NXTHDR(&mh, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < k; ++i) {
        int f;
        std::memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof f);
        fds->emplace_back(f);
      }
    }
    if (n >= 0 && (mh.msg_flags & MSG_CTRUNC)) {
      fds->clear();  // some were dropped: use none
      *truncated = true;
    }
    return n;
  }
}

namespace {

void answer(int sock, const std::string& msg) {
  for (;;) {
    ssize_t n = ::send(sock, msg.data(), msg.size(), MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    return;
  }
}

}  // namespace

void serve_attach(Machine& m, int mine, ControlHandOff& control) {
  for (;;) {
    char buf[64];
    std::vector<UniqueFd> fds;
    bool truncated = false;
    ssize_t n = recv_with_fds(mine, buf, sizeof buf, &fds, &truncated);
    if (n < 0) {
      LOG_ERROR("vmm: attach socket: " << std::strerror(errno) << "; no host can take this VM back");
      return;
    }
    if (n != static_cast<ssize_t>(sizeof kAttachHello) || std::memcmp(buf, kAttachHello, sizeof kAttachHello) != 0 ||
        fds.size() != 2 || truncated) {
      answer(mine, "error: want the attach hello with a console and a control socket");
      continue;
    }
    if (Status s = m.reattach_channel(std::move(fds[0])); !s) {
      answer(mine, "error: " + s.error().message());
      continue;
    }
    control.put(std::move(fds[1]));
    LOG_INFO("vmm: a new host attached");
    answer(mine, "ok");
  }
}

}  // namespace sg::vmm
