// MemoryEngine (offload.h; design in docs/memory-offload.md).
#include "wait-engine/memory/offload.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <unordered_map>
#include <vector>

#include "wait-engine/memory/page_codec.h"
#include "wait-engine/metrics/histogram.h"
#include "base/log.h"
#include "base/sys.h"

namespace sg::memory {

namespace {

constexpr uint64_t kPage = 4096;
constexpr size_t kReadBatch = 256;               // pages per process_vm_readv
constexpr uint64_t kMaxGuestBytes = 64ull << 30;  // bounds the page-map read (128 MiB of entries)
constexpr uint64_t kPmPresent = 1ull << 63, kPmSwapped = 1ull << 62;

// True on the thread while it runs a prefetch: the source then does not
// count its pages as demand faults.
thread_local bool t_in_prefetch = false;

const uint32_t kZeroPageCrc = [] {
  static const uint8_t zero[kPage] = {};
  return page_crc32c(zero, kPage);
}();

// A deterministic scramble of n (reservoir sampling without a random source).
uint64_t spread(uint64_t n) {
  uint64_t h = n * 0x9E3779B97F4A7C15ull;
  return h ^ (h >> 29);
}

CodecContext& codec() {
  static thread_local CodecContext cc;
  return cc;
}

Result<std::vector<uint64_t>> read_pagemap(int pid, uint64_t base, uint64_t size) {
  std::string path = "/proc/" + std::to_string(pid) + "/pagemap";
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return sys::errno_error("open", path);
  std::vector<uint64_t> pm(size / kPage);
  size_t want = pm.size() * sizeof(uint64_t), got = 0;
  auto* p = reinterpret_cast<char*>(pm.data());
  off_t off = static_cast<off_t>(base / kPage * sizeof(uint64_t));
  while (got < want) {
    ssize_t n = ::pread(fd.get(), p + got, want - got, off + static_cast<off_t>(got));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return n == 0 ? Error(ErrorKind::kUnavailable, path + ": short read") : sys::errno_error("read", path);
    got += static_cast<size_t>(n);
  }
  return pm;
}

// Reads pages[0..n) of the VMM (page indices into the RAM at base) into buf.
Status read_pages(int pid, uint64_t base, const uint64_t* pages, size_t n, uint8_t* buf) {
  struct iovec local = {buf, n * kPage};
  std::vector<struct iovec> remote;
  remote.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    auto* addr = reinterpret_cast<uint8_t*>(base + pages[i] * kPage);
    if (!remote.empty() && static_cast<uint8_t*>(remote.back().iov_base) + remote.back().iov_len == addr)
      remote.back().iov_len += kPage;
    else
      remote.push_back({addr, kPage});
  }
  size_t done = 0, ri = 0, rdone = 0;
  while (done < n * kPage) {
    // Resume a partial transfer from where it stopped.
    std::vector<struct iovec> rest(remote.begin() + static_cast<long>(ri), remote.end());
    rest[0].iov_base = static_cast<uint8_t*>(rest[0].iov_base) + rdone;
    rest[0].iov_len -= rdone;
    struct iovec l = {static_cast<uint8_t*>(local.iov_base) + done, local.iov_len - done};
    ssize_t r = ::process_vm_readv(pid, &l, 1, rest.data(), std::min<size_t>(rest.size(), IOV_MAX), 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return r == 0 ? Error(ErrorKind::kUnavailable, "process_vm_readv: nothing read") : sys::errno_error("process_vm_readv", "guest RAM");
    done += static_cast<size_t>(r);
    size_t adv = static_cast<size_t>(r) + rdone;
    while (ri < remote.size() && adv >= remote[ri].iov_len) adv -= remote[ri++].iov_len;
    rdone = adv;
  }
  return Status::Ok();
}

}  // namespace

struct MemoryEngine::Sandbox {
  std::mutex op;  // one offload or prefetch at a time
  bool attached = false;
  std::string cohort;
  int pid = -1;
  uint64_t base = 0, size = 0;
  const uint8_t* tmpl = nullptr;  // the template memory file, mapped read-only
  uint64_t tmpl_size = 0;
  // Written under op; read without it by stats() and totals() (/metrics
  // must not wait for a running offload).
  std::atomic<uint32_t> rounds{0};    // offloads done
  std::atomic<bool> released{false};  // RAM out since the last offload, no prefetch yet
  std::vector<uint64_t> prefetched;  // by the last prefetch
  // Checksums of the pages the last prefetch installed (written by the
  // source on the prefetching thread, read by the next offload; both hold op).
  std::unordered_map<uint64_t, uint32_t> prefetch_crc;
  std::mutex trace_mu;
  std::vector<uint64_t> trace;       // GUARDED_BY(trace_mu): demand faults since the last prefetch
  std::atomic<bool> lost{false};
  CohortKey cohort_key;
  // The cohort dictionary this sandbox's records use (one reference held,
  // released by forget), fixed once taken so every record decodes with it.
  // Set under dict_mu (the fault server reads it while an offload trains).
  std::mutex dict_mu;
  std::optional<Dictionary> dict;  // GUARDED_BY(dict_mu)
  bool dict_tried = false;  // asked the registry / trained once (op held)
  bool gone = false;        // GUARDED_BY(dict_mu): forgotten (a late dictionary is given back)
  std::optional<Dictionary> dictionary() {
    std::lock_guard<std::mutex> g(dict_mu);
    return dict;
  }
  void set_dictionary(Dictionary d) {
    std::lock_guard<std::mutex> g(dict_mu);
    dict = std::move(d);
  }
  // Set once under op (and fs_mu); stats readers copy it under fs_mu only.
  std::mutex fs_mu;
  std::shared_ptr<FaultServer> fs;
  std::shared_ptr<FaultServer> fault_server() {
    std::lock_guard<std::mutex> g(fs_mu);
    return fs;
  }

