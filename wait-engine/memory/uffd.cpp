// The userfaultfd fault server (uffd.h; behaviour in docs/memory-pool.md).
#include "wait-engine/memory/uffd.h"

#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "base/log.h"
#include "base/sys.h"

namespace sg::memory {

namespace {

constexpr int kMaxEagainRetries = 10000;

// UFFDIO_POISON (Linux 6.6 ABI, include/uapi/linux/userfaultfd.h), spelt
// out where the installed headers predate it; a kernel without it does not
// offer the feature bit, so probing stays correct.
#ifndef UFFD_FEATURE_POISON
#define UFFD_FEATURE_POISON (1 << 14)
#define _UFFDIO_POISON (0x08)
struct uffdio_poison {
  struct uffdio_range range;
#define UFFDIO_POISON_MODE_DONTWAKE ((__u64)1 << 0)
  __u64 mode;
  __s64 updated;
};
#define UFFDIO_POISON _IOWR(UFFDIO, _UFFDIO_POISON, struct uffdio_poison)
#endif
constexpr uint64_t kPoisonFeature = UFFD_FEATURE_POISON;

Result<UniqueFd> new_uffd() {
  int fd = static_cast<int>(::syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK));
  if (fd < 0 && errno == EPERM) {
    // Unprivileged and vm.unprivileged_userfaultfd=0: user-mode faults
    // only, so a syscall that reads a missing page gets EFAULT instead of
    // waiting for it. Enough for tests; the VMM's own uffd has no such limit.
    fd = static_cast<int>(::syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY));
  }
  if (fd < 0) return sys::errno_error("userfaultfd", "fault server");
  return UniqueFd(fd);
}

// The features this kernel offers, from a throwaway fd (UFFDIO_API may be
// called once per fd, and asking for an unknown feature fails it).
uint64_t probe_features() {
  auto fd = new_uffd();
  if (!fd) return 0;
  uffdio_api api{};
  api.api = UFFD_API;
  // SAFETY: UFFDIO_API reads and writes one uffdio_api we own.
  if (::ioctl(fd->get(), UFFDIO_API, &api) != 0) return 0;
  return api.features;
}

}  // namespace

const char* to_string(FaultServer::State s) {
  switch (s) {
    case FaultServer::State::kCreated: return "created";
    case FaultServer::State::kServing: return "serving";
    case FaultServer::State::kFailed: return "failed";
    case FaultServer::State::kStopped: return "stopped";
  }
  return "?";
}

FaultServer::FaultServer(UniqueFd uffd, uint64_t base, uint64_t len, PageSource source, FaultServerOptions opt,
                         bool local)
    : uffd_(std::move(uffd)), base_(base), len_(len), source_(std::move(source)), opt_(std::move(opt)),
      local_(local) {
  poison_ = (opt_.features & kPoisonFeature) != 0;
}

Result<std::unique_ptr<FaultServer>> FaultServer::register_region(void* base, uint64_t len, PageSource source,
                                                                  FaultServerOptions opt) {
  auto addr = reinterpret_cast<uint64_t>(base);
  if (addr % kPage || len % kPage || len == 0) return invalid_error("fault server: region not page-aligned");
  uint64_t want = probe_features() & kPoisonFeature;
  auto fd = new_uffd();
  if (!fd) return fd.error();
  uffdio_api api{};
  api.api = UFFD_API;
  api.features = want;
  // SAFETY: as in probe_features.
  if (::ioctl(fd->get(), UFFDIO_API, &api) != 0) return sys::errno_error("UFFDIO_API", "fault server");
  uffdio_register reg{};
  reg.range.start = addr;
  reg.range.len = len;
  reg.mode = UFFDIO_REGISTER_MODE_MISSING;
  // SAFETY: registers a range of our own mapping; the kernel checks it is
  // mapped and of a kind uffd supports (anonymous, shmem, hugetlbfs).
  if (::ioctl(fd->get(), UFFDIO_REGISTER, &reg) != 0)
    return sys::errno_error("UFFDIO_REGISTER", "region of " + std::to_string(len) + " bytes");
  if (!(reg.ioctls & (1ull << _UFFDIO_COPY))) return internal_error("fault server: UFFDIO_COPY not offered for the region");
  opt.features = api.features;
  std::unique_ptr<FaultServer> s(new FaultServer(std::move(*fd), addr, len, std::move(source), std::move(opt), true));
  s->zeropage_ = (reg.ioctls & (1ull << _UFFDIO_ZEROPAGE)) != 0;
  s->poison_ = s->poison_ && (reg.ioctls & (1ull << _UFFDIO_POISON)) != 0;
  if (!s->zeropage_) LOG_INFO("fault server: UFFDIO_ZEROPAGE not offered for this memory; zero pages are copied");
  if (!s->poison_) LOG_WARN("fault server: UFFDIO_POISON unavailable; a page the pool cannot give blocks its thread");
  return s;
}

