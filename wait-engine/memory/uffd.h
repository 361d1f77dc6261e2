// FaultServer: serves userfaultfd missing-page faults on a guest-RAM region
// from the pool, so an offloaded sandbox gets its pages back on first touch.
//
// The region is either mapped in this process (register_region: tests, or
// sandgate's own mapping of the VMM's memfd) or lives in another process
// whose userfaultfd was handed over (adopt: the VMM's `uffd` control
// command, docs/vmm.md). Either way page i is the 4 KiB at base + i*4096,
// which is also offset i*4096 of the guest-RAM memfd.
//
// One thread reads fault events (poll with a 50 ms timeout, plus an eventfd,
// so stop() is prompt), asks the PageSource for the page and installs it
// with UFFDIO_COPY, or UFFDIO_ZEROPAGE when the source says "zero" (a copy
// of a zero page where the kernel lacks ZEROPAGE for this memory). EEXIST
// (present already) is success plus a wake; EAGAIN is retried.
//
// A source error is never turned into page contents: the page is poisoned
// (UFFDIO_POISON, Linux 6.6+), so the faulting thread gets SIGBUS (a
// syscall touching it gets EFAULT; KVM turns it into a memory error and
// the VMM ends), the server goes to kFailed, and the error is kept. Other
// pages are still served. Without UFFD_FEATURE_POISON the faulting thread
// is left blocked until the uffd is closed (stop()); the owner must kill
// the sandbox. docs/memory-pool.md.
//
// Thread safety: prefetch(), release(), stats() and state() may be called
// from any thread while the server runs; the PageSource is called from the
// server thread and from prefetch() callers, so it must be thread-safe.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>

#include "base/fd.h"
#include "base/status.h"

namespace sg::memory {

enum class PageFill { kData, kZero };

// Fills out (4096 bytes) with page page_index and returns kData, or
// returns kZero (out untouched), or an error (nothing is installed).
using PageSource = std::function<Result<PageFill>(uint64_t page_index, uint8_t* out)>;

struct FaultStats {
  uint64_t faults = 0;             // fault events read
  uint64_t copies = 0;             // pages installed by UFFDIO_COPY on a fault
  uint64_t zero_pages = 0;         // pages installed by UFFDIO_ZEROPAGE (or a zero copy)
  uint64_t already_present = 0;    // EEXIST on a fault: woken only
  uint64_t eagain_retries = 0;
  uint64_t source_errors = 0;      // faults whose page the source could not give
  uint64_t poisoned = 0;           // pages poisoned after a source error
  uint64_t out_of_range = 0;       // fault addresses outside the region (ignored, counted)
  uint64_t target_exited = 0;      // faults left when the faulting process had exited (a killed VMM)
  uint64_t prefetched = 0;         // pages installed by prefetch()
  uint64_t prefetch_present = 0;   // prefetch() pages already there (faulted or prefetched before)
  uint64_t prefetch_errors = 0;    // prefetch() pages the source could not give (left to fault)
  uint64_t released = 0;           // pages released (hole punched)
  uint64_t fault_ns_total = 0;     // time from reading the event to the wake
  uint64_t fault_ns_max = 0;
};

struct FaultServerOptions {
  int poll_timeout_ms = 50;
  // Guest-RAM memfd, for release() (hole punch). Borrowed, not owned; -1:
  // release() uses madvise(MADV_REMOVE) on a local region.
  int memfd = -1;
  // userfaultfd features the fd was created with (adopt only: set by its
  // creator; register_region asks for what it needs itself).
  uint64_t features = 0;
  // Called once, on the server thread, on the first source error.
  std::function<void(const Error&)> on_failure;
  // Called after this server installed a page (UFFDIO_COPY or ZEROPAGE
  // succeeded), on the thread that installed it: from then on no other
  // install of that page can succeed (they get EEXIST), so the source may
  // forget its copy. Not called for a page someone else installed first.
  std::function<void(uint64_t page)> installed;
};

class FaultServer {
 public:
  enum class State { kCreated, kServing, kFailed, kStopped };

