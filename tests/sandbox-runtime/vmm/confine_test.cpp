// The VMM's confinement (vm/confine.h) on the real kernel, in a forked
// child (it is irrevocable): the child exits with the number of the first
// probe that did not behave.
#include "sandbox-runtime/vmm/vm/confine.h"

#include <doctest/doctest.h>
#include "tests/support/skip.h"
#include <fcntl.h>
#include <linux/kvm.h>
#include <pthread.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <thread>

#include "sandbox-runtime/vmm/kvm/memory.h"
#include "base/sys.h"

namespace {

bool fails_with(long r, int err) { return r == -1 && errno == err; }

ino_t ns_inode(const char* path) {
  struct stat st {};
  return ::stat(path, &st) == 0 ? st.st_ino : 0;
}

}  // namespace

TEST_CASE("vmm confinement: own namespaces and an allow list; what a VMM does still works, the rest is refused and logged" * doctest::test_suite("own-entry")) {
  if (::geteuid() != 0) {
    sg::test::skip_case("needs root (unshare of namespaces)");
  }
  const ino_t host_net = ns_inode("/proc/self/ns/net");
  char log_t[] = "/tmp/sg-confine-log-XXXXXX";
  int log_fd = ::mkstemp(log_t);
  REQUIRE(log_fd >= 0);
  int done[2], go[2];  // the parent looks at the confined child's namespace
  REQUIRE(::pipe2(done, O_CLOEXEC) == 0);
  REQUIRE(::pipe2(go, O_CLOEXEC) == 0);
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    // The filter's refusals go to stderr, as to a VMM's log.
    if (::dup2(log_fd, STDERR_FILENO) < 0) ::_exit(89);
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) ::_exit(90);
    // Opened before: a VMM that writes no snapshot opens nothing after.
    int status_fd = ::open("/proc/self/status", O_RDONLY | O_CLOEXEC);
    if (status_fd < 0) ::_exit(88);
    if (sg::Status s = sg::vmm::confine_vmm(); !s) ::_exit(91);
    if (!fails_with(::open("/proc/self/status", O_RDONLY | O_CLOEXEC), EPERM)) ::_exit(1);
    char status[4096] = {};
    if (::pread(status_fd, status, sizeof status - 1, 0) <= 0 || !std::strstr(status, "NoNewPrivs:\t1")) ::_exit(2);
    // Refused: programs, processes, new sockets, identity, other
    // processes, namespaces; ioctls other than KVM's and userfaultfd's;
    // executable memory; signals out of the process; other prctls.
    char* argv[] = {const_cast<char*>("/bin/true"), nullptr};
    if (!fails_with(::execve("/bin/true", argv, nullptr), EPERM)) ::_exit(3);
    if (!fails_with(::fork(), EPERM)) ::_exit(4);
    if (!fails_with(::socket(AF_UNIX, SOCK_STREAM, 0), EPERM)) ::_exit(5);
    if (!fails_with(::socket(AF_INET, SOCK_STREAM, 0), EPERM)) ::_exit(6);
    if (!fails_with(::setuid(0), EPERM)) ::_exit(7);
    if (!fails_with(::syscall(SYS_ptrace, 16 /*PTRACE_ATTACH*/, 1, 0, 0), EPERM)) ::_exit(8);
    if (!fails_with(::syscall(SYS_unshare, 0), EPERM)) ::_exit(9);
    int winsize[4] = {};
    if (!fails_with(::ioctl(sv[0], TIOCGWINSZ, winsize), EPERM)) ::_exit(15);
    if (::mmap(nullptr, 4096, PROT_READ | PROT_EXEC, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) != MAP_FAILED || errno != EPERM)
      ::_exit(16);
    void* page = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (page == MAP_FAILED) ::_exit(17);
    if (!fails_with(::mprotect(page, 4096, PROT_READ | PROT_EXEC), EPERM)) ::_exit(18);
    if (!fails_with(::syscall(SYS_tgkill, 1, 1, 0), EPERM)) ::_exit(19);
    if (!fails_with(::prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), EPERM)) ::_exit(20);
    if (!fails_with(::syscall(SYS_clone3, nullptr, 0), ENOSYS)) ::_exit(21);
    // What a VMM does: threads (clone after clone3's ENOSYS), signals to
    // its own threads, its inherited sockets, memory, memfds,
    // userfaultfd, thread names, the parent-death signal.
    std::atomic<int> ran{0};
    std::thread t([&] {
      if (::prctl(PR_SET_NAME, "vcpu0", 0, 0, 0) == 0) ran = 1;
    });
    t.join();
    if (ran != 1) ::_exit(10);
    if (::syscall(SYS_tgkill, ::getpid(), ::syscall(SYS_gettid), 0) != 0) ::_exit(22);
    if (::prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0) ::_exit(23);
    if (::send(sv[0], "x", 1, 0) != 1) ::_exit(11);
    char c = 0;
    if (::recv(sv[1], &c, 1, 0) != 1 || c != 'x') ::_exit(12);
    long mfd = ::syscall(SYS_memfd_create, "guest", MFD_CLOEXEC);
    if (mfd < 0) ::_exit(13);
    long uffd = ::syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
    if (uffd < 0 && errno != ENOSYS) ::_exit(14);
    if (::mprotect(page, 4096, PROT_READ) != 0 || ::munmap(page, 4096) != 0) ::_exit(24);
    if (::write(done[1], "d", 1) != 1 || ::read(go[0], &c, 1) != 1) ::_exit(25);
    ::_exit(0);
  }
  ::close(done[1]);
  ::close(go[0]);
  char c = 0;
  if (::read(done[0], &c, 1) == 1) {
    // Its own network namespace (it may not open /proc itself any more).
    CHECK(ns_inode(("/proc/" + std::to_string(pid) + "/ns/net").c_str()) != host_net);
    CHECK(::write(go[1], "g", 1) == 1);
  }
  ::close(done[0]);
  ::close(go[1]);
  int st = 0;
  REQUIRE(::waitpid(pid, &st, 0) == pid);
  REQUIRE(WIFEXITED(st));
  CHECK(WEXITSTATUS(st) == 0);
  // One line per refusal, naming the syscall; clone3's ENOSYS is expected
  // and not logged.
  auto log = sg::sys::read_file(log_t, 1 << 16);
  REQUIRE(log);
  for (long nr : {long(SYS_execve), long(SYS_socket), long(SYS_ptrace), long(SYS_ioctl), long(SYS_mmap),
                  long(SYS_mprotect), long(SYS_tgkill), long(SYS_prctl), long(SYS_clone), long(SYS_openat)})
    CHECK_MESSAGE(log->find("sandgate-vmm: seccomp: refused syscall " + std::to_string(nr) + "\n") != std::string::npos,
                  "syscall ", nr, " in: ", *log);
  CHECK(log->find("refused syscall " + std::to_string(SYS_clone3) + "\n") == std::string::npos);
  ::close(log_fd);
  ::unlink(log_t);
}

