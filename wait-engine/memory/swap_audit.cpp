// The engine's codecs on the pages process sandboxes offload (swap_audit.h).
#include "wait-engine/memory/swap_audit.h"

#include <sys/uio.h>

#include <cerrno>
#include <cstring>

#include "base/log.h"
#include "wait-engine/metrics/histogram.h"

namespace sg::memory {
namespace {

constexpr uint64_t kPage = kCodecPageSize;
constexpr uint64_t kReadPages = 256;  // one process_vm_readv: 1 MiB

uint64_t fnv1a(uint64_t h, std::string_view s) {
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return (h ^ 0xff) * 0x100000001b3ull;  // a separator, so ("ab","c") != ("a","bc")
}

uint64_t mix(uint64_t x) {  // splitmix64's finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Where a page sits, the same in every sibling that runs the same programs:
// (process, mapping name, mapping ordinal) and the page's offset in it.
uint64_t place_base(const std::string& process, const runtime::SwapRun& run) {
  uint64_t h = fnv1a(0xcbf29ce484222325ull, process);
  h = fnv1a(h, run.region);
  return fnv1a(h, std::to_string(run.region_index));
}
uint64_t place_key(uint64_t base, uint64_t page_in_region) { return mix(base + mix(page_in_region + 1)); }

bool all_zero(const uint8_t* p) {
  for (size_t i = 0; i < kPage; ++i)
    if (p[i]) return false;
  return true;
}

}  // namespace

SwapCodecAudit::SwapCodecAudit(SwapAuditConfig cfg) : cfg_(std::move(cfg)), buf_(kReadPages * kPage) {
  scratch_.reserve(kMaxPageRecord);
}

SwapCodecAudit::~SwapCodecAudit() = default;

void SwapCodecAudit::begin(const std::string& sandbox_id, const std::string& cohort) {
  held_ = std::unique_lock<std::mutex>(serial_);
  sandbox_ = sandbox_id;
  // A sandbox taken back after a restart has no known template: a cohort of its own.
  cohort_ = &cohorts_[cohort.empty() ? "sandbox:" + sandbox_id : cohort];
  capturing_ = false;
  if (cohort_->reference_sandbox.empty()) {
    cohort_->reference_sandbox = sandbox_id;
    capturing_ = true;
  }
  pending_.clear();
  device_before_ = cfg_.device_bytes ? cfg_.device_bytes() : std::nullopt;
}

void SwapCodecAudit::before(int pid, const std::string& process, const std::vector<runtime::SwapRun>& runs) {
  if (!cohort_ || !cc_.ok()) return;
  std::vector<std::vector<PageSizes>>& sizes = pending_[pid];
  sizes.clear();
  bool reference = cohort_->reference_sandbox == sandbox_;
  const Dictionary* dict = cohort_->dict ? &*cohort_->dict : nullptr;
  for (const runtime::SwapRun& run : runs) {
    std::vector<PageSizes>& s = sizes.emplace_back(run.pages);
    uint64_t base = place_base(process, run);
    for (uint64_t at = 0; at < run.pages;) {
      uint64_t n = std::min(kReadPages, run.pages - at);
      iovec local{buf_.data(), n * kPage};
      iovec remote{reinterpret_cast<void*>(run.start + at * kPage), n * kPage};
      ssize_t got = ::process_vm_readv(pid, &local, 1, &remote, 1, 0);
      uint64_t pages = got > 0 ? static_cast<uint64_t>(got) / kPage : 0;
      for (uint64_t i = 0; i < pages; ++i) {
        const uint8_t* page = buf_.data() + i * kPage;
        PageSizes& ps = s[at + i];
        uint64_t key = place_key(base, run.region_offset / kPage + at + i);
        scratch_.clear();
        EncodeResult plain = encode_page(cc_, page, EncodeOptions{nullptr, nullptr, cfg_.level}, scratch_);
        ps.plain = static_cast<uint16_t>(plain.bytes);
        ps.plain_kind = static_cast<uint8_t>(plain.kind);
        const uint8_t* tmpl = nullptr;
        if (!reference && cohort_->captured) {
          auto it = cohort_->index.find(key);
          if (it != cohort_->index.end())
            tmpl = reinterpret_cast<const uint8_t*>(cohort_->image.data()) + uint64_t{it->second} * kPage;
        }
        if (tmpl || dict) {
          scratch_.clear();
          EncodeResult c = encode_page(cc_, page, EncodeOptions{tmpl, dict, cfg_.level}, scratch_);
          ps.cohort = static_cast<uint16_t>(c.bytes);
          ps.cohort_kind = static_cast<uint8_t>(c.kind);
        } else {
          ps.cohort = ps.plain;
          ps.cohort_kind = ps.plain_kind;
        }
        if (capturing_ && reference_bytes_ + kPage <= cfg_.reference_budget && !cohort_->index.contains(key)) {
          cohort_->index.emplace(key, static_cast<uint32_t>(cohort_->image.size() / kPage));
          cohort_->image.append(reinterpret_cast<const char*>(page), kPage);
          reference_bytes_ += kPage;
        }
      }
      // A short read stops at the first page that cannot be read (unmapped
      // since the scan): skip that page.
      at += pages < n ? pages + 1 : n;
    }
  }
}

void SwapCodecAudit::after(int pid, const std::vector<std::vector<bool>>& in_swap) {
  auto it = pending_.find(pid);
  if (it == pending_.end()) return;
  SwapAuditTotals add;
  for (size_t r = 0; r < in_swap.size() && r < it->second.size(); ++r) {
    const std::vector<PageSizes>& s = it->second[r];
    for (size_t p = 0; p < in_swap[r].size() && p < s.size(); ++p) {
      if (!in_swap[r][p]) continue;
      if (s[p].plain == 0) {
        ++add.unread_pages;
        continue;
      }
      ++add.pages;
      add.plain_bytes += s[p].plain;
      add.cohort_bytes += s[p].cohort;
      ++add.plain_kinds[s[p].plain_kind % kPageKindCount];
      ++add.cohort_kinds[s[p].cohort_kind % kPageKindCount];
    }
  }
  pending_.erase(it);
  std::lock_guard<std::mutex> g(mu_);
  totals_.pages += add.pages;
  totals_.unread_pages += add.unread_pages;
  totals_.plain_bytes += add.plain_bytes;
  totals_.cohort_bytes += add.cohort_bytes;
  for (int k = 0; k < kPageKindCount; ++k) {
    totals_.plain_kinds[k] += add.plain_kinds[k];
    totals_.cohort_kinds[k] += add.cohort_kinds[k];
  }
}

void SwapCodecAudit::end() {
  if (!held_.owns_lock()) return;
  std::optional<std::pair<uint64_t, uint64_t>> device_after = cfg_.device_bytes ? cfg_.device_bytes() : std::nullopt;
  bool trained = false;
  if (capturing_ && cohort_) {
    cohort_->captured = true;
    // The cohort's dictionary, from its reference image (zero pages say
    // nothing): kept only when it saves on held-out pages.
    std::vector<const uint8_t*> pages;
    const uint8_t* img = reinterpret_cast<const uint8_t*>(cohort_->image.data());
    for (size_t i = 0; i < cohort_->image.size() / kPage; ++i)
      if (!all_zero(img + i * kPage)) pages.push_back(img + i * kPage);
    TrainOptions opt;
    opt.level = cfg_.level;
    TrainReport rep;
    Result<std::optional<Dictionary>> d = train_dictionary(pages, "swap-audit", opt, &rep);
    if (d && *d) {
      cohort_->dict = std::move(**d);
      trained = true;
    }
    LOG_INFO("swap codec audit: reference image of " << cohort_->image.size() / kPage << " pages from sandbox "
                                                     << sandbox_ << "; dictionary "
                                                     << (trained ? "kept" : "not kept: " + rep.reason));
  }
  {
    std::lock_guard<std::mutex> g(mu_);
    ++totals_.page_outs;
    if (device_before_ && device_after) {
      totals_.device_used += static_cast<int64_t>(device_after->first) - static_cast<int64_t>(device_before_->first);
      totals_.device_stored += static_cast<int64_t>(device_after->second) - static_cast<int64_t>(device_before_->second);
    }
    totals_.reference_pages = reference_bytes_ / kPage;
    if (trained) ++totals_.dictionaries;
  }
  pending_.clear();
  cohort_ = nullptr;
  capturing_ = false;
  held_.unlock();
}

SwapAuditTotals SwapCodecAudit::totals() const {
  std::lock_guard<std::mutex> g(mu_);
  return totals_;
}

void SwapCodecAudit::render_metrics(std::string& out) const {
  SwapAuditTotals t = totals();
  metrics::render_count(out, "sandgate_swap_audit_page_outs_total", "counter",
                        "Page-outs whose pages the codec audit read (--swap-codec-audit).", t.page_outs);
  metrics::render_count(out, "sandgate_swap_audit_pages_total", "counter",
                        "Pages the audit read before a page-out that were in swap after it.", t.pages);
  metrics::render_count(out, "sandgate_swap_audit_unread_pages_total", "counter",
                        "Pages that went out but could not be read first (not counted).", t.unread_pages);
  metrics::render_header(out, "sandgate_swap_audit_bytes", "counter",
                         "Those pages: raw, as the swap device stored them (its change over each page-out), and as "
                         "the engine's codecs would (plain; with the cohort's reference image and dictionary).");
  metrics::render_sample(out, "sandgate_swap_audit_bytes", "codec=\"raw\"", static_cast<double>(t.pages * kPage));
  metrics::render_sample(out, "sandgate_swap_audit_bytes", "codec=\"device_uncompressed\"",
                         static_cast<double>(t.device_used));
  metrics::render_sample(out, "sandgate_swap_audit_bytes", "codec=\"device\"", static_cast<double>(t.device_stored));
  metrics::render_sample(out, "sandgate_swap_audit_bytes", "codec=\"engine_plain\"", static_cast<double>(t.plain_bytes));
  metrics::render_sample(out, "sandgate_swap_audit_bytes", "codec=\"engine_cohort\"",
                         static_cast<double>(t.cohort_bytes));
  metrics::render_header(out, "sandgate_swap_audit_pages_by_kind", "counter",
                         "The audited pages by the record kind the engine's codecs chose.");
  for (int k = 1; k < kPageKindCount; ++k) {
    const char* name = page_kind_name(static_cast<PageKind>(k));
    metrics::render_sample(out, "sandgate_swap_audit_pages_by_kind",
                           std::string("codec=\"engine_plain\",kind=\"") + name + "\"",
                           static_cast<double>(t.plain_kinds[k]));
    metrics::render_sample(out, "sandgate_swap_audit_pages_by_kind",
                           std::string("codec=\"engine_cohort\",kind=\"") + name + "\"",
                           static_cast<double>(t.cohort_kinds[k]));
  }
  metrics::render_count(out, "sandgate_swap_audit_reference_pages", "gauge",
                        "Pages held as the cohorts' reference images.", t.reference_pages);
  metrics::render_count(out, "sandgate_swap_audit_dictionaries", "gauge",
                        "Cohort dictionaries trained on reference images and kept.", t.dictionaries);
}

}  // namespace sg::memory