  // Creates a userfaultfd in this process and registers [base, base+len)
  // (page-aligned, in this address space) for missing faults.
  static Result<std::unique_ptr<FaultServer>> register_region(void* base, uint64_t len, PageSource source,
                                                              FaultServerOptions opt = {});
  // Takes a userfaultfd whose creator already did UFFDIO_API and registered
  // [base, base+len) of its own address space (the VMM).
  static Result<std::unique_ptr<FaultServer>> adopt(UniqueFd uffd, uint64_t base, uint64_t len, PageSource source,
                                                    FaultServerOptions opt = {});
  ~FaultServer();
  FaultServer(const FaultServer&) = delete;
  FaultServer& operator=(const FaultServer&) = delete;

  // kCreated -> kServing: starts the thread.
  Status start();
  // -> kStopped: ends the thread and closes the uffd, which unregisters the
  // region: threads blocked on a fault are woken and retry it with the
  // kernel's default handling (a hole reads as zeros). So stop() is for
  // teardown, and for tests that time out.
  void stop();

  // Installs pages before they fault: UFFDIO_COPY with DONTWAKE for each,
  // then one UFFDIO_WAKE over the span. Pages present already are counted
  // and skipped; a source error leaves the page to fault on demand. Returns
  // the number of pages installed.
  Result<uint64_t> prefetch(std::span<const uint64_t> pages);
  // Holds back every install (a fault's and prefetch()'s) until the lock
  // returned is released; one in progress finishes first, faults that
  // arrive meanwhile wait. An offload holds it from reading the page map
  // to the release: a fault read before the pause (a vCPU kicked out of it
  // leaves the event with this server) and installed after the page map
  // was read would erase the page's record (installed()) and then be
  // dropped by the release, its content lost. Nothing may touch a missing
  // page of the region while it is held (vCPUs paused, devices quiet).
  [[nodiscard]] std::unique_lock<std::mutex> hold_installs();
  // Drops pages so they are not resident and fault again: hole punch in the
  // memfd (FaultServerOptions::memfd), or MADV_REMOVE on a local region.
  // Callers make sure nothing touches them meanwhile (vCPUs paused).
  Status release(std::span<const uint64_t> pages);

  State state() const;
  FaultStats stats() const;
  // The first source error, if any (kFailed).
  std::string failure() const;
  uint64_t pages_count() const { return len_ / kPage; }
  bool zeropage_supported() const { return zeropage_; }
  bool poison_supported() const { return poison_; }

  static constexpr uint64_t kPage = 4096;

 private:
  FaultServer(UniqueFd uffd, uint64_t base, uint64_t len, PageSource source, FaultServerOptions opt, bool local);
  void run();
  void serve(uint64_t addr);
  // kGone: the registered process exited (ESRCH), nothing to serve.
  enum class Install { kCopied, kZeroed, kPresent, kSourceFailed, kFailed, kGone };
  // Gets the page from the source and installs it; wake=false leaves the
  // waiters for one UFFDIO_WAKE later. On kSourceFailed/kFailed *err says why.
  Install install(uint64_t page, bool wake, uint8_t* buf, Error* err);
  // One UFFDIO_* ioctl, EAGAIN retried; returns 0 or the errno.
  int uffd_ioctl(unsigned long req, void* arg);
  void wake(uint64_t first_page, uint64_t n_pages);
  void note_failure(uint64_t page, const Error& e);
  bool transition(State to);  // mu_ held

  UniqueFd uffd_;
  UniqueFd stop_event_;
  uint64_t base_;
  uint64_t len_;
  PageSource source_;
  FaultServerOptions opt_;
  bool local_;
  std::atomic<bool> zeropage_{true};  // set at registration, cleared by install()
  bool poison_ = false;
  std::thread thread_;
  std::array<uint8_t, kPage> fault_buf_{};  // the server thread's only
  // Held across one install (source, ioctl, installed()); hold_installs().
  std::mutex install_mu_;
  mutable std::mutex mu_;
  State state_ = State::kCreated;  // GUARDED_BY(mu_)
  FaultStats stats_;               // GUARDED_BY(mu_)
  std::string failure_;            // GUARDED_BY(mu_)
};

const char* to_string(FaultServer::State s);

}  // namespace sg::memory