  const uint8_t* template_page(uint64_t page) const {
    return tmpl && (page + 1) * kPage <= tmpl_size ? tmpl + page * kPage : nullptr;
  }
  ~Sandbox() {
    // The server thread uses tmpl (and this object): stop it first, even if
    // a stats reader still holds a copy of the pointer.
    if (fs) fs->stop();
    fs.reset();
    if (tmpl) ::munmap(const_cast<uint8_t*>(tmpl), tmpl_size);
  }
};

Result<std::unique_ptr<MemoryEngine>> MemoryEngine::open(MemoryEngineConfig cfg) {
  auto pool = Pool::open(cfg.pool);
  if (!pool) return pool.error().with_context("memory engine");
  return std::unique_ptr<MemoryEngine>(new MemoryEngine(std::move(cfg), std::move(*pool)));
}

MemoryEngine::MemoryEngine(MemoryEngineConfig cfg, std::unique_ptr<Pool> pool)
    : cfg_(std::move(cfg)), pool_(std::move(pool)), predictor_(cfg_.predictor) {
  if (cfg_.dictionaries) trainer_ = std::thread([this] { train_loop(); });
}

MemoryEngine::~MemoryEngine() {
  {
    std::lock_guard<std::mutex> g(train_mu_);
    train_stop_ = true;
  }
  train_cv_.notify_all();
  if (trainer_.joinable()) trainer_.join();
  std::lock_guard<std::mutex> g(mu_);
  sandboxes_.clear();
}

void MemoryEngine::train_loop() {
  for (;;) {
    TrainJob job;
    {
      std::unique_lock<std::mutex> l(train_mu_);
      train_cv_.wait(l, [&] { return train_stop_ || !train_queue_.empty(); });
      if (train_stop_) return;  // queued jobs are dropped: nothing was published for them
      job = std::move(train_queue_.front());
      train_queue_.pop_front();
    }
    Sandbox& s = *job.sandbox;
    std::vector<const uint8_t*> ptrs;
    for (const std::string& p : job.sample) ptrs.push_back(reinterpret_cast<const uint8_t*>(p.data()));
    TrainReport tr;
    trained_.fetch_add(1, std::memory_order_relaxed);
    Result<std::optional<Dictionary>> d =
        cfg_.dictionaries->train_and_maybe_publish(s.cohort_key, ptrs, cfg_.train, sys::unix_seconds(), &tr);
    if (!d) {
      LOG_WARN("sandbox " << job.id << ": dictionary training: " << d.error().message());
    } else if (!d->has_value()) {
      LOG_INFO("sandbox " << job.id << ": cohort dictionary not published: " << tr.reason);
    } else {
      uint32_t did = (*d)->id();
      published_.fetch_add(1, std::memory_order_relaxed);
      LOG_INFO("sandbox " << job.id << ": cohort dictionary " << did << " published: saves "
                          << static_cast<int>(tr.saved * 100) << "% on " << tr.eval_pages << " held-out pages");
      // The publisher's reference goes to the sandbox; one that is gone
      // meanwhile gives it back at once.
      bool kept = false;
      {
        std::lock_guard<std::mutex> g(s.dict_mu);
        if (!s.gone && !s.dict) {
          s.dict = std::move(**d);
          kept = true;
        }
      }
      if (!kept) (void)cfg_.dictionaries->release(s.cohort_key.tenant_id, did);
    }
    {
      std::lock_guard<std::mutex> g(train_mu_);
      ++trains_done_;
    }
    train_cv_.notify_all();
  }
}

void MemoryEngine::wait_for_training() {
  std::unique_lock<std::mutex> l(train_mu_);
  train_cv_.wait(l, [&] { return train_stop_ || trains_done_ == trains_queued_; });
}

std::shared_ptr<MemoryEngine::Sandbox> MemoryEngine::find(const std::string& id) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = sandboxes_.find(id);
  return it == sandboxes_.end() ? nullptr : it->second;
}

