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

#include "kvm/memory.h"
#include "sys/sys.h"

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

TEST_CASE("vmm jail: an empty read-only root, its own uid, no capabilities; /snapshot writable; userfaultfds still come") {
  if (::geteuid() != 0 || ::access("/dev/userfaultfd", R_OK | W_OK) != 0) {
    MESSAGE("skipped: needs root and /dev/userfaultfd");
    return;
  }
  char root_t[] = "/tmp/sg-jail-XXXXXX";
  char snap_t[] = "/tmp/sg-jail-snap-XXXXXX";
  REQUIRE(::mkdtemp(root_t));
  REQUIRE(::mkdtemp(snap_t));
  const uint32_t uid = 1073676000;
  REQUIRE(::chown(snap_t, uid, uid) == 0);
  // A file the host has next to the jail: the jailed child must not see it.
  std::string secret = std::string(root_t) + "/../sg-jail-secret";
  int sfd = ::open(secret.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  REQUIRE(sfd >= 0);
  ::close(sfd);
  auto sysctl = sg::sys::read_file("/proc/sys/vm/unprivileged_userfaultfd");
  const bool unprivileged_uffd = sysctl && !sysctl->empty() && (*sysctl)[0] == '1';
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    auto mem = sg::vmm::GuestMemory::create_anonymous(1 << 20);
    if (!mem) ::_exit(92);
    sg::vmm::Jail j;
    j.root = root_t;
    j.uid = j.gid = uid;
    j.snapshot_dir = snap_t;
    if (sg::Status s = sg::vmm::confine_vmm(&j); !s) {
      std::fprintf(stderr, "confine: %s\n", s.error().message().c_str());
      ::_exit(91);
    }
    if (::getuid() != uid || ::geteuid() != uid || ::getgid() != uid || ::getegid() != uid) ::_exit(1);
    if (::getgroups(0, nullptr) != 0) ::_exit(2);
    // No capabilities left, permitted or effective.
    struct { uint32_t version; int pid; } hdr = {0x20080522 /*_LINUX_CAPABILITY_VERSION_3*/, 0};
    struct { uint32_t effective, permitted, inheritable; } data[2] = {};
    if (::syscall(SYS_capget, &hdr, data) != 0) ::_exit(3);
    if (data[0].effective || data[0].permitted || data[1].effective || data[1].permitted) ::_exit(4);
    // The root holds nothing but the snapshot mount point, and is read-only.
    for (const char* p : {"/tmp", "/proc", "/dev/kvm", "/etc/passwd", "/bin/sh", "/sg-jail-secret", "/../sg-jail-secret"})
      if (::access(p, F_OK) == 0) ::_exit(5);
    if (::access("/snapshot", F_OK) != 0) ::_exit(6);
    if (!fails_with(::mkdir("/x", 0700), EROFS) && !fails_with(::mkdir("/x", 0700), EACCES)) ::_exit(7);
    // The snapshot directory takes files, which the host sees.
    int fd = ::open("/snapshot/memory", O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0 || ::write(fd, "m", 1) != 1) ::_exit(8);
    ::close(fd);
    // Guest RAM still gets a userfaultfd that KVM's own faults wait on
    // (the memory offload's), through the device; the syscall alone
    // would not give one to this uid.
    uint64_t features = 0;
    auto u = mem->new_userfaultfd(&features);
    if (!u || *u < 0) ::_exit(9);
    if (!unprivileged_uffd && !fails_with(::syscall(SYS_userfaultfd, O_CLOEXEC), EPERM)) ::_exit(10);
    ::_exit(0);
  }
  int st = 0;
  REQUIRE(::waitpid(pid, &st, 0) == pid);
  REQUIRE(WIFEXITED(st));
  CHECK(WEXITSTATUS(st) == 0);
  std::string written = std::string(snap_t) + "/memory";
  struct stat sst {};
  CHECK(::stat(written.c_str(), &sst) == 0);
  CHECK(sst.st_uid == uid);
  // The host's view of the jail directory is unchanged: the tmpfs was in
  // the child's mount namespace only.
  CHECK(::rmdir(root_t) == 0);
  ::unlink(written.c_str());
  ::rmdir(snap_t);
  ::unlink(secret.c_str());
}
