// Seccomp policy compiler and the process-backend sandbox's filter, on the
// real kernel: each case installs a filter in a forked child (a filter is
// irrevocable) and the child exits with the number of the first probe that
// did not behave, 0 when all did.
#include "base/seccomp.h"

#include <doctest/doctest.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <functional>
#include <thread>

#include "sandbox-runtime/agent/harden.h"

namespace {

using namespace sg::sys::seccomp;

// Runs body in a forked child; returns its wait status.
int in_child(const std::function<int()>& body) {
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) ::_exit(body());
  int st = 0;
  REQUIRE(::waitpid(pid, &st, 0) == pid);
  return st;
}

int exit_code(int st) { return WIFEXITED(st) ? WEXITSTATUS(st) : 1000 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0); }

// -1 with this errno?
bool fails_with(long r, int err) { return r == -1 && errno == err; }

int install_sandbox_filter() {
  auto program = compile(sg::agent::sandbox_syscall_policy());
  if (!program) return 90;
  return install(*program, true) ? 0 : 91;
}

}  // namespace

TEST_CASE("seccomp: compile refuses a negative syscall number and an argument index over 5") {
  Policy p;
  p.rules.push_back(Rule{-1, fail_with(EPERM), std::nullopt});
  auto r = compile(p);
  REQUIRE_FALSE(r);
  CHECK(r.error().kind() == sg::ErrorKind::kInvalid);
  p.rules = {Rule{SYS_getpid, fail_with(EPERM), ArgCheck{6, ArgCheck::Op::kEquals, 0}}};
  r = compile(p);
  REQUIRE_FALSE(r);
  CHECK(r.error().message().find("argument index 6") != std::string::npos);
  p.rules.assign(2100, Rule{SYS_getpid, fail_with(EPERM), std::nullopt});  // 2 instructions each
  r = compile(p);
  REQUIRE_FALSE(r);
  CHECK(r.error().message().find("instructions") != std::string::npos);
}

TEST_CASE("seccomp: rules on an argument (equal, any bit, no bit) refuse only what they name; the first matching rule wins") {
  int st = in_child([] {
    Policy p;
    p.default_action = allow();
    p.foreign_action = kill_process();
    p.rules.push_back(Rule{SYS_prctl, fail_with(EACCES), ArgCheck{0, ArgCheck::Op::kEquals, PR_GET_NAME}});
    p.rules.push_back(Rule{SYS_prctl, fail_with(EPERM), std::nullopt});  // every other prctl
    p.rules.push_back(Rule{SYS_getppid, fail_with(EPERM), ArgCheck{0, ArgCheck::Op::kAnyBitSet, 0x4}});
    p.rules.push_back(Rule{SYS_getpgid, fail_with(EPERM), ArgCheck{1, ArgCheck::Op::kNoBitSet, 0x8}});
    auto program = compile(p);
    if (!program) return 90;
    if (!install(*program, false)) return 91;
    char name[16];
    if (!fails_with(::prctl(PR_GET_NAME, name, 0, 0, 0), EACCES)) return 1;
    if (!fails_with(::prctl(PR_GET_DUMPABLE, 0, 0, 0, 0), EPERM)) return 2;
    if (::syscall(SYS_getppid, 0x3) < 0) return 3;  // bit 2 clear: allowed
    if (!fails_with(::syscall(SYS_getppid, 0x7), EPERM)) return 4;
    if (::getpid() <= 0) return 5;  // the default
    if (!fails_with(::syscall(SYS_getpgid, 0, 0x7), EPERM)) return 6;  // bit 3 clear: refused
    if (::syscall(SYS_getpgid, 0, 0x8) < 0) return 7;                 // bit 3 set: allowed
    return 0;
  });
  CHECK(exit_code(st) == 0);
}