Status MemoryEngine::attach(Sandbox& s, const std::string& id, const OffloadTarget& t) {
  if (s.attached) {
    if (t.pid != s.pid || t.base != s.base || t.size != s.size)
      return invalid_error("sandbox " + id + ": guest RAM moved since its last offload");
    return Status::Ok();
  }
  if (t.pid <= 0 || t.size == 0 || t.base % kPage || t.size % kPage || t.size > kMaxGuestBytes)
    return invalid_error("sandbox " + id + ": guest RAM range unusable for offload");
  if (!t.template_memory.empty()) {
    UniqueFd fd(::open(t.template_memory.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) return sys::errno_error("open", t.template_memory);
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) return sys::errno_error("fstat", t.template_memory);
    if (st.st_size > 0) {
      void* p = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_SHARED, fd.get(), 0);
      if (p == MAP_FAILED) return sys::errno_error("mmap", t.template_memory);
      s.tmpl = static_cast<const uint8_t*>(p);
      s.tmpl_size = static_cast<uint64_t>(st.st_size) / kPage * kPage;
    }
  }
  s.cohort = t.cohort;
  s.cohort_key = t.cohort_key;
  s.pid = t.pid;
  s.base = t.base;
  s.size = t.size;
  s.attached = true;
  return Status::Ok();
}

// What one offload builds as it goes: its report, the prefetched pages
// found written, the records put (taken out again if it stops), and a
// dictionary training sample.
struct MemoryEngine::Pass {
  OffloadReport rep;
  std::vector<uint64_t> used;     // prefetched pages written since (their content changed)
  std::vector<uint64_t> put_now;  // taken out again if the offload stops
  std::vector<std::string> sample;
  size_t seen_for_sample = 0;
};

