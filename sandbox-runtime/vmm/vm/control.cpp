// Control socket commands.
#include "sandbox-runtime/vmm/vm/control.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "base/log.h"
#include "base/sys.h"

namespace sg::vmm {

namespace {

std::string reply(const Status& s) { return s ? "ok" : "error: " + s.error().message(); }

bool send_reply(int sock, const std::string& msg, int fd) {
  struct iovec iov = {const_cast<char*>(msg.data()), msg.size()};
  struct msghdr mh {};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  alignas(struct cmsghdr) char cbuf[CMSG_SPACE(sizeof(int))];
  if (fd >= 0) {
    mh.msg_control = cbuf;
    mh.msg_controllen = sizeof cbuf;
    struct cmsghdr* c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof fd);
  }
  for (;;) {
    ssize_t n = ::sendmsg(sock, &mh, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    return n == static_cast<ssize_t>(msg.size());
  }
}

}  // namespace

std::string handle_control(Machine& m, const std::string& cmd, int* fd_out, std::vector<UniqueFd>* fds_in) {
  *fd_out = -1;
  if (cmd == "snapshot-fds") {
    if (!fds_in || fds_in->size() != 2) return "error: snapshot-fds needs two descriptors (memory, state)";
    return reply(m.snapshot_to((*fds_in)[0].get(), (*fds_in)[1].get()));
  }
  if (cmd == "pause") return reply(m.pause());
  if (cmd == "resume") return reply(m.resume());
  if (cmd == "stop") {
    m.stop("stop requested on the control socket");
    return "ok";
  }
  if (cmd == "stats") {
    MachineStats s = m.stats();
    char buf[512];
    std::snprintf(buf, sizeof buf,
                  "ok {\"state\":\"%s\",\"cpus\":%u,\"memBytes\":%llu,\"exits\":%llu,\"consoleToHost\":%llu,"
                  "\"consoleToGuest\":%llu,\"blkRequests\":%llu,\"blkErrors\":%llu,\"serialBytes\":%llu}",
                  state_name(s.state), s.cpus, static_cast<unsigned long long>(s.mem_bytes),
                  static_cast<unsigned long long>(s.exits), static_cast<unsigned long long>(s.console_to_host),
                  static_cast<unsigned long long>(s.console_to_guest), static_cast<unsigned long long>(s.blk_requests),
                  static_cast<unsigned long long>(s.blk_errors), static_cast<unsigned long long>(s.serial_bytes));
    return buf;
  }
  if (cmd.rfind("snapshot ", 0) == 0) {
    std::string dir = cmd.substr(9);
    if (dir.empty() || dir[0] != '/') return "error: snapshot needs an absolute directory";
    return reply(m.snapshot(dir));
  }
  if (cmd == "vcpus") return "ok " + m.describe_vcpus();
  if (cmd == "memfd") {
    if (!m.memory().is_memfd()) return "error: guest RAM is a private mapping of a snapshot file, not a memfd";
    *fd_out = m.memory().backing_fd();
    return "ok";
  }
  if (cmd == "uffd") {
    uint64_t features = 0;
    auto u = m.memory().new_userfaultfd(&features);
    if (!u) return "error: " + u.error().message();
    *fd_out = *u;
    return "ok";
  }
  if (cmd == "meminfo") {
    const GuestMemory& mem = m.memory();
    char buf[256];
    std::snprintf(buf, sizeof buf, "ok {\"base\":%llu,\"size\":%llu,\"backing\":\"%s\"}",
                  static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(mem.host_base())),
                  static_cast<unsigned long long>(mem.size()), mem.backing());
    return buf;
  }
  if (cmd == "release-memory") {
    uint64_t features = 0;
    auto u = m.release_memory(&features);
    if (!u) return "error: " + u.error().message();
    *fd_out = *u;
    char buf[128];
    std::snprintf(buf, sizeof buf, "ok {\"uffd\":%s,\"features\":%llu}", *u >= 0 ? "true" : "false",
                  static_cast<unsigned long long>(features));
    return buf;
  }
  return "error: unknown command \"" + cmd.substr(0, 64) + "\"";
}

void serve_control(Machine& m, int fd, ControlHandOff* next) {
  char buf[4096];
  UniqueFd current;  // a new host's socket, once one came
  for (;;) {
    // Up to two descriptors ride with a command (snapshot-fds); any other
    // count, or with another command, is closed unused.
    std::vector<UniqueFd> fds_in;
    bool truncated = false;
    ssize_t n = recv_with_fds(fd, buf, sizeof buf, &fds_in, &truncated);
    if (n <= 0) {
      std::string why = n == 0 ? "control socket closed" : std::string("control socket: ") + std::strerror(errno);
      if (!next) {
        m.stop(why);
        return;
      }
      // The host is gone; the machine runs on until the next one attaches.
      LOG_INFO("vmm: " << why << "; waiting for the next host");
      current = next->take();
      fd = current.get();
      continue;
    }
    std::string cmd(buf, static_cast<size_t>(n));
    int out_fd = -1;
    std::string r = handle_control(m, cmd, &out_fd, &fds_in);
    bool sent = send_reply(fd, r, out_fd);
    // The uffd is ours to close once passed; the memfd stays the machine's.
    if (out_fd >= 0 && (cmd == "uffd" || cmd == "release-memory")) ::close(out_fd);
    if (!sent && !next) {
      m.stop("control socket: reply failed");
      return;
    }
  }
}

}  // namespace sg::vmm