TEST_CASE("vmm confinement: a vCPU thread's own filter refuses files, threads, memfds and socket I/O; other threads keep them" * doctest::test_suite("own-entry")) {
  if (::geteuid() != 0) {
    sg::test::skip_case("needs root (unshare of namespaces)");
  }
  char log_t[] = "/tmp/sg-confine-vcpu-log-XXXXXX";
  int log_fd = ::mkstemp(log_t);
  REQUIRE(log_fd >= 0);
  char disk_t[] = "/tmp/sg-confine-vcpu-disk-XXXXXX";
  int disk_fd = ::mkstemp(disk_t);
  REQUIRE(disk_fd >= 0);
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    if (::dup2(log_fd, STDERR_FILENO) < 0) ::_exit(89);
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) ::_exit(90);
    int efd = ::eventfd(0, EFD_CLOEXEC);
    if (efd < 0) ::_exit(88);
    // A VMM that writes snapshots: the process may open files.
    if (sg::Status s = sg::vmm::confine_vmm(nullptr, /*snapshot_files=*/true); !s) ::_exit(91);
    std::atomic<int> failed{-1};
    std::thread vcpu([&] {
      if (sg::Status s = sg::vmm::confine_vcpu_thread(); !s) return failed.store(92);
      // Refused on this thread.
      if (!fails_with(::open("/proc/self/status", O_RDONLY | O_CLOEXEC), EPERM)) return failed.store(1);
      if (!fails_with(::mkdir("/tmp/sg-confine-vcpu-never", 0700), EPERM)) return failed.store(2);
      pthread_t t;
      if (::pthread_create(&t, nullptr, [](void*) -> void* { return nullptr; }, nullptr) == 0) return failed.store(3);
      if (!fails_with(::syscall(SYS_memfd_create, "guest", MFD_CLOEXEC), EPERM)) return failed.store(4);
      if (!fails_with(::syscall(SYS_userfaultfd, O_CLOEXEC), EPERM)) return failed.store(5);
      if (!fails_with(::eventfd(0, EFD_CLOEXEC), EPERM)) return failed.store(6);
      if (!fails_with(::send(sv[0], "x", 1, 0), EPERM)) return failed.store(7);
      if (!fails_with(::ftruncate(disk_fd, 4096), EPERM)) return failed.store(8);
      // What its exits do: the disk, the serial log, an interrupt's
      // eventfd, locks, memory.
      if (::pwrite(disk_fd, "sector", 6, 512) != 6) return failed.store(10);
      char b[6] = {};
      if (::pread(disk_fd, b, 6, 512) != 6 || std::memcmp(b, "sector", 6) != 0) return failed.store(11);
      if (::fdatasync(disk_fd) != 0) return failed.store(12);
      uint64_t one = 1;
      if (::write(efd, &one, sizeof one) != sizeof one) return failed.store(13);
      std::string big(1 << 20, 'x');  // malloc's mmap and munmap
      if (big.size() != (1u << 20)) return failed.store(14);
      failed.store(0);
    });
    vcpu.join();
    if (failed != 0) ::_exit(failed);
    // The other threads are not narrowed.
    int f = ::open("/proc/self/status", O_RDONLY | O_CLOEXEC);
    if (f < 0) ::_exit(20);
    ::close(f);
    if (::send(sv[0], "x", 1, 0) != 1) ::_exit(21);
    std::atomic<int> ran{0};
    std::thread other([&] { ran = 1; });
    other.join();
    if (ran != 1) ::_exit(22);
    ::_exit(0);
  }
  int st = 0;
  REQUIRE(::waitpid(pid, &st, 0) == pid);
  auto log = sg::sys::read_file(log_t, 1 << 16);
  REQUIRE(log);
  REQUIRE_MESSAGE(WIFEXITED(st), "killed by signal ", WTERMSIG(st), "; its log: ", *log);
  CHECK(WEXITSTATUS(st) == 0);
  auto logged = [&](long nr) {
    return log->find("sandgate-vmm: seccomp: refused syscall " + std::to_string(nr) + "\n") != std::string::npos;
  };
  // (clone's EPERM is not logged: vm/confine.h.)
  for (long nr : {long(SYS_openat), long(SYS_memfd_create), long(SYS_userfaultfd), long(SYS_eventfd2),
                  long(SYS_sendto), long(SYS_ftruncate)})
    CHECK_MESSAGE(logged(nr), "syscall ", nr, " in: ", *log);
  CHECK_MESSAGE((logged(SYS_mkdir) || logged(SYS_mkdirat)), "mkdir in: ", *log);  // the C library may use either
  ::close(log_fd);
  ::unlink(log_t);
  ::close(disk_fd);
  ::unlink(disk_t);
}