// Reads the pages from the VMM in batches and puts each into the pool
// encoded (pages equal to the template's, or zero where it has none, are
// dropped instead). kConflict when cancelled, kUnavailable on a read or
// pool failure.
Status MemoryEngine::encode_pages(const std::string& id, Sandbox& s, const std::vector<uint64_t>& pages,
                                  const Dictionary* dict, bool want_sample, Pass& p,
                                  const std::atomic<bool>& cancel) {
  std::vector<uint8_t> buf(kReadBatch * kPage);
  std::string rec;
  CodecContext& cc = codec();
  if (!cc.ok()) return Error(ErrorKind::kUnavailable, "zstd contexts could not be allocated");
  for (size_t at = 0; at < pages.size(); at += kReadBatch) {
    size_t n = std::min(kReadBatch, pages.size() - at);
    if (cancel.load(std::memory_order_acquire)) return Error(ErrorKind::kConflict, "offload cancelled");
    if (Status r = read_pages(s.pid, s.base, pages.data() + at, n, buf.data()); !r)
      return Error(ErrorKind::kUnavailable, r.error().message());
    for (size_t i = 0; i < n; ++i) {
      if (cancel.load(std::memory_order_acquire)) return Error(ErrorKind::kConflict, "offload cancelled");
      uint64_t page = pages[at + i];
      const uint8_t* data = buf.data() + i * kPage;
      if (!s.prefetch_crc.empty()) {
        auto pc = s.prefetch_crc.find(page);
        if (pc != s.prefetch_crc.end() && pc->second != page_crc32c(data, kPage)) p.used.push_back(page);
      }
      const uint8_t* tp = s.template_page(page);
      rec.clear();
      EncodeResult er = encode_page(cc, data, EncodeOptions{tp, dict, cfg_.zstd_level}, rec);
      ++p.rep.pages_read;
      bool base_equal = er.kind == PageKind::kTemplateSame || (!tp && er.kind == PageKind::kZero);
      if (base_equal) {
        pool_->erase(id, page);  // an older record, if any (a no-op otherwise)
        ++p.rep.pages_base;
        continue;
      }
      if (Status put = pool_->put(id, page, static_cast<uint8_t>(er.kind), rec); !put)
        return Error(ErrorKind::kUnavailable, put.error().message());
      if (want_sample && er.kind != PageKind::kZero && er.kind != PageKind::kRuns) {
        // Every page until the sample is full, then one in (seen / cap)
        // in place: an even spread over the offload, bounded memory.
        ++p.seen_for_sample;
        if (p.sample.size() < cfg_.train_sample_pages)
          p.sample.emplace_back(reinterpret_cast<const char*>(data), kPage);
        else if (size_t k = spread(p.seen_for_sample) % p.seen_for_sample; k < p.sample.size())
          p.sample[k].assign(reinterpret_cast<const char*>(data), kPage);
      }
      p.put_now.push_back(page);
      ++p.rep.pages_stored;
      p.rep.bytes_stored += rec.size();
    }
  }
  return Status::Ok();
}

// The last resume's outcome, for the predictor: a prefetched page counts
// as used when it faulted or when its content changed since it was
// installed. A page only read is not visible to a userfaultfd, so
// precision is a lower bound (docs/memory-offload.md).
void MemoryEngine::report_last_resume(const std::string& id, Sandbox& s, const std::vector<uint64_t>& used) {
  std::vector<uint64_t> trace;
  {
    std::lock_guard<std::mutex> g(s.trace_mu);
    trace.swap(s.trace);
  }
  std::vector<uint64_t> touched = trace;
  touched.insert(touched.end(), used.begin(), used.end());
  {
    std::lock_guard<std::mutex> g(pred_mu_);
    if (!s.prefetched.empty()) predictor_.report_outcome(id, s.prefetched, touched);
    predictor_.record_trace(id, s.cohort, s.rounds - 1, trace);
  }
  used_.fetch_add(used.size(), std::memory_order_relaxed);
  wasted_.fetch_add(s.prefetched.size() - std::min(s.prefetched.size(), used.size()), std::memory_order_relaxed);
  s.prefetched.clear();
  s.prefetch_crc.clear();
}