Result<std::unique_ptr<FaultServer>> FaultServer::adopt(UniqueFd uffd, uint64_t base, uint64_t len, PageSource source,
                                                        FaultServerOptions opt) {
  if (!uffd) return invalid_error("fault server: no userfaultfd to adopt");
  if (base % kPage || len % kPage || len == 0) return invalid_error("fault server: region not page-aligned");
  int fl = ::fcntl(uffd.get(), F_GETFL);
  if (fl < 0 || ::fcntl(uffd.get(), F_SETFL, fl | O_NONBLOCK) != 0)
    return sys::errno_error("fcntl O_NONBLOCK", "adopted userfaultfd");
  return std::unique_ptr<FaultServer>(
      new FaultServer(std::move(uffd), base, len, std::move(source), std::move(opt), false));
}

FaultServer::~FaultServer() { stop(); }

bool FaultServer::transition(State to) {
  bool ok = false;
  switch (state_) {
    case State::kCreated: ok = to == State::kServing || to == State::kStopped; break;
    case State::kServing: ok = to == State::kFailed || to == State::kStopped; break;
    case State::kFailed: ok = to == State::kStopped; break;
    case State::kStopped: ok = false; break;
  }
  if (ok) state_ = to;
  return ok;
}

Status FaultServer::start() {
  int ev = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (ev < 0) return sys::errno_error("eventfd", "fault server");
  std::lock_guard lk(mu_);
  if (!transition(State::kServing)) {
    ::close(ev);
    return conflict_error(std::string("fault server start: state is ") + to_string(state_));
  }
  stop_event_.reset(ev);
  thread_ = std::thread([this] { run(); });
  return Status::Ok();
}

void FaultServer::stop() {
  {
    std::lock_guard lk(mu_);
    if (state_ == State::kStopped) return;
    transition(State::kStopped);
  }
  if (stop_event_) {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(stop_event_.get(), &one, sizeof one);
  }
  if (thread_.joinable()) thread_.join();
  // Closing the uffd unregisters the region and wakes blocked faults.
  uffd_.reset();
}

FaultServer::State FaultServer::state() const {
  std::lock_guard lk(mu_);
  return state_;
}
FaultStats FaultServer::stats() const {
  std::lock_guard lk(mu_);
  return stats_;
}
std::string FaultServer::failure() const {
  std::lock_guard lk(mu_);
  return failure_;
}

void FaultServer::run() {
  pollfd fds[2] = {{uffd_.get(), POLLIN, 0}, {stop_event_.get(), POLLIN, 0}};
  uffd_msg msgs[32];
  for (;;) {
    int n = ::poll(fds, 2, opt_.poll_timeout_ms);
    if (fds[1].revents || state() == State::kStopped) return;
    if (n < 0 && errno != EINTR) {
      LOG_ERROR("fault server: poll: " << std::strerror(errno));
      return;
    }
    if (n <= 0 || !(fds[0].revents & POLLIN)) {
      if (fds[0].revents & (POLLERR | POLLHUP)) {
        LOG_WARN("fault server: userfaultfd closed by its owner");
        return;
      }
      continue;
    }
    // SAFETY: the kernel writes whole uffd_msg records into our array.
    ssize_t r = ::read(uffd_.get(), msgs, sizeof msgs);
    if (r < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      LOG_ERROR("fault server: read userfaultfd: " << std::strerror(errno));
      return;
    }
    for (size_t i = 0; i < static_cast<size_t>(r) / sizeof(uffd_msg); ++i) {
      if (msgs[i].event == UFFD_EVENT_PAGEFAULT) serve(msgs[i].arg.pagefault.address);
    }
  }
}