TEST_CASE("vmm confinement: the allow list compiles within the kernel's limit, KVM_RUN first") {
  auto policy = sg::vmm::vmm_syscall_policy(::getpid(), /*snapshot_files=*/false);
  REQUIRE(!policy.rules.empty());
  CHECK(policy.rules.front().nr == SYS_ioctl);
  REQUIRE(policy.rules.front().when);
  CHECK(policy.rules.front().when->value == static_cast<uint32_t>(KVM_RUN));
  auto program = sg::sys::seccomp::compile(policy);
  REQUIRE(program);
  CHECK(program->size() < 1024);
  // Nothing the deny list used to refuse is on it.
  for (long nr : {long(SYS_execve), long(SYS_execveat), long(SYS_socket), long(SYS_connect), long(SYS_bind),
                  long(SYS_listen), long(SYS_accept4), long(SYS_ptrace), long(SYS_process_vm_readv), long(SYS_unshare),
                  long(SYS_setns), long(SYS_mount), long(SYS_setuid), long(SYS_kill), long(SYS_bpf), long(SYS_io_uring_setup)})
    for (const auto& r : policy.rules) CHECK_MESSAGE(r.nr != nr, "syscall ", nr, " is on the allow list");
  // Files only for a VMM that writes a snapshot.
  auto has = [](const sg::sys::seccomp::Policy& p, long nr) {
    for (const auto& r : p.rules)
      if (r.nr == nr) return true;
    return false;
  };
  CHECK_FALSE(has(policy, SYS_openat));
  CHECK_FALSE(has(policy, SYS_renameat2));
  auto snapshotting = sg::vmm::vmm_syscall_policy(::getpid(), /*snapshot_files=*/true);
  CHECK(has(snapshotting, SYS_openat));
  CHECK(has(snapshotting, SYS_renameat2));
}