// Serves a sandbox's released guest RAM from now on: a fault server on the
// VMM's userfaultfd, pages from the pool (or the template, or zeros). A
// failure to serve is a lost sandbox (take_lost()).
Status MemoryEngine::serve_released(const std::string& id, const std::shared_ptr<Sandbox>& sp, UniqueFd uffd,
                                    uint64_t features) {
  // Raw pointers: the fault server that calls these is owned by the
  // Sandbox (a shared_ptr here would be a cycle) and stopped before it.
  Sandbox* raw = sp.get();
  Sandbox& s = *sp;
  auto lost = [this, id, raw](const std::string& why) {
    if (raw->lost.exchange(true)) return;
    lost_.fetch_add(1, std::memory_order_relaxed);
    LOG_ERROR("sandbox " << id << ": guest memory lost: " << why);
    {
      std::lock_guard<std::mutex> g(lost_mu_);
      lost_list_.emplace_back(id, why);
    }
    if (cfg_.on_lost) cfg_.on_lost(id, why);
  };
  if (!uffd) {
    lost("the VMM released guest RAM without handing over its userfaultfd");
    return internal_error("sandbox " + id + ": no userfaultfd from the VMM");
  }
  PageSource src = [this, id, raw](uint64_t page, uint8_t* out) -> Result<PageFill> {
    if (!t_in_prefetch) {
      std::lock_guard<std::mutex> g(raw->trace_mu);
      if (raw->trace.size() < cfg_.predictor.max_trace_pages) raw->trace.push_back(page);
    }
    Result<Record> r = pool_->get(id, page);
    const uint8_t* tp = raw->template_page(page);
    if (!r) {
      if (r.error().kind() != ErrorKind::kNotFound) return r.error();
      if (t_in_prefetch) raw->prefetch_crc[page] = tp ? page_crc32c(tp, kPage) : kZeroPageCrc;
      if (!tp) return PageFill::kZero;
      std::memcpy(out, tp, kPage);
      return PageFill::kData;
    }
    std::optional<Dictionary> dict = record_kind(r->payload) == static_cast<uint8_t>(PageKind::kZstdDict)
                                         ? raw->dictionary()
                                         : std::nullopt;
    if (Status d = decode_page(codec(), r->payload, tp, dict ? &*dict : nullptr, out); !d)
      return d.error().with_context("page " + std::to_string(page));
    if (t_in_prefetch) raw->prefetch_crc[page] = page_crc32c(out, kPage);
    // The record stays until the page is installed (fo.installed): the
    // fault thread and a prefetch may both be here for one page, and
    // the one that finds no record would install the template's page
    // (or zeros) instead, if it won the UFFDIO_COPY.
    return PageFill::kData;
  };
  FaultServerOptions fo;
  fo.features = features;
  fo.on_failure = [lost](const Error& e) { lost(e.message()); };
  // Resident from now on: the pool's copy would only cost memory.
  fo.installed = [this, id](uint64_t page) { pool_->erase(id, page); };
  auto fs = FaultServer::adopt(std::move(uffd), s.base, s.size, std::move(src), std::move(fo));
  if (fs) {
    if (Status st = (*fs)->start(); !st) fs = st.error();
  }
  if (!fs) {
    lost(fs.error().message());
    return internal_error("sandbox " + id + ": guest RAM released but not served: " + fs.error().message());
  }
  std::lock_guard<std::mutex> g(s.fs_mu);
  s.fs = std::move(*fs);
  return Status::Ok();
}

