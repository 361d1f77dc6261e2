// The fault server on a real userfaultfd, no VM: a memfd-backed MAP_SHARED
// region (as the VMM's guest RAM) whose pages are released and then read
// from another thread, every wait bounded so a bug fails instead of hangs.
// Page contents come from a real Pool (payload = the raw page, kind 1 =
// zero page), so a corrupt pool record reaches the fault path.
#include <doctest/doctest.h>
#include <setjmp.h>
#include <signal.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <future>
#include <random>
#include <vector>

#include "wait-engine/memory/pool.h"
#include "wait-engine/memory/uffd.h"
#include "tests/support/temp_dir.h"

using namespace sg::memory;
using namespace std::chrono_literals;

namespace {

constexpr uint64_t kPages = 64;
constexpr uint64_t kPg = FaultServer::kPage;

uint64_t fnv(const uint8_t* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

// A memfd of kPages pages mapped shared: guest RAM in miniature.
struct Region {
  int memfd = -1;
  uint8_t* base = nullptr;
  Region() {
    memfd = ::memfd_create("uffd-test", MFD_CLOEXEC);
    REQUIRE(memfd >= 0);
    REQUIRE(::ftruncate(memfd, kPages * kPg) == 0);
    void* p = ::mmap(nullptr, kPages * kPg, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
    REQUIRE(p != MAP_FAILED);
    base = static_cast<uint8_t*>(p);
  }
  ~Region() {
    ::munmap(base, kPages * kPg);
    ::close(memfd);
  }
  uint8_t* page(uint64_t i) const { return base + i * kPg; }
  uint64_t resident() const {
    std::vector<unsigned char> v(kPages);
    REQUIRE(::mincore(base, kPages * kPg, v.data()) == 0);
    uint64_t n = 0;
    for (auto c : v) n += c & 1;
    return n;
  }
};

// Fills every page with its own pseudo-random bytes (zero pages stay zero),
// offloads them into the pool and returns the checksums.
std::vector<uint64_t> fill_and_offload(Region& r, Pool& pool, bool (*is_zero)(uint64_t)) {
  std::vector<uint64_t> sums(kPages);
  std::mt19937_64 rng(7);
  for (uint64_t i = 0; i < kPages; ++i) {
    if (is_zero(i)) {
      std::memset(r.page(i), 0, kPg);
      REQUIRE(pool.put("vm", i, 1, "").ok());
    } else {
      for (uint64_t k = 0; k < kPg / 8; ++k) {
        uint64_t v = rng();
        std::memcpy(r.page(i) + 8 * k, &v, 8);
      }
      REQUIRE(pool.put("vm", i, 0, std::string_view(reinterpret_cast<char*>(r.page(i)), kPg)).ok());
    }
    sums[i] = fnv(r.page(i), kPg);
  }
  return sums;
}

PoolConfig pool_config(uint64_t budget, const std::string& dir) {
  PoolConfig c;
  c.memory_budget = budget;
  c.dir = dir;
  return c;
}

PageSource pool_source(Pool& pool) {
  return [&pool](uint64_t page, uint8_t* out) -> sg::Result<PageFill> {
    auto rec = pool.get("vm", page);
    if (!rec) return rec.error();
    if (rec->kind == 1) return PageFill::kZero;
    if (rec->payload.size() != kPg) return sg::internal_error("bad raw page length");
    std::memcpy(out, rec->payload.data(), kPg);
    return PageFill::kData;
  };
}

std::vector<uint64_t> all_pages() {
  std::vector<uint64_t> v(kPages);
  for (uint64_t i = 0; i < kPages; ++i) v[i] = i;
  return v;
}

// Runs f on another thread; on a missed deadline stops the server (which
// unblocks a thread stuck in a fault) before waiting for it.
template <typename F>
auto with_deadline(FaultServer& s, F f, std::chrono::milliseconds d) {
  auto fut = std::async(std::launch::async, std::move(f));
  bool in_time = fut.wait_for(d) == std::future_status::ready;
  if (!in_time) s.stop();
  return std::make_pair(in_time, fut.get());
}

std::vector<uint64_t> read_sums(const Region& r) {
  std::vector<uint64_t> got(kPages);
  for (uint64_t i = 0; i < kPages; ++i) got[i] = fnv(r.page(i), kPg);
  return got;
}

thread_local sigjmp_buf* t_jump = nullptr;
void on_sigbus(int sig) {
  if (t_jump) siglongjmp(*t_jump, 1);
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

bool never_zero(uint64_t) { return false; }
bool every_fourth_zero(uint64_t i) { return i % 4 == 0; }

}  // namespace

TEST_CASE("uffd: released memfd pages fault, are served from the pool and read back intact on another thread") {
  sg::test::TempDir td;
  auto pool = std::move(Pool::open(pool_config(128 << 10, td.path()))).value();  // budget forces spills
  Region r;
  auto sums = fill_and_offload(r, *pool, never_zero);
  CHECK(pool->totals().bytes.file_records > 0);
  FaultServerOptions opt;
  opt.memfd = r.memfd;
  auto s = FaultServer::register_region(r.base, kPages * kPg, pool_source(*pool), opt);
  REQUIRE_MESSAGE(s.ok(), (s.ok() ? "" : s.error().message()));
  FaultServer& srv = **s;
  auto pages = all_pages();
  REQUIRE(srv.release(pages).ok());
  CHECK(r.resident() == 0);
  REQUIRE(srv.start().ok());
  auto [in_time, got] = with_deadline(srv, [&] { return read_sums(r); }, 10s);
  REQUIRE_MESSAGE(in_time, "reader still blocked after 10 s: faults were not served");
  CHECK(got == sums);
  FaultStats st = srv.stats();
  CHECK(st.faults == kPages);
  CHECK(st.copies == kPages);
  CHECK(st.source_errors == 0);
  CHECK(st.released == kPages);
  CHECK(r.resident() == kPages);
  CHECK(srv.state() == FaultServer::State::kServing);
  CHECK(st.fault_ns_max > 0);
  MESSAGE("fault service (pool file tier, raw pages): mean " << st.fault_ns_total / st.faults / 1000.0 << " us, max "
                                                             << st.fault_ns_max / 1000.0 << " us");
  // Reading again costs no fault.
  CHECK(read_sums(r) == sums);
  CHECK(srv.stats().faults == kPages);
  // A second offload/restore cycle on the same server.
  REQUIRE(srv.release(pages).ok());
  CHECK(r.resident() == 0);
  auto [in_time2, got2] = with_deadline(srv, [&] { return read_sums(r); }, 10s);
  REQUIRE(in_time2);
  CHECK(got2 == sums);
  CHECK(srv.stats().faults == 2 * kPages);
  auto t0 = std::chrono::steady_clock::now();
  srv.stop();
  CHECK(std::chrono::steady_clock::now() - t0 < 2s);
  CHECK(srv.state() == FaultServer::State::kStopped);
}

TEST_CASE("uffd: zero pages are installed with UFFDIO_ZEROPAGE (or a zero copy) and kernel-mode reads fault too") {
  sg::test::TempDir td;
  auto pool = std::move(Pool::open(pool_config(64 << 20, td.path()))).value();
  Region r;
  auto sums = fill_and_offload(r, *pool, every_fourth_zero);
  FaultServerOptions opt;
  opt.memfd = r.memfd;
  auto s = FaultServer::register_region(r.base, kPages * kPg, pool_source(*pool), opt);
  REQUIRE(s.ok());
  FaultServer& srv = **s;
  std::string zp = srv.zeropage_supported() ? "offered" : "not offered (zero pages copied)";
  MESSAGE("UFFDIO_ZEROPAGE on shmem: " << zp);
  REQUIRE(srv.release(all_pages()).ok());
  REQUIRE(srv.start().ok());
  // Half the pages through a syscall (copy_from_user faults in the kernel),
  // the rest by plain loads.
  auto [in_time, got] = with_deadline(
      srv,
      [&] {
        std::vector<uint64_t> g(kPages);
        int sink = ::memfd_create("sink", MFD_CLOEXEC);
        std::vector<uint8_t> back(kPg);
        for (uint64_t i = 0; i < kPages; ++i) {
          if (i % 2) {
            g[i] = fnv(r.page(i), kPg);
            continue;
          }
          if (::pwrite(sink, r.page(i), kPg, 0) != ssize_t(kPg) || ::pread(sink, back.data(), kPg, 0) != ssize_t(kPg))
            g[i] = 0;
          else
            g[i] = fnv(back.data(), kPg);
        }
        ::close(sink);
        return g;
      },
      10s);
  REQUIRE(in_time);
  CHECK(got == sums);
  FaultStats st = srv.stats();
  CHECK(st.zero_pages == kPages / 4);
  CHECK(st.copies == kPages - kPages / 4);
  CHECK(st.faults == kPages);
}

TEST_CASE("uffd: prefetched pages are installed before any fault; the rest fault on demand") {
  sg::test::TempDir td;
  auto pool = std::move(Pool::open(pool_config(64 << 20, td.path()))).value();
  Region r;
  auto sums = fill_and_offload(r, *pool, every_fourth_zero);
  FaultServerOptions opt;
  opt.memfd = r.memfd;
  auto s = FaultServer::register_region(r.base, kPages * kPg, pool_source(*pool), opt);
  REQUIRE(s.ok());
  FaultServer& srv = **s;
  REQUIRE(srv.release(all_pages()).ok());
  std::vector<uint64_t> hot;
  for (uint64_t i = 0; i < kPages; i += 2) hot.push_back(i);
  // Prefetch works before the thread runs: it is ioctls on the caller's thread.
  auto n = srv.prefetch(hot);
  REQUIRE(n.ok());
  CHECK(*n == hot.size());
  CHECK(r.resident() == hot.size());
  REQUIRE(srv.start().ok());
  auto [in_time, got] = with_deadline(srv, [&] { return read_sums(r); }, 10s);
  REQUIRE(in_time);
  CHECK(got == sums);
  FaultStats st = srv.stats();
  CHECK(st.prefetched == hot.size());
  CHECK(st.faults == kPages - hot.size());  // none on a prefetched page
  // Prefetching pages that are present installs nothing.
  auto again = srv.prefetch(hot);
  REQUIRE(again.ok());
  CHECK(*again == 0);
  CHECK(srv.stats().prefetch_present == hot.size());
  CHECK_FALSE(srv.prefetch(std::vector<uint64_t>{kPages}).ok());
}

TEST_CASE("uffd: a corrupt pool record is never installed: the page is poisoned, the reader gets SIGBUS/EFAULT, the server fails") {
  sg::test::TempDir td;
  auto pool = std::move(Pool::open(pool_config(64 << 20, td.path()))).value();
  Region r;
  auto sums = fill_and_offload(r, *pool, never_zero);
  REQUIRE(pool->spill_all("vm").ok());
  // Flip one payload byte of page 5's record on disk.
  std::string path = td.sub(pool_file_name("vm"));
  int fd = ::open(path.c_str(), O_RDWR);
  REQUIRE(fd >= 0);
  off_t off = kPoolFileHeaderSize + 5 * (kRecordHeaderSize + kPg) + kRecordHeaderSize + 77;
  uint8_t b = 0;
  REQUIRE(::pread(fd, &b, 1, off) == 1);
  b ^= 0x10;
  REQUIRE(::pwrite(fd, &b, 1, off) == 1);
  ::close(fd);

  std::string reported;
  FaultServerOptions opt;
  opt.memfd = r.memfd;
  opt.on_failure = [&](const sg::Error& e) { reported = e.message(); };
  auto s = FaultServer::register_region(r.base, kPages * kPg, pool_source(*pool), opt);
  REQUIRE(s.ok());
  FaultServer& srv = **s;
  REQUIRE(srv.release(all_pages()).ok());
  REQUIRE(srv.start().ok());

  if (!srv.poison_supported()) {
    // Documented fallback: the faulting thread stays blocked (nothing is
    // installed) until stop() closes the uffd.
    auto [in_time, v] = with_deadline(srv, [&] { return r.page(5)[0]; }, 300ms);
    CHECK_FALSE(in_time);
    CHECK(srv.failure().find("checksum mismatch") != std::string::npos);
    MESSAGE("UFFDIO_POISON unavailable: checked the blocked-until-stop fallback only");
    return;
  }
  struct Seen {
    int syscall_errno = 0;
    bool sigbus = false;
    std::vector<uint64_t> others;
  };
  auto [in_time, seen] = with_deadline(
      srv,
      [&] {
        Seen out;
        int sink = ::memfd_create("sink", MFD_CLOEXEC);
        if (::pwrite(sink, r.page(5), kPg, 0) < 0) out.syscall_errno = errno;
        ::close(sink);
        struct sigaction sa {}, old {};
        sa.sa_handler = on_sigbus;
        sigemptyset(&sa.sa_mask);
        ::sigaction(SIGBUS, &sa, &old);
        sigjmp_buf jb;
        t_jump = &jb;
        if (sigsetjmp(jb, 1) == 0) {
          volatile uint8_t v = r.page(5)[100];
          (void)v;
        } else {
          out.sigbus = true;
        }
        t_jump = nullptr;
        ::sigaction(SIGBUS, &old, nullptr);
        for (uint64_t i = 0; i < kPages; ++i)
          out.others.push_back(i == 5 ? 0 : fnv(r.page(i), kPg));
        return out;
      },
      10s);
  REQUIRE(in_time);
  CHECK(seen.syscall_errno == EFAULT);
  CHECK(seen.sigbus);
  for (uint64_t i = 0; i < kPages; ++i)
    if (i != 5) CHECK(seen.others[i] == sums[i]);
  CHECK(srv.state() == FaultServer::State::kFailed);
  CHECK(srv.failure().find("checksum mismatch") != std::string::npos);
  CHECK(reported.find("checksum mismatch") != std::string::npos);
  FaultStats st = srv.stats();
  CHECK(st.source_errors == 1);
  CHECK(st.poisoned == 1);
  CHECK(st.copies == kPages - 1);
  CHECK(pool->totals().read_errors == 1);
}

TEST_CASE("uffd: adopting a userfaultfd registered elsewhere (as the VMM hands it over)") {
  sg::test::TempDir td;
  auto pool = std::move(Pool::open(pool_config(64 << 20, td.path()))).value();
  Region r;
  auto sums = fill_and_offload(r, *pool, every_fourth_zero);
  REQUIRE(::fallocate(r.memfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, kPages * kPg) == 0);
  // What sandbox-runtime/vmm/vm/control.cpp does for `uffd`.
  int u = static_cast<int>(::syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK));
  REQUIRE(u >= 0);
  uffdio_api api{};
  api.api = UFFD_API;
  REQUIRE(::ioctl(u, UFFDIO_API, &api) == 0);
  uffdio_register reg{};
  reg.range.start = reinterpret_cast<uint64_t>(r.base);
  reg.range.len = kPages * kPg;
  reg.mode = UFFDIO_REGISTER_MODE_MISSING;
  REQUIRE(::ioctl(u, UFFDIO_REGISTER, &reg) == 0);
  FaultServerOptions opt;
  opt.memfd = r.memfd;
  auto s = FaultServer::adopt(sg::UniqueFd(u), reinterpret_cast<uint64_t>(r.base), kPages * kPg, pool_source(*pool), opt);
  REQUIRE(s.ok());
  FaultServer& srv = **s;
  CHECK_FALSE(srv.poison_supported());  // the VMM's fd has no features yet
  REQUIRE(srv.start().ok());
  auto [in_time, got] = with_deadline(srv, [&] { return read_sums(r); }, 10s);
  REQUIRE(in_time);
  CHECK(got == sums);
  CHECK(srv.stats().faults == kPages);
  CHECK_FALSE(srv.start().ok());  // kServing -> kServing is not a transition
}

TEST_CASE("uffd: the deadline guard works: a fault nobody serves blocks, and stop() releases it with the kernel's zero page") {
  sg::test::TempDir td;
  auto pool = std::move(Pool::open(pool_config(64 << 20, td.path()))).value();
  Region r;
  fill_and_offload(r, *pool, never_zero);
  FaultServerOptions opt;
  opt.memfd = r.memfd;
  auto s = FaultServer::register_region(r.base, kPages * kPg, pool_source(*pool), opt);
  REQUIRE(s.ok());
  FaultServer& srv = **s;
  REQUIRE(srv.release(all_pages()).ok());
  // Never started: the fault stays unserved until stop() closes the uffd.
  auto t0 = std::chrono::steady_clock::now();
  auto [in_time, first] = with_deadline(srv, [&] { return fnv(r.page(3), kPg); }, 200ms);
  CHECK_FALSE(in_time);
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);
  std::vector<uint8_t> zero(kPg, 0);
  CHECK(first == fnv(zero.data(), kPg));
  CHECK(srv.state() == FaultServer::State::kStopped);
  CHECK(srv.stats().faults == 0);
  CHECK_FALSE(srv.prefetch(std::vector<uint64_t>{1}).ok());
}