TEST_CASE("vmm jail: an empty read-only root, its own uid, no capabilities; /snapshot writable; userfaultfds still come" * doctest::test_suite("own-entry")) {
  if (::geteuid() != 0 || ::access("/dev/userfaultfd", R_OK | W_OK) != 0) {
    sg::test::skip_case("needs root and /dev/userfaultfd");
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
  int ready[2], go[2];
  REQUIRE(::pipe2(ready, O_CLOEXEC) == 0);
  REQUIRE(::pipe2(go, O_CLOEXEC) == 0);
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    auto mem = sg::vmm::GuestMemory::create_anonymous(1 << 20);
    if (!mem) ::_exit(92);
    sg::vmm::Jail j;
    j.root = root_t;
    j.uid = j.gid = uid;
    j.snapshot_dir = snap_t;
    if (sg::Status s = sg::vmm::confine_vmm(&j, /*snapshot_files=*/true); !s) {
      std::fprintf(stderr, "confine: %s\n", s.error().message().c_str());
      ::_exit(91);
    }
    if (::getuid() != uid || ::geteuid() != uid || ::getgid() != uid || ::getegid() != uid) ::_exit(1);
    // The parent reads the groups and capabilities from /proc (the allow
    // list has no getgroups or capget).
    char c = 0;
    if (::write(ready[1], "j", 1) != 1 || ::read(go[0], &c, 1) != 1) ::_exit(2);
    // The root holds nothing but the snapshot mount point, and is read-only.
    auto exists = [](const char* p) {
      int fd = ::open(p, O_PATH | O_CLOEXEC);
      if (fd >= 0) ::close(fd);
      return fd >= 0;
    };
    for (const char* p : {"/tmp", "/proc", "/dev/kvm", "/etc/passwd", "/bin/sh", "/sg-jail-secret", "/../sg-jail-secret"})
      if (exists(p)) ::_exit(5);
    if (!exists("/snapshot")) ::_exit(6);
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
  ::close(ready[1]);
  ::close(go[0]);
  char c = 0;
  const bool jailed = ::read(ready[0], &c, 1) == 1;
  if (jailed) {
    // No supplementary groups, no capabilities, permitted or effective.
    auto status = sg::sys::read_file("/proc/" + std::to_string(pid) + "/status", 1 << 16);
    REQUIRE(status);
    const std::string u = std::to_string(uid);
    CHECK(status->find("\nUid:\t" + u + "\t" + u + "\t" + u + "\t" + u + "\n") != std::string::npos);
    CHECK(status->find("\nGid:\t" + u + "\t" + u + "\t" + u + "\t" + u + "\n") != std::string::npos);
    size_t g = status->find("\nGroups:");
    REQUIRE(g != std::string::npos);
    const std::string groups = status->substr(g + 8, status->find('\n', g + 1) - g - 8);
    CHECK_MESSAGE(groups.find_first_not_of(" \t") == std::string::npos, "groups: ", groups);
    CHECK(status->find("\nCapPrm:\t0000000000000000\n") != std::string::npos);
    CHECK(status->find("\nCapEff:\t0000000000000000\n") != std::string::npos);
    CHECK(::write(go[1], "g", 1) == 1);
  }
  ::close(ready[0]);
  ::close(go[1]);
  int st = 0;
  REQUIRE(::waitpid(pid, &st, 0) == pid);
  REQUIRE(WIFEXITED(st));
  CHECK(WEXITSTATUS(st) == 0);
  CHECK(jailed);
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