Result<OffloadReport> MemoryEngine::offload(const std::string& id, const OffloadTarget& t,
                                            const std::atomic<bool>& cancel) {
  uint64_t t0 = sys::monotonic_ns();
  std::shared_ptr<Sandbox> sp;
  {
    std::lock_guard<std::mutex> g(mu_);
    std::shared_ptr<Sandbox>& e = sandboxes_[id];
    if (!e) e = std::make_shared<Sandbox>();
    sp = e;
  }
  Sandbox& s = *sp;
  std::lock_guard<std::mutex> op(s.op);
  if (s.lost) return internal_error("sandbox " + id + ": its memory is lost");
  if (Status a = attach(s, id, t); !a) {
    failed_.fetch_add(1, std::memory_order_relaxed);
    return a.error();
  }
  // From the page map to the release no page may be installed: a fault
  // the server read before the pause and served after the page map was
  // read would erase the page's record, then the release would drop it.
  std::unique_lock<std::mutex> hold;
  if (s.fs) hold = s.fs->hold_installs();
  auto pm = read_pagemap(s.pid, s.base, s.size);
  if (!pm) {
    failed_.fetch_add(1, std::memory_order_relaxed);
    return Error(ErrorKind::kUnavailable, pm.error().message());
  }
  const uint64_t npages = s.size / kPage;
  // Which pages to read: resident ones; on a first offload of memfd RAM,
  // all (a shared mapping's page map misses pages it never mapped).
  bool all = t.backing == "memfd" && !s.fs;
  std::vector<uint64_t> pages;
  for (uint64_t i = 0; i < npages; ++i)
    if (all || ((*pm)[i] & (kPmPresent | kPmSwapped))) pages.push_back(i);

  Pass pass;
  OffloadReport& rep = pass.rep;
  auto abandon = [&](Error e) -> Result<OffloadReport> {
    for (uint64_t p : pass.put_now) pool_->erase(id, p);
    (e.kind() == ErrorKind::kConflict ? cancelled_ : failed_).fetch_add(1, std::memory_order_relaxed);
    return e;
  };
  // The cohort's dictionary, if it has one, from this sandbox's first
  // offload on (a later one would leave records that need two).
  bool use_dicts = cfg_.dictionaries && !s.cohort_key.tenant_id.empty();
  std::optional<Dictionary> held = s.dictionary();
  if (use_dicts && !held && !s.dict_tried && s.rounds == 0) {
    Result<std::optional<Dictionary>> d = cfg_.dictionaries->acquire(s.cohort_key);
    if (d && d->has_value()) {
      s.set_dictionary(**d);
      held = std::move(*d);
    }
    if (!d) LOG_WARN("sandbox " << id << ": cohort dictionary: " << d.error().message());
  }
  const Dictionary* dict = held ? &*held : nullptr;
  rep.dictionary = dict ? dict->id() : 0;
  // Training sample: pages that neither equal the template nor are zero.
  bool want_sample = use_dicts && !held && !s.dict_tried;
  if (Status e = encode_pages(id, s, pages, dict, want_sample, pass, cancel); !e) return abandon(e.error());
  if (cancel.load(std::memory_order_acquire)) return abandon(Error(ErrorKind::kConflict, "offload cancelled"));
  if (s.rounds > 0) report_last_resume(id, s, pass.used);
  auto rel = t.release();
  if (!rel) return abandon(Error(ErrorKind::kUnavailable, rel.error().message()));
  if (!s.fs)
    if (Status st = serve_released(id, sp, std::move(rel->first), rel->second); !st) return st.error();
  s.released = true;
  if (hold) hold.unlock();
  ++s.rounds;
  if (want_sample && pass.sample.size() >= cfg_.train.min_train_pages) {
    // Training costs seconds of CPU: the trainer thread does it, so this
    // offload (and the resume a response may be waiting for) ends now. The
    // dictionary applies from the sandbox's next offload on.
    s.dict_tried = true;
    rep.trained = true;
    std::lock_guard<std::mutex> g(train_mu_);
    train_queue_.push_back(TrainJob{id, sp, std::move(pass.sample)});
    ++trains_queued_;
    train_cv_.notify_all();
  }
  rep.pool_bytes = pool_->stats(id).memory_bytes();
  rep.ns = sys::monotonic_ns() - t0;
  offloads_.fetch_add(1, std::memory_order_relaxed);
  pages_read_.fetch_add(rep.pages_read, std::memory_order_relaxed);
  pages_stored_.fetch_add(rep.pages_stored, std::memory_order_relaxed);
  pages_base_.fetch_add(rep.pages_base, std::memory_order_relaxed);
  bytes_stored_.fetch_add(rep.bytes_stored, std::memory_order_relaxed);
  offload_ns_.fetch_add(rep.ns, std::memory_order_relaxed);
  return rep;
}