int FaultServer::uffd_ioctl(unsigned long req, void* arg) {
  for (int i = 0; i < kMaxEagainRetries; ++i) {
    // SAFETY: req is one of UFFDIO_COPY/ZEROPAGE/POISON/WAKE with its own
    // argument struct; the destination range was checked against the region.
    if (::ioctl(uffd_.get(), req, arg) == 0) return 0;
    if (errno != EAGAIN) return errno;
    // The mm is changing under us (mremap, fork): try again.
    {
      std::lock_guard lk(mu_);
      ++stats_.eagain_retries;
    }
    if (req == UFFDIO_COPY) {
      auto* c = static_cast<uffdio_copy*>(arg);
      if (c->copy > 0) {
        c->dst += c->copy, c->src += c->copy, c->len -= c->copy;
        if (c->len == 0) return 0;
      }
      c->copy = 0;
    }
    ::sched_yield();
  }
  return EAGAIN;
}

void FaultServer::wake(uint64_t first_page, uint64_t n_pages) {
  uffdio_range r{base_ + first_page * kPage, n_pages * kPage};
  if (int e = uffd_ioctl(UFFDIO_WAKE, &r); e != 0)
    LOG_WARN("fault server: UFFDIO_WAKE page " << first_page << ": " << std::strerror(e));
}

void FaultServer::note_failure(uint64_t page, const Error& e) {
  bool first = false;
  {
    std::lock_guard lk(mu_);
    if (failure_.empty()) {
      failure_ = "page " + std::to_string(page) + ": " + e.message();
      first = true;
    }
    if (state_ == State::kServing) transition(State::kFailed);
  }
  if (first) {
    LOG_ERROR("fault server: cannot restore " << failure_ << "; the sandbox's memory is lost");
    if (opt_.on_failure) opt_.on_failure(e);
  }
}

std::unique_lock<std::mutex> FaultServer::hold_installs() { return std::unique_lock<std::mutex>(install_mu_); }

FaultServer::Install FaultServer::install(uint64_t page, bool wake_now, uint8_t* buf, Error* err) {
  std::lock_guard hold(install_mu_);
  uint64_t dst = base_ + page * kPage;
  uint64_t mode_wake = wake_now ? 0 : 1;  // DONTWAKE is bit 0 in COPY and ZEROPAGE
  auto fill = source_(page, buf);
  if (!fill) {
    *err = fill.error();
    return Install::kSourceFailed;
  }
  int e = 0;
  Install done = Install::kCopied;
  if (*fill == PageFill::kZero && zeropage_) {
    uffdio_zeropage z{};
    z.range = {dst, kPage};
    z.mode = mode_wake ? UFFDIO_ZEROPAGE_MODE_DONTWAKE : 0;
    e = uffd_ioctl(UFFDIO_ZEROPAGE, &z);
    if (e == EINVAL) {
      LOG_INFO("fault server: UFFDIO_ZEROPAGE refused for this memory; zero pages are copied from now on");
      zeropage_ = false;
    } else {
      done = Install::kZeroed;
    }
  }
  if (*fill == PageFill::kZero && !zeropage_) {
    std::memset(buf, 0, kPage);
    done = Install::kZeroed;
    e = -1;  // fall into the copy below
  }
  if (*fill == PageFill::kData || e == -1) {
    uffdio_copy c{};
    c.dst = dst;
    c.src = reinterpret_cast<uint64_t>(buf);
    c.len = kPage;
    c.mode = mode_wake ? UFFDIO_COPY_MODE_DONTWAKE : 0;
    e = uffd_ioctl(UFFDIO_COPY, &c);
  }
  if (e == 0) {
    if (opt_.installed) opt_.installed(page);
    return done;
  }
  if (e == EEXIST) {
    if (wake_now) wake(page, 1);
    return Install::kPresent;
  }
  if (e == ESRCH) return Install::kGone;  // its mm is gone: nobody waits for the page
  *err = sys::errno_error(*fill == PageFill::kZero ? "install zero page" : "UFFDIO_COPY",
                          "page " + std::to_string(page), e);
  return Install::kFailed;
}