TEST_CASE("seccomp: the sandbox filter refuses new user namespaces, keyrings, bpf, io_uring and mounts; clone3 is ENOSYS") {
  int st = in_child([] {
    if (int e = install_sandbox_filter()) return e;
    if (!fails_with(::unshare(CLONE_NEWUSER), EPERM)) return 1;
    if (!fails_with(::syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, nullptr, nullptr, nullptr, 0), EPERM)) return 2;
    // Other namespace kinds are left to the kernel's capability checks:
    // this test runs as root, so a new UTS namespace is allowed.
    if (::unshare(CLONE_NEWUTS) != 0) return 3;
    if (!fails_with(::syscall(SYS_clone3, nullptr, 0), ENOSYS)) return 4;
    if (!fails_with(::syscall(SYS_keyctl, 0 /*KEYCTL_GET_KEYRING_ID*/, -3, 0), EPERM)) return 5;
    if (!fails_with(::syscall(SYS_bpf, 0, nullptr, 0), EPERM)) return 6;
    if (!fails_with(::syscall(SYS_io_uring_setup, 1, nullptr), EPERM)) return 7;
    if (!fails_with(::syscall(SYS_userfaultfd, 0), EPERM)) return 8;
    if (!fails_with(::syscall(SYS_perf_event_open, nullptr, 0, -1, -1, 0), EPERM)) return 9;
    // Without the filter root would get ENOENT (no such mount point).
    if (!fails_with(::mount("none", "/nonexistent-sandgate", "tmpfs", 0, nullptr), EPERM)) return 10;
    if (!fails_with(::syscall(SYS_open_by_handle_at, -1, nullptr, 0), EPERM)) return 11;
    if (!fails_with(::syscall(SYS_setns, -1, 0), EPERM)) return 12;
    // Ordinary work goes on: threads (glibc falls back from clone3 to
    // clone), fork, exec'able children.
    std::atomic<int> ran{0};
    std::thread t([&] { ran = 1; });
    t.join();
    if (ran != 1) return 13;
    pid_t c = ::fork();
    if (c < 0) return 14;
    if (c == 0) ::_exit(7);
    int cst = 0;
    if (::waitpid(c, &cst, 0) != c || !WIFEXITED(cst) || WEXITSTATUS(cst) != 7) return 15;
    return 0;
  });
  CHECK(exit_code(st) == 0);
}

TEST_CASE("seccomp: the filter covers threads that already run (TSYNC) and is inherited across exec") {
  int st = in_child([] {
    std::atomic<int> stage{0};
    std::atomic<long> result{0};
    std::atomic<int> err{0};
    std::thread t([&] {
      while (stage.load() == 0) std::this_thread::yield();
      result = ::syscall(SYS_keyctl, 0, -3, 0);
      err = errno;
    });
    int e = install_sandbox_filter();
    stage = 1;
    t.join();
    if (e) return e;
    if (result != -1 || err != EPERM) return 1;
    // A shell started after the filter cannot make a new user namespace.
    execl("/bin/sh", "sh", "-c", "command -v unshare >/dev/null || exit 4; unshare -U true 2>/dev/null && exit 3; exit 0", nullptr);
    return 2;
  });
  CHECK(exit_code(st) == 0);
}

#if defined(__x86_64__)
TEST_CASE("seccomp: a syscall through another ABI (i386 int 0x80, x32) kills the process") {
  int st = in_child([] {
    if (int e = install_sandbox_filter()) return e;
    long r = 20;  // i386 getpid
    asm volatile("int $0x80" : "+a"(r) : : "memory");
    return 1;  // not reached
  });
  CHECK(WIFSIGNALED(st));
  CHECK(WTERMSIG(st) == SIGSYS);
  st = in_child([] {
    if (int e = install_sandbox_filter()) return e;
    ::syscall(0x40000000 | SYS_getpid);
    return 1;
  });
  CHECK(WIFSIGNALED(st));
  CHECK(WTERMSIG(st) == SIGSYS);
}
#endif