Result<uint64_t> MemoryEngine::prefetch(const std::string& id) {
  std::shared_ptr<Sandbox> sp = find(id);
  if (!sp) return uint64_t{0};
  Sandbox& s = *sp;
  std::lock_guard<std::mutex> op(s.op);
  if (!s.released || !s.fs) return uint64_t{0};
  std::vector<uint64_t> pages;
  {
    std::lock_guard<std::mutex> g(pred_mu_);
    pages = predictor_.predict(id, s.cohort, s.rounds - 1, cfg_.prefetch_pages);
    predictor_.begin_restore(id);
  }
  const uint64_t npages = s.size / kPage;
  pages.erase(std::remove_if(pages.begin(), pages.end(), [&](uint64_t p) { return p >= npages; }), pages.end());
  Result<uint64_t> n = uint64_t{0};
  if (!pages.empty()) {
    t_in_prefetch = true;
    n = s.fs->prefetch(pages);
    t_in_prefetch = false;
  }
  {
    std::lock_guard<std::mutex> g(s.trace_mu);
    s.trace.clear();
  }
  s.prefetched = std::move(pages);
  s.released = false;
  return n;
}

Result<std::string> MemoryEngine::offload(const std::string& id, const lifecycle::OffloadRequest& r,
                                          const std::atomic<bool>& cancel) {
  OffloadTarget t;
  t.cohort = r.tenant_id + "/" + r.template_id;
  t.cohort_key = CohortKey{r.tenant_id, r.template_id, ""};
  t.pid = r.memory.pid;
  t.base = r.memory.base;
  t.size = r.memory.size;
  t.backing = r.memory.backing;
  t.template_memory = r.memory.template_memory;
  t.release = [release = r.release]() -> Result<std::pair<UniqueFd, uint64_t>> {
    Result<runtime::GuestMemoryRelease> got = release();
    if (!got) return got.error();
    return std::make_pair(std::move(got->uffd), got->features);
  };
  Result<OffloadReport> rep = offload(id, t, cancel);
  if (!rep) return rep.error();
  return "offloaded " + std::to_string(rep->pages_read) + " resident pages in " + std::to_string(rep->ns / 1000000) +
         " ms: " + std::to_string(rep->pages_stored) + " stored (" + std::to_string(rep->bytes_stored) + " bytes), " +
         std::to_string(rep->pages_base) + " equal to the template";
}

std::vector<std::pair<std::string, std::string>> MemoryEngine::take_lost() {
  std::lock_guard<std::mutex> g(lost_mu_);
  std::vector<std::pair<std::string, std::string>> out;
  out.swap(lost_list_);
  return out;
}

void MemoryEngine::forget(const std::string& id) {
  std::shared_ptr<Sandbox> sp;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = sandboxes_.find(id);
    if (it == sandboxes_.end()) return;
    sp = std::move(it->second);
    sandboxes_.erase(it);
  }
  {
    std::lock_guard<std::mutex> op(sp->op);
    if (std::shared_ptr<FaultServer> fs = sp->fault_server()) {
      FaultStats f = fs->stats();
      faults_retired_.fetch_add(f.faults, std::memory_order_relaxed);
      prefetched_retired_.fetch_add(f.prefetched, std::memory_order_relaxed);
      fs->stop();
    }
  }
  pool_->drop(id);
  {
    std::lock_guard<std::mutex> g(sp->dict_mu);
    sp->gone = true;
  }
  if (std::optional<Dictionary> d = sp->dictionary(); d && cfg_.dictionaries) {
    Result<int64_t> left = cfg_.dictionaries->release(sp->cohort_key.tenant_id, d->id());
    if (!left) LOG_WARN("sandbox " << id << ": release of dictionary " << d->id() << ": " << left.error().message());
  }
  std::lock_guard<std::mutex> g(pred_mu_);
  predictor_.forget(id);
}

std::optional<SandboxMemoryStats> MemoryEngine::stats(const std::string& id) {
  std::shared_ptr<Sandbox> sp = find(id);
  if (!sp) return std::nullopt;
  SandboxMemoryStats st;
  st.pool = pool_->stats(id);
  if (std::shared_ptr<FaultServer> fs = sp->fault_server()) st.faults = fs->stats();
  st.offloads = sp->rounds.load();
  st.released = sp->released.load();
  std::lock_guard<std::mutex> g(pred_mu_);
  st.prefetch = predictor_.stats(id);
  return st;
}

