// Page codecs and cohort dictionaries (wait-engine/memory/page_codec.h,
// dictionary.h): every page kind round-trips and gets the expected codec,
// corrupt and truncated records are refused, a dictionary that does not pay
// is not published, dictionaries are reference-counted and per tenant.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "wait-engine/memory/dictionary.h"
#include "wait-engine/memory/page_codec.h"
#include "storage/store.h"
#include "tests/support/temp_dir.h"

using namespace sg;
using namespace sg::memory;

namespace {

constexpr size_t kP = kCodecPageSize;
using Page = std::vector<uint8_t>;

Page random_page(uint32_t seed) {
  std::mt19937 rng(seed);
  Page p(kP);
  for (auto& b : p) b = static_cast<uint8_t>(rng());
  return p;
}

// ASCII text from a small vocabulary in JSON-ish records: the kind of page
// an interpreter's heap or a log buffer holds, and that siblings share in
// content but not in layout.
Page text_page(uint32_t seed) {
  static const char* kWords[] = {"request", "tool_call", "sandbox", "template", "function", "arguments", "result",
                                 "status", "content", "assistant", "message", "python", "import", "return",
                                 "value", "error", "timeout", "stream", "tokens", "model", "gateway", "memory"};
  std::mt19937 rng(seed);
  std::string s;
  while (s.size() < kP) {
    s += "{\"";
    s += kWords[rng() % 22];
    s += "\": \"";
    for (int i = 0, n = 1 + static_cast<int>(rng() % 4); i < n; ++i) {
      s += kWords[rng() % 22];
      s += ' ';
    }
    s += "\", \"id\": " + std::to_string(rng() % 100000) + "},\n";
  }
  Page p(kP);
  std::memcpy(p.data(), s.data(), kP);
  return p;
}

Page runs_page(const std::vector<std::pair<uint8_t, size_t>>& runs) {
  Page p;
  for (auto [v, n] : runs) p.insert(p.end(), n, v);
  REQUIRE(p.size() == kP);
  return p;
}

// Changes `bytes` bytes in each of `blocks` 64-byte blocks, spread over the page.
Page near(const Page& t, int blocks, int bytes, uint32_t seed) {
  Page p = t;
  std::mt19937 rng(seed);
  for (int b = 0; b < blocks; ++b) {
    size_t blk = static_cast<size_t>(b) * (64 / blocks);
    for (int i = 0; i < bytes; ++i) p[blk * 64 + rng() % 64] ^= static_cast<uint8_t>(1 + rng() % 255);
  }
  return p;
}

// Pages of this process: its own binary's text and data, heap and stack,
// read through /proc/self/mem (the same path the benchmark takes for a
// sibling process). Only mappings that read back whole are used.
std::vector<Page> own_pages(size_t want) {
  std::vector<Page> out;
  std::ifstream maps("/proc/self/maps");
  int fd = ::open("/proc/self/mem", O_RDONLY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  std::string line;
  while (out.size() < want && std::getline(maps, line)) {
    std::istringstream ls(line);
    std::string range, perms;
    ls >> range >> perms;
    if (perms.size() < 1 || perms[0] != 'r' || line.find("[vvar]") != std::string::npos ||
        line.find("[vsyscall]") != std::string::npos)
      continue;
    uint64_t lo = std::stoull(range.substr(0, range.find('-')), nullptr, 16);
    uint64_t hi = std::stoull(range.substr(range.find('-') + 1), nullptr, 16);
    for (uint64_t a = lo; a < hi && out.size() < want; a += kP * 3) {
      Page p(kP);
      if (::pread(fd, p.data(), kP, static_cast<off_t>(a)) == static_cast<ssize_t>(kP)) out.push_back(std::move(p));
    }
  }
  ::close(fd);
  return out;
}

struct Encoded {
  std::string rec;
  EncodeResult r;
};

Encoded enc(CodecContext& cc, const Page& p, const Page* t = nullptr, const Dictionary* d = nullptr) {
  Encoded e;
  e.r = encode_page(cc, p.data(), EncodeOptions{t ? t->data() : nullptr, d, 3}, e.rec);
  return e;
}

// Decodes and checks the page comes back; returns the record's kind.
PageKind roundtrip(CodecContext& cc, const Page& p, const Page* t = nullptr, const Dictionary* d = nullptr) {
  Encoded e = enc(cc, p, t, d);
  CHECK(e.r.bytes == e.rec.size());
  CHECK(e.rec.size() <= kMaxPageRecord);
  Page out(kP, 0xee);
  Status s = decode_page(cc, e.rec, t ? t->data() : nullptr, d, out.data());
  CHECK_MESSAGE(s.ok(), (s.ok() ? "" : s.error().message()));
  CHECK(out == p);
  return e.r.kind;
}

std::vector<const uint8_t*> ptrs(const std::vector<Page>& v) {
  std::vector<const uint8_t*> o;
  for (const Page& p : v) o.push_back(p.data());
  return o;
}

Dictionary text_dictionary(uint32_t id = 7) {
  std::vector<Page> pages;
  for (uint32_t i = 0; i < 300; ++i) pages.push_back(text_page(1000 + i));
  TrainReport rep;
  TrainOptions opt;
  opt.dict_bytes = 16 * 1024;
  auto d = train_dictionary(ptrs(pages), "t", opt, &rep);
  REQUIRE(d.ok());
  REQUIRE_MESSAGE(d->has_value(), rep.reason);
  auto again = Dictionary::prepare(id, "t", (*d)->bytes(), 3);
  REQUIRE(again.ok());
  return *again;
}

}  // namespace

TEST_CASE("the chooser picks the expected kind and every kind round-trips") {
  CodecContext cc;
  REQUIRE(cc.ok());
  const Page rnd = random_page(1);
  const Page zero(kP, 0);
  const Page text = text_page(2);

  SUBCASE("without a template") {
    CHECK(roundtrip(cc, rnd) == PageKind::kRaw);
    CHECK(roundtrip(cc, zero) == PageKind::kZero);
    CHECK(roundtrip(cc, Page(kP, 0xab)) == PageKind::kRuns);
    CHECK(roundtrip(cc, runs_page({{1, 100}, {0, 3000}, {0xff, 996}})) == PageKind::kRuns);
    CHECK(roundtrip(cc, text) == PageKind::kZstd);
    Encoded e = enc(cc, Page(kP, 0xab));
    CHECK(e.rec.size() == kRecordPrefixSize + 3);
    CHECK(enc(cc, zero).rec.size() == kRecordPrefixSize);
    CHECK(enc(cc, text).rec.size() < kP / 2);
  }
  SUBCASE("a page of many short runs is not a runs page") {
    Page p(kP);
    for (size_t i = 0; i < kP; ++i) p[i] = static_cast<uint8_t>(i / 128);  // 32 runs
    CHECK(roundtrip(cc, p) == PageKind::kZstd);
  }
  SUBCASE("against a template") {
    CHECK(roundtrip(cc, rnd, &rnd) == PageKind::kTemplateSame);
    CHECK(enc(cc, rnd, &rnd).rec.size() == kRecordPrefixSize);
    CHECK(roundtrip(cc, text, &text) == PageKind::kTemplateSame);
    // Zero beats a delta against a non-zero template; same against a zero one.
    CHECK(roundtrip(cc, zero, &rnd) == PageKind::kZero);
    CHECK(roundtrip(cc, zero, &zero) == PageKind::kTemplateSame);
    // A few bytes in a few blocks: the XOR'd blocks compress to almost nothing.
    Page few = near(rnd, 2, 3, 5);
    CHECK(roundtrip(cc, few, &rnd) == PageKind::kDeltaZstd);
    CHECK(enc(cc, few, &rnd).rec.size() < 48);
    // One byte in one block: a raw delta (8 + 64) is near the zstd frame's size either way.
    Page one = near(rnd, 1, 1, 6);
    PageKind k1 = roundtrip(cc, one, &rnd);
    CHECK((k1 == PageKind::kDelta || k1 == PageKind::kDeltaZstd));
    CHECK(enc(cc, one, &rnd).rec.size() <= kRecordPrefixSize + 8 + 64);
    // Many blocks rewritten with random bytes: only the delta saves anything.
    Page many = rnd;
    Page other = random_page(9);
    std::memcpy(many.data(), other.data(), 40 * 64);
    CHECK(roundtrip(cc, many, &rnd) == PageKind::kDelta);
    CHECK(enc(cc, many, &rnd).rec.size() == kRecordPrefixSize + 8 + 40 * 64);
    // Many blocks with a few bytes each: still a delta, still small.
    Page spread = near(rnd, 32, 2, 7);
    CHECK(roundtrip(cc, spread, &rnd) == PageKind::kDeltaZstd);
    CHECK(enc(cc, spread, &rnd).rec.size() < 400);
    // Text against an unrelated template: zstd wins over the delta.
    CHECK(roundtrip(cc, text, &rnd) == PageKind::kZstd);
  }
  SUBCASE("with a cohort dictionary") {
    Dictionary d = text_dictionary();
    const Page fresh = text_page(99999);  // not in the training set
    CHECK(roundtrip(cc, fresh, nullptr, &d) == PageKind::kZstdDict);
    CHECK(enc(cc, fresh, nullptr, &d).rec.size() < enc(cc, fresh).rec.size());
    // Exact kinds still come first.
    CHECK(roundtrip(cc, zero, nullptr, &d) == PageKind::kZero);
    CHECK(roundtrip(cc, fresh, &fresh, &d) == PageKind::kTemplateSame);
    // Switching between dictionary and plain pages on one context.
    for (int i = 0; i < 3; ++i) {
      CHECK(roundtrip(cc, text, nullptr, nullptr) == PageKind::kZstd);
      CHECK(roundtrip(cc, text, nullptr, &d) == PageKind::kZstdDict);
    }
  }
  SUBCASE("pages of a real process") {
    std::vector<Page> pages = own_pages(300);
    REQUIRE(pages.size() >= 100);
    size_t total = 0, smaller = 0;
    for (size_t i = 0; i < pages.size(); ++i) {
      roundtrip(cc, pages[i]);
      Page t = near(pages[i], 3, 4, static_cast<uint32_t>(i));
      PageKind k = roundtrip(cc, pages[i], &t);
      CHECK(k != PageKind::kTemplateSame);
      roundtrip(cc, pages[i], &pages[(i + 1) % pages.size()]);
      Encoded e = enc(cc, pages[i]);
      total += e.rec.size();
      smaller += e.rec.size() < kP ? 1 : 0;
    }
    // Code, data and heap compress: most pages come out smaller than raw.
    CHECK(smaller * 2 > pages.size());
    CHECK(total < pages.size() * kP);
  }
  SUBCASE("a moved context keeps working") {
    CodecContext moved(std::move(cc));
    CHECK_FALSE(cc.ok());
    CHECK(roundtrip(moved, text) == PageKind::kZstd);
    CodecContext other;
    other = std::move(moved);
    CHECK(roundtrip(other, text) == PageKind::kZstd);
  }
}

TEST_CASE("corrupt and truncated records are refused, never decoded into garbage") {
  CodecContext cc;
  Dictionary d = text_dictionary(11);
  const Page rnd = random_page(3);
  const Page text = text_page(4);
  struct Case {
    const char* name;
    Page page;
    const Page* tmpl;
    const Dictionary* dict;
    PageKind kind;
  };
  std::vector<Case> cases = {
      {"raw", rnd, nullptr, nullptr, PageKind::kRaw},
      {"zero", Page(kP, 0), nullptr, nullptr, PageKind::kZero},
      {"runs", runs_page({{7, 4000}, {8, 96}}), nullptr, nullptr, PageKind::kRuns},
      {"template_same", rnd, &rnd, nullptr, PageKind::kTemplateSame},
      {"delta", [&] { Page p = rnd; Page o = random_page(8); std::memcpy(p.data() + 64, o.data(), 640); return p; }(),
       &rnd, nullptr, PageKind::kDelta},
      {"delta_zstd", near(rnd, 4, 2, 1), &rnd, nullptr, PageKind::kDeltaZstd},
      {"zstd", text, nullptr, nullptr, PageKind::kZstd},
      {"zstd_dict", text, nullptr, &d, PageKind::kZstdDict},
  };
  for (const Case& c : cases) {
    CAPTURE(c.name);
    Encoded e = enc(cc, c.page, c.tmpl, c.dict);
    REQUIRE(e.r.kind == c.kind);
    const uint8_t* t = c.tmpl ? c.tmpl->data() : nullptr;
    Page out(kP);
    REQUIRE(decode_page(cc, e.rec, t, c.dict, out.data()).ok());

    // Every truncation fails.
    for (size_t n = 0; n < e.rec.size(); ++n) {
      CAPTURE(n);
      CHECK_FALSE(decode_page(cc, std::string_view(e.rec).substr(0, n), t, c.dict, out.data()).ok());
    }
    // Extra bytes fail.
    CHECK_FALSE(decode_page(cc, e.rec + std::string(1, '\0'), t, c.dict, out.data()).ok());
    CHECK_FALSE(decode_page(cc, e.rec + e.rec, t, c.dict, out.data()).ok());
    // Every flipped byte (one in 37 for the raw page) fails or, where the
    // byte did not matter, decodes to the original page: never to another.
    size_t step = e.rec.size() > 1000 ? 37 : 1;
    for (size_t i = 0; i < e.rec.size(); i += step) {
      for (uint8_t x : {uint8_t{0x01}, uint8_t{0x80}, uint8_t{0xff}}) {
        std::string bad = e.rec;
        bad[i] = static_cast<char>(bad[i] ^ x);
        Status s = decode_page(cc, bad, t, c.dict, out.data());
        if (s.ok()) {
          CAPTURE(i);
          CHECK(out == c.page);
        }
      }
    }
    if (c.tmpl) {
      // A template kind without a template, or with another template.
      Status s = decode_page(cc, e.rec, nullptr, c.dict, out.data());
      REQUIRE_FALSE(s.ok());
      CHECK(s.error().message().find("without a template") != std::string::npos);
      Page wrong = random_page(77);
      Status w = decode_page(cc, e.rec, wrong.data(), c.dict, out.data());
      REQUIRE_FALSE(w.ok());
      CHECK(w.error().message().find("checksum mismatch") != std::string::npos);
    }
  }

  SUBCASE("unknown kinds") {
    for (int k : {0, 9, 100, 255}) {
      std::string rec(kRecordPrefixSize + kP, '\0');
      rec[0] = static_cast<char>(k);
      Page out(kP);
      Status s = decode_page(cc, rec, nullptr, nullptr, out.data());
      REQUIRE_FALSE(s.ok());
      CHECK(s.error().message().find("unknown kind") != std::string::npos);
      CHECK(record_kind(rec) == 0);
    }
  }
  SUBCASE("dictionary records need their own dictionary") {
    Encoded e = enc(cc, text, nullptr, &d);
    Page out(kP);
    Status none = decode_page(cc, e.rec, nullptr, nullptr, out.data());
    REQUIRE_FALSE(none.ok());
    CHECK(none.error().message().find("without a dictionary") != std::string::npos);
    Dictionary other = text_dictionary(12);
    Status wrong = decode_page(cc, e.rec, nullptr, &other, out.data());
    REQUIRE_FALSE(wrong.ok());
    CHECK(wrong.error().message().find("dictionary 11, given dictionary 12") != std::string::npos);
    // Same id, other content (a forged or mixed-up dictionary): zstd or the
    // page checksum refuses it.
    std::vector<Page> other_pages;
    for (uint32_t i = 0; i < 200; ++i) other_pages.push_back(text_page(50000 + i * 7));
    TrainOptions o;
    o.dict_bytes = 8 * 1024;
    auto od = train_dictionary(ptrs(other_pages), "t", o, nullptr);
    REQUIRE(od.ok());
    REQUIRE(od->has_value());
    auto forged = Dictionary::prepare(11, "t", (*od)->bytes(), 3);
    REQUIRE(forged.ok());
    CHECK_FALSE(decode_page(cc, e.rec, nullptr, &*forged, out.data()).ok());
  }
  SUBCASE("bad lengths inside payloads") {
    Page out(kP);
    auto rec = [](PageKind k, std::string payload) {
      std::string r(1, static_cast<char>(k));
      r += std::string(4, '\0');
      return r + payload;
    };
    // Runs summing short of, and past, a page; a zero-length run.
    CHECK_FALSE(decode_page(cc, rec(PageKind::kRuns, std::string("\x01\x00\x08", 3)), nullptr, nullptr, out.data()).ok());
    CHECK_FALSE(decode_page(cc, rec(PageKind::kRuns, std::string("\x01\x00\x10\x01\x01\x00", 6)), nullptr, nullptr,
                            out.data()).ok());
    CHECK_FALSE(decode_page(cc, rec(PageKind::kRuns, std::string("\x01\x00\x00\x01\x00\x10", 6)), nullptr, nullptr,
                            out.data()).ok());
    // A delta with an empty bitmap, or fewer blocks than its bitmap names.
    CHECK_FALSE(decode_page(cc, rec(PageKind::kDelta, std::string(8, '\0')), rnd.data(), nullptr, out.data()).ok());
    CHECK_FALSE(decode_page(cc, rec(PageKind::kDelta, std::string("\x03\0\0\0\0\0\0\0", 8) + std::string(64, 'a')),
                            rnd.data(), nullptr, out.data()).ok());
    // zstd payload that is not a frame; an empty one.
    CHECK_FALSE(decode_page(cc, rec(PageKind::kZstd, std::string(100, 'x')), nullptr, nullptr, out.data()).ok());
    CHECK_FALSE(decode_page(cc, rec(PageKind::kZstd, ""), nullptr, nullptr, out.data()).ok());
    // Template-same with a payload.
    CHECK_FALSE(decode_page(cc, rec(PageKind::kTemplateSame, "x"), rnd.data(), nullptr, out.data()).ok());
  }
}

TEST_CASE("a dictionary that does not pay is not published") {
  test::TempDir dir;
  auto store = storage::Store::open(dir.sub("s.db"));
  REQUIRE(store.ok());
  DictionaryRegistry reg(**store);
  CohortKey cohort{"tenant-a", "tpl", "group"};

  std::vector<Page> rnd;
  for (uint32_t i = 0; i < 300; ++i) rnd.push_back(random_page(500 + i));
  TrainReport rep;
  auto r = reg.train_and_maybe_publish(cohort, ptrs(rnd), TrainOptions{}, 100, &rep);
  REQUIRE(r.ok());
  CHECK_FALSE(r->has_value());
  CHECK_FALSE(rep.published);
  CHECK_FALSE(rep.reason.empty());
  auto none = reg.acquire(cohort);
  REQUIRE(none.ok());
  CHECK_FALSE(none->has_value());

  // Too few pages: not even trained.
  std::vector<Page> few;
  for (uint32_t i = 0; i < 10; ++i) few.push_back(text_page(i));
  auto f = reg.train_and_maybe_publish(cohort, ptrs(few), TrainOptions{}, 100, &rep);
  REQUIRE(f.ok());
  CHECK_FALSE(f->has_value());
  CHECK(rep.reason.find("too few") != std::string::npos);

  // A higher bar than what text saves: trained, evaluated, refused.
  std::vector<Page> text;
  for (uint32_t i = 0; i < 300; ++i) text.push_back(text_page(i));
  TrainOptions strict;
  strict.min_saving = 0.99;
  auto s = reg.train_and_maybe_publish(cohort, ptrs(text), strict, 100, &rep);
  REQUIRE(s.ok());
  CHECK_FALSE(s->has_value());
  CHECK(rep.eval_pages > 0);
  CHECK(rep.eval_dict_bytes > 0);
  CHECK(rep.reason.find("saves") != std::string::npos);
  auto still_none = reg.acquire(cohort);
  REQUIRE(still_none.ok());
  CHECK_FALSE(still_none->has_value());
}

TEST_CASE("published dictionaries are reference-counted, stored and per tenant") {
  test::TempDir dir;
  std::vector<Page> text;
  for (uint32_t i = 0; i < 400; ++i) text.push_back(text_page(i));
  CohortKey a{"tenant-a", "tpl", "group"};
  CohortKey b{"tenant-b", "tpl", "group"};
  CodecContext cc;
  std::string rec;
  uint32_t id = 0;
  {
    auto store = storage::Store::open(dir.sub("s.db"));
    REQUIRE(store.ok());
    DictionaryRegistry reg(**store);
    TrainReport rep;
    auto r = reg.train_and_maybe_publish(a, ptrs(text), TrainOptions{}, 100, &rep);
    REQUIRE(r.ok());
    REQUIRE_MESSAGE(r->has_value(), rep.reason);
    CHECK(rep.published);
    CHECK(rep.saved >= 0.05);
    id = (*r)->id();
    CHECK(id > 0);
    CHECK((*r)->tenant_id() == "tenant-a");
    auto row = (*store)->get_memory_dictionary("tenant-a", id);
    REQUIRE(row.ok());
    REQUIRE(row->has_value());
    CHECK((*row)->refcount == 1);
    CHECK((*row)->bytes == (*r)->bytes());
    CHECK((*row)->saved_ppm > 50000);
    CHECK((*row)->cohort_key == a.key());
    rec.clear();
    EncodeResult er = encode_page(cc, text_page(123456).data(), EncodeOptions{nullptr, &**r, 3}, rec);
    CHECK(er.kind == PageKind::kZstdDict);

    // Another tenant sees nothing of it, whatever it asks.
    auto ob = reg.acquire(b);
    REQUIRE(ob.ok());
    CHECK_FALSE(ob->has_value());
    auto fb = reg.find("tenant-b", id);
    REQUIRE(fb.ok());
    CHECK_FALSE(fb->has_value());
    auto rb = reg.release("tenant-b", id);
    REQUIRE_FALSE(rb.ok());
    CHECK(rb.error().kind() == ErrorKind::kNotFound);
    auto gb = (*store)->get_memory_dictionary("tenant-b", id);
    REQUIRE(gb.ok());
    CHECK_FALSE(gb->has_value());

    // A second reference, then a release back to one.
    auto acq = reg.acquire(a);
    REQUIRE(acq.ok());
    REQUIRE(acq->has_value());
    CHECK((*acq)->id() == id);
    auto left = reg.release("tenant-a", id);
    REQUIRE(left.ok());
    CHECK(*left == 1);
  }
  {
    // A fresh process: the dictionary comes back from SQLite and decodes
    // the record encoded before.
    auto store = storage::Store::open(dir.sub("s.db"));
    REQUIRE(store.ok());
    DictionaryRegistry reg(**store);
    CHECK(reg.cached() == 0);
    auto f = reg.find("tenant-a", id);
    REQUIRE(f.ok());
    REQUIRE(f->has_value());
    Page out(kP);
    Status s = decode_page(cc, rec, nullptr, &**f, out.data());
    CHECK(s.ok());
    CHECK(out == text_page(123456));
    CHECK(reg.cached() == 1);
    // The last reference goes: the row and the cache entry go with it.
    auto left = reg.release("tenant-a", id);
    REQUIRE(left.ok());
    CHECK(*left == 0);
    CHECK(reg.cached() == 0);
    auto gone = (*store)->get_memory_dictionary("tenant-a", id);
    REQUIRE(gone.ok());
    CHECK_FALSE(gone->has_value());
    auto again = reg.release("tenant-a", id);
    REQUIRE_FALSE(again.ok());
    CHECK(again.error().kind() == ErrorKind::kNotFound);
    auto acq = reg.acquire(a);
    REQUIRE(acq.ok());
    CHECK_FALSE(acq->has_value());

    // Ids are never reused: a new dictionary for the cohort gets another.
    auto r2 = reg.train_and_maybe_publish(a, ptrs(text), TrainOptions{}, 200, nullptr);
    REQUIRE(r2.ok());
    REQUIRE(r2->has_value());
    CHECK((*r2)->id() > id);
    // Tenant b publishes its own for the same template and group.
    auto rb = reg.train_and_maybe_publish(b, ptrs(text), TrainOptions{}, 200, nullptr);
    REQUIRE(rb.ok());
    REQUIRE(rb->has_value());
    auto ab = reg.acquire(b);
    REQUIRE(ab.ok());
    REQUIRE(ab->has_value());
    CHECK((*ab)->id() == (*rb)->id());
    CHECK((*ab)->tenant_id() == "tenant-b");
    auto aa = reg.acquire(a);
    REQUIRE(aa.ok());
    REQUIRE(aa->has_value());
    CHECK((*aa)->id() == (*r2)->id());
  }
}

TEST_CASE("cohort keys do not collide") {
  CHECK(CohortKey{"t", "a/1:b", ""}.key() != CohortKey{"t", "a", "b"}.key());
  CHECK(CohortKey{"t", "ab", ""}.key() != CohortKey{"t", "a", "b"}.key());
  CHECK(CohortKey{"t", "a", "b"}.key() == CohortKey{"u", "a", "b"}.key());  // the tenant is its own column
}
