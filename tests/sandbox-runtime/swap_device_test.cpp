// process/swap.h on the real kernel (root, zram): a child's memory goes out
// to a zram device the test makes; the child reads every other page back,
// which frees half of the compressed objects but few of zram's own pages;
// compact() gives that RAM back. Where /sys is read-only no device is made.
#include <doctest/doctest.h>
#include <dirent.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include "base/fd.h"
#include "base/sys.h"
#include "sandbox-runtime/process/swap.h"
#include "tests/support/temp_dir.h"

namespace sg::process {
namespace {

constexpr size_t kPage = 4096;
constexpr size_t kPages = 8192;  // 32 MiB

// The child: kPages of text-like pages, then one byte per command: 'c'
// answers a checksum of every page, 'h' reads every other page (a read
// fault each) and answers a sum of those bytes, 'q' exits. It answers 'c'
// once at the start.
[[noreturn]] void child_main(int in, int out) {
  auto* mem = static_cast<unsigned char*>(::mmap(nullptr, kPages * kPage, PROT_READ | PROT_WRITE,
                                                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (mem == MAP_FAILED) ::_exit(2);
  ::madvise(mem, kPages * kPage, MADV_NOHUGEPAGE);  // 4 KiB pages, each paged out alone
  for (size_t p = 0; p < kPages; ++p) {
    char line[64];
    for (size_t at = 0; at < kPage;) {
      int n = std::snprintf(line, sizeof line, "page %zu offset %zu of the agent's notes; ", p, at);
      size_t take = std::min(kPage - at, static_cast<size_t>(n));
      std::memcpy(mem + p * kPage + at, line, take);
      at += take;
    }
  }
  for (char c = 'c';;) {
    uint64_t sum = 0;
    if (c == 'c') {
      for (size_t p = 0; p < kPages; ++p) sum = sum * 31 + mem[p * kPage + 7] + mem[p * kPage + 4000];
    } else if (c == 'h') {
      for (size_t p = 0; p < kPages; p += 2) sum += mem[p * kPage];
    }
    if (::write(out, &sum, sizeof sum) != sizeof sum) ::_exit(3);
    if (::read(in, &c, 1) != 1 || c == 'q') ::_exit(0);
  }
}

TEST_CASE("zram: pages read back leave its RAM in use until compact() frees it") {
  REQUIRE_MESSAGE(sys::path_exists("/sys/class/zram-control/hot_add"), "this test needs the kernel's zram");
  test::TempDir dir;
  SwapConfig cfg;
  cfg.zram_bytes = 256u << 20;
  cfg.record = dir.path() + "/swap-device";
  Result<std::unique_ptr<SwapDevice>> dev = SwapDevice::open(cfg);
  REQUIRE_MESSAGE(dev, (dev ? "" : dev.error().message()));
  Result<SwapStats> empty = (*dev)->stats();
  REQUIRE(empty);

  int to_child[2], from_child[2];
  REQUIRE(::pipe(to_child) == 0);
  REQUIRE(::pipe(from_child) == 0);
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) child_main(to_child[0], from_child[1]);
  UniqueFd cmd(to_child[1]), answers(from_child[0]);
  ::close(to_child[0]);
  ::close(from_child[1]);
  struct Reap {
    pid_t pid;
    ~Reap() {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  } reap{pid};
  auto ask = [&](char c) {
    if (c) REQUIRE(::write(cmd.get(), &c, 1) == 1);
    uint64_t sum = 0;
    REQUIRE(::read(answers.get(), &sum, sizeof sum) == sizeof sum);
    return sum;
  };
  uint64_t sum = ask(0);

  std::atomic<bool> cancel{false};
  Result<PageOutResult> out = page_out({pid}, cancel);
  REQUIRE_MESSAGE(out, (out ? "" : out.error().message()));
  INFO("pages out: " << out->out_pages);
  CHECK(out->out_pages >= kPages * 9 / 10);
  Result<SwapStats> full = (*dev)->stats();
  REQUIRE(full);
  CHECK(full->used_bytes - empty->used_bytes >= kPages * kPage * 9 / 10);
  // Nothing to give back yet.
  Result<bool> early = (*dev)->compact(1u << 20);
  REQUIRE(early);
  CHECK(!*early);

  // Every other page back: half the objects freed, spread over every one
  // of zram's pages.
  CHECK(ask('h') != 0);
  Result<SwapStats> holed = (*dev)->stats();
  REQUIRE(holed);
  CHECK(holed->stored_bytes < full->stored_bytes * 3 / 4);
  CHECK(holed->memory_bytes > full->memory_bytes * 3 / 4);
  Result<bool> compacted = (*dev)->compact(1u << 20);
  REQUIRE(compacted);
  CHECK(*compacted);
  Result<SwapStats> after = (*dev)->stats();
  REQUIRE(after);
  MESSAGE("zram RAM " << (full->memory_bytes >> 10) << " KiB after the page-out, " << (holed->memory_bytes >> 10)
                      << " KiB with half read back (" << (holed->stored_bytes >> 10) << " KiB stored), "
                      << (after->memory_bytes >> 10) << " KiB compacted");
  CHECK(after->memory_bytes < holed->memory_bytes - (holed->memory_bytes - holed->stored_bytes) / 2);
  CHECK(after->compacted_pages > holed->compacted_pages);
  // The data is whole.
  CHECK(ask('c') == sum);
}

// The zram devices the host has now.
int zram_devices() {
  int n = 0;
  DIR* d = ::opendir("/sys/block");
  if (!d) return -1;
  while (dirent* e = ::readdir(d))
    if (std::strncmp(e->d_name, "zram", 4) == 0) ++n;
  ::closedir(d);
  return n;
}

TEST_CASE("zram where /sys is read-only (a container's): kUnavailable, and no device left on the host") {
  REQUIRE_MESSAGE(sys::path_exists("/sys/class/zram-control/hot_add"), "this test needs the kernel's zram");
  test::TempDir dir;
  int before = zram_devices();
  REQUIRE(before >= 0);
  int answer[2];
  REQUIRE(::pipe(answer) == 0);
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    // A mount namespace of its own, /sys bound read-only in it (as a
    // container without --privileged has it).
    char code = 'x';
    if (::unshare(CLONE_NEWNS) == 0 && ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) == 0 &&
        ::mount("/sys", "/sys", nullptr, MS_BIND | MS_REC, nullptr) == 0 &&
        ::mount(nullptr, "/sys", nullptr, MS_REMOUNT | MS_BIND | MS_RDONLY, nullptr) == 0) {
      SwapConfig cfg;
      cfg.zram_bytes = 64u << 20;
      cfg.record = dir.path() + "/swap-device";
      Result<std::unique_ptr<SwapDevice>> dev = SwapDevice::open(cfg);
      code = dev ? 'o' : dev.error().kind() == ErrorKind::kUnavailable &&
                                 dev.error().message().find("not writable") != std::string::npos
                             ? 'u'
                             : 'e';
    }
    (void)!::write(answer[1], &code, 1);
    ::_exit(0);
  }
  ::close(answer[1]);
  char code = 0;
  CHECK(::read(answer[0], &code, 1) == 1);
  ::close(answer[0]);
  ::waitpid(pid, nullptr, 0);
  CHECK_MESSAGE(code == 'u', "the child answered " << std::string(1, code) << " (x: no read-only /sys; o: a device; e: another error)");
  CHECK(zram_devices() == before);
}

}  // namespace
}  // namespace sg::process