uint64_t MemoryEngine::pool_bytes(const std::string& id) const { return pool_->stats(id).memory_bytes(); }

MemoryEngineTotals MemoryEngine::totals() {
  MemoryEngineTotals t;
  t.offloads = offloads_.load();
  t.offloads_cancelled = cancelled_.load();
  t.offloads_failed = failed_.load();
  t.pages_read = pages_read_.load();
  t.pages_stored = pages_stored_.load();
  t.pages_base = pages_base_.load();
  t.bytes_stored = bytes_stored_.load();
  t.prefetch_used = used_.load();
  t.prefetch_wasted = wasted_.load();
  t.lost = lost_.load();
  t.offload_ns = offload_ns_.load();
  t.dictionaries_trained = trained_.load();
  t.dictionaries_published = published_.load();
  t.faults = faults_retired_.load();
  t.prefetched = prefetched_retired_.load();
  std::vector<std::shared_ptr<Sandbox>> all;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (auto& [id, s] : sandboxes_) all.push_back(s);
  }
  for (auto& s : all) {
    std::shared_ptr<FaultServer> fs = s->fault_server();
    if (!fs) continue;
    FaultStats f = fs->stats();
    t.faults += f.faults;
    t.prefetched += f.prefetched;
  }
  t.pool = pool_->totals();
  return t;
}

void MemoryEngine::render_metrics(std::string& out) {
  MemoryEngineTotals t = totals();
  auto counter = [&](const char* name, const char* help, uint64_t v) {
    metrics::render_count(out, name, "counter", help, v);
  };
  auto gauge = [&](const char* name, const char* help, uint64_t v) { metrics::render_count(out, name, "gauge", help, v); };
  counter("sandgate_memory_offloads_total", "Guest-RAM offloads completed.", t.offloads);
  counter("sandgate_memory_offloads_cancelled_total", "Offloads stopped by a response or other traffic.",
          t.offloads_cancelled);
  counter("sandgate_memory_offloads_failed_total", "Offloads refused (pool, VMM); the sandbox stayed whole.",
          t.offloads_failed);
  counter("sandgate_memory_pages_read_total", "Guest pages read and encoded by offloads.", t.pages_read);
  counter("sandgate_memory_pages_stored_total", "Guest pages put into the pool.", t.pages_stored);
  counter("sandgate_memory_pages_template_total", "Guest pages equal to their template page (nothing stored).",
          t.pages_base);
  counter("sandgate_memory_stored_bytes_total", "Encoded bytes put into the pool.", t.bytes_stored);
  counter("sandgate_memory_faults_total", "Userfaultfd faults served on demand.", t.faults);
  counter("sandgate_memory_prefetched_pages_total", "Pages installed before a resume.", t.prefetched);
  counter("sandgate_memory_prefetch_used_total", "Prefetched pages written before the next offload.",
          t.prefetch_used);
  counter("sandgate_memory_prefetch_wasted_total", "Prefetched pages not written before the next offload.",
          t.prefetch_wasted);
  counter("sandgate_memory_lost_total", "Sandboxes whose memory could not be restored.", t.lost);
  counter("sandgate_memory_dictionaries_trained_total", "Cohort dictionaries trained.", t.dictionaries_trained);
  counter("sandgate_memory_dictionaries_published_total", "Cohort dictionaries that paid and were published.",
          t.dictionaries_published);
  metrics::render_header(out, "sandgate_memory_offload_seconds_total", "counter", "Time spent offloading.");
  metrics::render_sample(out, "sandgate_memory_offload_seconds_total", "", static_cast<double>(t.offload_ns) / 1e9);
  gauge("sandgate_memory_pool_bytes", "Host RAM the pool uses (records and metadata).", t.pool.bytes.memory_bytes());
  gauge("sandgate_memory_pool_file_bytes", "Bytes of the pool's file tier.", t.pool.bytes.file_bytes);
  gauge("sandgate_memory_pool_records", "Records in the pool.", t.pool.bytes.records);
  counter("sandgate_memory_pool_read_errors_total", "Corrupt or unreadable pool records.", t.pool.read_errors);
}

}  // namespace sg::memory
