// The codec audit of process sandboxes' offloaded pages
// (wait-engine/memory/swap_audit.h), on real memory read with
// process_vm_readv: this test process plays the sandboxes' processes, each
// "sandbox" a mapping of its own at its own address. The first sandbox of a
// cohort is the reference; a sibling's pages that equal the reference at
// the same place cost a record prefix; only pages in swap after the
// page-out count; a page that cannot be read is counted apart; cohorts do
// not share references; the device's counters are read around each page-out.
#include <doctest/doctest.h>

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "wait-engine/memory/swap_audit.h"

using namespace sg;
using namespace sg::memory;

namespace {

constexpr size_t kP = kCodecPageSize;

// An anonymous mapping of n pages, unmapped at the end.
struct Area {
  uint8_t* p = nullptr;
  size_t pages = 0;
  explicit Area(size_t n) : pages(n) {
    void* m = ::mmap(nullptr, n * kP, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    REQUIRE(m != MAP_FAILED);
    p = static_cast<uint8_t*>(m);
  }
  ~Area() {
    if (p) ::munmap(p, pages * kP);
  }
  uint8_t* page(size_t i) { return p + i * kP; }
  runtime::SwapRun run() const { return {reinterpret_cast<uint64_t>(p), pages, "", 0, 0}; }
};

// Words in records, as an interpreter's heap holds them: compresses, but
// not to nothing.
void fill_text(uint8_t* page, uint32_t seed) {
  static const char* kWords[] = {"alpha", "beta", "gamma", "delta", "sandbox", "model", "token", "value", "key", "id"};
  std::mt19937 rng(seed);
  size_t at = 0;
  while (at < kP) {
    std::string rec = std::string("{\"") + kWords[rng() % 10] + "\":" + std::to_string(rng() % 100000) + ",\"" +
                      kWords[rng() % 10] + "\":\"" + kWords[rng() % 10] + "\"} ";
    size_t n = std::min(rec.size(), kP - at);
    std::memcpy(page + at, rec.data(), n);
    at += n;
  }
}

void fill_random(uint8_t* page, uint32_t seed) {
  std::mt19937 rng(seed);
  for (size_t i = 0; i < kP; ++i) page[i] = static_cast<uint8_t>(rng());
}

// One page-out of area as sandbox id of cohort: every page in swap after
// unless out says otherwise.
void page_out(SwapCodecAudit& a, const std::string& id, const std::string& cohort, const Area& area,
              std::vector<bool> out = {}) {
  if (out.empty()) out.assign(area.pages, true);
  a.begin(id, cohort);
  a.before(::getpid(), "python3#0", {area.run()});
  a.after(::getpid(), {out});
  a.end();
}

uint64_t kind(const std::array<uint64_t, kPageKindCount>& k, PageKind pk) { return k[static_cast<int>(pk)]; }

}  // namespace

TEST_CASE("a sibling's pages are encoded against the cohort's reference image at the same place") {
  SwapCodecAudit audit(SwapAuditConfig{});
  Area a(96), b(96);
  for (size_t i = 0; i < 80; ++i) fill_text(a.page(i), static_cast<uint32_t>(i));  // pages 80..95 stay zero
  std::memcpy(b.p, a.p, 96 * kP);
  b.page(3)[100] ^= 0x5a;         // a counter changed: a delta
  fill_random(b.page(7), 12345);  // new content: nothing to refer to
  REQUIRE(b.p != a.p);            // another address: the place, not the address, matches

  page_out(audit, "sbx-a", "template-1", a);
  SwapAuditTotals t = audit.totals();
  CHECK(t.page_outs == 1);
  CHECK(t.pages == 96);
  CHECK(t.reference_pages == 96);
  CHECK(kind(t.plain_kinds, PageKind::kZero) == 16);
  CHECK(t.cohort_bytes == t.plain_bytes);  // the reference itself has nothing to refer to
  CHECK(t.plain_bytes < 80 * kP);          // text compresses
  CHECK(t.plain_bytes > 80 * 100);
  uint64_t a_plain = t.plain_bytes;

  page_out(audit, "sbx-b", "template-1", b);
  t = audit.totals();
  CHECK(t.pages == 192);
  uint64_t b_plain = t.plain_bytes - a_plain, b_cohort = t.cohort_bytes - a_plain;
  CHECK(b_plain > a_plain);  // the random page
  // 93 pages as the reference (prefix only), one delta, one page that does not shrink.
  CHECK(kind(t.cohort_kinds, PageKind::kTemplateSame) >= 93);
  CHECK(kind(t.cohort_kinds, PageKind::kDelta) + kind(t.cohort_kinds, PageKind::kDeltaZstd) == 1);
  CHECK(b_cohort < 93 * kRecordPrefixSize + 200 + kMaxPageRecord);
  CHECK(b_cohort * 10 < b_plain);
  CHECK(t.reference_pages == 96);  // only the first sandbox of a cohort is kept
}

TEST_CASE("only the pages in swap after the page-out are counted; an unreadable page is counted apart") {
  SwapCodecAudit audit(SwapAuditConfig{});
  Area a(8);
  for (size_t i = 0; i < 8; ++i) fill_text(a.page(i), static_cast<uint32_t>(100 + i));
  // Page 5 goes away between the scan and the read (a process unmapping
  // its memory): it cannot be read.
  REQUIRE(::munmap(a.page(5), kP) == 0);
  page_out(audit, "sbx-a", "t", a, {true, false, true, false, true, true, true, true});
  SwapAuditTotals t = audit.totals();
  CHECK(t.pages == 5);  // 0, 2, 4, 6, 7
  CHECK(t.unread_pages == 1);
  uint64_t kinds = 0;
  for (uint64_t k : t.plain_kinds) kinds += k;
  CHECK(kinds == 5);
}

TEST_CASE("cohorts do not share reference images") {
  SwapCodecAudit audit(SwapAuditConfig{});
  Area a(16), b(16);
  for (size_t i = 0; i < 16; ++i) fill_text(a.page(i), static_cast<uint32_t>(7 * i));
  std::memcpy(b.p, a.p, 16 * kP);
  page_out(audit, "sbx-a", "template-1", a);
  page_out(audit, "sbx-b", "template-2", b);  // the same bytes, another template
  SwapAuditTotals t = audit.totals();
  CHECK(kind(t.cohort_kinds, PageKind::kTemplateSame) == 0);
  CHECK(t.cohort_bytes == t.plain_bytes);
  CHECK(t.reference_pages == 32);
}

TEST_CASE("the reference budget bounds the reference images") {
  SwapAuditConfig cfg;
  cfg.reference_budget = 4 * kP;
  SwapCodecAudit audit(cfg);
  Area a(10);
  for (size_t i = 0; i < 10; ++i) fill_text(a.page(i), static_cast<uint32_t>(i));
  page_out(audit, "sbx-a", "t", a);
  CHECK(audit.totals().reference_pages == 4);
}

TEST_CASE("the device's counters are read before and after each page-out, and the audit shows in /metrics") {
  uint64_t used = 1000, stored = 500;
  int reads = 0;
  SwapAuditConfig cfg;
  cfg.device_bytes = [&]() -> std::optional<std::pair<uint64_t, uint64_t>> {
    ++reads;
    return std::make_pair(used, stored);
  };
  SwapCodecAudit audit(cfg);
  Area a(4);
  for (size_t i = 0; i < 4; ++i) fill_text(a.page(i), static_cast<uint32_t>(i));
  audit.begin("sbx-a", "t");
  audit.before(::getpid(), "sh#0", {a.run()});
  used += 4 * kP;  // what the advice put into the device
  stored += 3000;
  audit.after(::getpid(), {{true, true, true, true}});
  audit.end();
  CHECK(reads == 2);
  SwapAuditTotals t = audit.totals();
  CHECK(t.device_used == 4 * static_cast<int64_t>(kP));
  CHECK(t.device_stored == 3000);
  std::string m;
  audit.render_metrics(m);
  CHECK(m.find("sandgate_swap_audit_pages_total 4\n") != std::string::npos);
  CHECK(m.find("sandgate_swap_audit_bytes{codec=\"device\"} 3000\n") != std::string::npos);
  CHECK(m.find("sandgate_swap_audit_bytes{codec=\"raw\"} 16384\n") != std::string::npos);
  CHECK(m.find("sandgate_swap_audit_pages_by_kind{codec=\"engine_plain\",kind=\"zstd\"}") != std::string::npos);
}