// The page is installed without waking, the counters are updated, then the
// faulting thread is woken: whoever it is sees stats that include its fault.
void FaultServer::serve(uint64_t addr) {
  uint64_t t0 = sys::monotonic_ns();
  if (addr < base_ || addr - base_ >= len_) {
    std::lock_guard lk(mu_);
    ++stats_.faults;
    ++stats_.out_of_range;
    return;
  }
  uint64_t page = (addr - base_) / kPage;
  Error err = internal_error("");
  Install r = install(page, false, fault_buf_.data(), &err);
  if (r == Install::kGone) {
    std::lock_guard lk(mu_);
    ++stats_.faults;
    ++stats_.target_exited;
    return;
  }
  if (r == Install::kSourceFailed || r == Install::kFailed) {
    bool poisoned = false;
    if (poison_) {
      uffdio_poison p{};
      p.range = {base_ + page * kPage, kPage};
      p.mode = UFFDIO_POISON_MODE_DONTWAKE;
      int e = uffd_ioctl(UFFDIO_POISON, &p);
      poisoned = e == 0;
      if (e != 0 && e != EEXIST) LOG_ERROR("fault server: UFFDIO_POISON page " << page << ": " << std::strerror(e));
    }
    {
      std::lock_guard lk(mu_);
      ++stats_.faults;
      ++stats_.source_errors;
      if (poisoned) ++stats_.poisoned;
    }
    note_failure(page, err);
    // Poisoned: the woken thread gets SIGBUS. Not poisoned: no wake, the
    // thread stays blocked (waking it would only fault again).
    if (poisoned) wake(page, 1);
    return;
  }
  uint64_t dt = sys::monotonic_ns() - t0;
  {
    std::lock_guard lk(mu_);
    ++stats_.faults;
    if (r == Install::kCopied) ++stats_.copies;
    if (r == Install::kZeroed) ++stats_.zero_pages;
    if (r == Install::kPresent) ++stats_.already_present;
    stats_.fault_ns_total += dt;
    stats_.fault_ns_max = std::max(stats_.fault_ns_max, dt);
  }
  wake(page, 1);
}

Result<uint64_t> FaultServer::prefetch(std::span<const uint64_t> pages) {
  {
    std::lock_guard lk(mu_);
    if (state_ == State::kStopped) return conflict_error("fault server prefetch: stopped");
  }
  std::vector<uint8_t> buf(kPage);
  uint64_t installed = 0, present = 0, errors = 0;
  uint64_t lo = UINT64_MAX, hi = 0;
  for (uint64_t p : pages) {
    if (p >= pages_count()) return invalid_error("fault server prefetch: page " + std::to_string(p) + " outside the region");
    Error err = internal_error("");
    Install r = install(p, false, buf.data(), &err);
    if (r == Install::kCopied || r == Install::kZeroed) {
      ++installed;
      lo = std::min(lo, p);
      hi = std::max(hi, p);
    } else if (r == Install::kPresent) {
      ++present;
    } else {
      ++errors;
      LOG_DEBUG("fault server prefetch: " << err.message() << " (left to fault)");
    }
  }
  // One wake for the span: anyone who faulted on an installed page meanwhile.
  if (installed) wake(lo, hi - lo + 1);
  std::lock_guard lk(mu_);
  stats_.prefetched += installed;
  stats_.prefetch_present += present;
  stats_.prefetch_errors += errors;
  return installed;
}

Status FaultServer::release(std::span<const uint64_t> pages) {
  std::vector<uint64_t> sorted(pages.begin(), pages.end());
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  if (!sorted.empty() && sorted.back() >= pages_count())
    return invalid_error("fault server release: page " + std::to_string(sorted.back()) + " outside the region");
  if (opt_.memfd < 0 && !local_) return invalid_error("fault server release: no memfd for a remote region");
  for (size_t i = 0; i < sorted.size();) {
    size_t j = i + 1;
    while (j < sorted.size() && sorted[j] == sorted[j - 1] + 1) ++j;
    uint64_t off = sorted[i] * kPage, len = (j - i) * kPage;
    if (opt_.memfd >= 0) {
      // Frees the pages in the page cache and zaps every mapping of them,
      // so the next touch is a missing fault.
      if (::fallocate(opt_.memfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(off),
                      static_cast<off_t>(len)) != 0)
        return sys::errno_error("fallocate PUNCH_HOLE", "guest RAM page " + std::to_string(sorted[i]));
    } else {
      // SAFETY: [base_+off, +len) is inside the region we registered in our
      // own address space; MADV_REMOVE punches the shmem hole behind it.
      void* p = reinterpret_cast<void*>(base_ + off);
      if (::madvise(p, len, MADV_REMOVE) != 0 && (errno != EINVAL || ::madvise(p, len, MADV_DONTNEED) != 0))
        return sys::errno_error("madvise MADV_REMOVE", "region page " + std::to_string(sorted[i]));
    }
    i = j;
  }
  std::lock_guard lk(mu_);
  stats_.released += sorted.size();
  return Status::Ok();
}

}  // namespace sg::memory
