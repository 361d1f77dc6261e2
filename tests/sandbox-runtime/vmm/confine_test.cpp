// The VMM's confinement (vm/confine.h) on the real kernel, in a forked
// child (it is irrevocable): the child exits with the number of the first
// probe that did not behave.
#include "vm/confine.h"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <thread>

namespace {

bool fails_with(long r, int err) { return r == -1 && errno == err; }

ino_t ns_inode(const char* path) {
  struct stat st {};
  return ::stat(path, &st) == 0 ? st.st_ino : 0;
}

}  // namespace

TEST_CASE("vmm confinement: own namespaces, no programs, processes or new sockets; threads and its own sockets work") {
  if (::geteuid() != 0) {
    MESSAGE("skipped: needs root (unshare of namespaces)");
    return;
  }
  const ino_t host_net = ns_inode("/proc/self/ns/net");
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) ::_exit(90);
    if (sg::Status s = sg::vmm::confine_vmm(); !s) ::_exit(91);
    if (ns_inode("/proc/self/ns/net") == host_net) ::_exit(1);
    if (::prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0) != 1) ::_exit(2);
    char* argv[] = {const_cast<char*>("/bin/true"), nullptr};
    if (!fails_with(::execve("/bin/true", argv, nullptr), EPERM)) ::_exit(3);
    if (!fails_with(::fork(), EPERM)) ::_exit(4);
    if (!fails_with(::socket(AF_UNIX, SOCK_STREAM, 0), EPERM)) ::_exit(5);
    if (!fails_with(::socket(AF_INET, SOCK_STREAM, 0), EPERM)) ::_exit(6);
    if (!fails_with(::setuid(0), EPERM)) ::_exit(7);
    if (!fails_with(::syscall(SYS_ptrace, 16 /*PTRACE_ATTACH*/, 1, 0, 0), EPERM)) ::_exit(8);
    if (!fails_with(::syscall(SYS_unshare, 0), EPERM)) ::_exit(9);
    // What a VMM does: threads, its inherited sockets, memfds, userfaultfd.
    std::atomic<int> ran{0};
    std::thread t([&] { ran = 1; });
    t.join();
    if (ran != 1) ::_exit(10);
    if (::send(sv[0], "x", 1, 0) != 1) ::_exit(11);
    char c = 0;
    if (::recv(sv[1], &c, 1, 0) != 1 || c != 'x') ::_exit(12);
    long mfd = ::syscall(SYS_memfd_create, "guest", MFD_CLOEXEC);
    if (mfd < 0) ::_exit(13);
    long uffd = ::syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
    if (uffd < 0 && errno != ENOSYS) ::_exit(14);
    ::_exit(0);
  }
  int st = 0;
  REQUIRE(::waitpid(pid, &st, 0) == pid);
  REQUIRE(WIFEXITED(st));
  CHECK(WEXITSTATUS(st) == 0);
}
