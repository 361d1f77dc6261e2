// The compressed-page pool: records and CRC32C, the memory tier and its
// budget, the liburing file tier (and its pread/pwrite fallback), recovery
// and corruption (docs/memory-pool.md).
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <random>
#include <thread>
#include <string>
#include <vector>

#include "wait-engine/memory/pool.h"
#include "wait-engine/memory/record.h"
#include "tests/support/temp_dir.h"

using namespace sg::memory;

namespace {

std::string payload_for(uint64_t page, size_t len) {
  std::string s(len, '\0');
  std::mt19937_64 rng(page * 7919 + len);
  for (auto& c : s) c = static_cast<char>(rng());
  return s;
}

PoolConfig pool_config(uint64_t budget, const std::string& dir, bool recover = false, bool uring = true) {
  PoolConfig c;
  c.memory_budget = budget;
  c.dir = dir;
  c.recover = recover;
  c.use_io_uring = uring;
  return c;
}

std::unique_ptr<Pool> open_pool(const std::string& dir, uint64_t budget, bool uring = true, bool recover = false) {
  auto p = Pool::open(pool_config(budget, dir, recover, uring));
  REQUIRE_MESSAGE(p.ok(), (p.ok() ? "" : p.error().message()));
  return std::move(p).value();
}

off_t file_size(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? st.st_size : -1;
}

void patch_byte(const std::string& path, off_t off, uint8_t xor_mask) {
  int fd = ::open(path.c_str(), O_RDWR);
  REQUIRE(fd >= 0);
  uint8_t b = 0;
  REQUIRE(::pread(fd, &b, 1, off) == 1);
  b ^= xor_mask;
  REQUIRE(::pwrite(fd, &b, 1, off) == 1);
  ::close(fd);
}

}  // namespace

TEST_CASE("crc32c: known vectors, hardware and portable paths agree") {
  CHECK(crc32c("123456789") == 0xE3069283u);
  CHECK(crc32c("") == 0u);
  // RFC 3720 (iSCSI) B.4.
  std::string zeros(32, '\0'), ones(32, '\xff'), inc(32, '\0'), dec(32, '\0');
  for (int i = 0; i < 32; ++i) inc[i] = static_cast<char>(i), dec[i] = static_cast<char>(31 - i);
  CHECK(crc32c(zeros) == 0x8A9136AAu);
  CHECK(crc32c(ones) == 0x62A8AB43u);
  CHECK(crc32c(inc) == 0x46DD794Eu);
  CHECK(crc32c(dec) == 0x113FDB5Cu);
  std::string big = payload_for(1, 4096 + 13);
  uint32_t portable = detail::crc32c_portable(0, big.data(), big.size());
  uint32_t hw = 0;
  if (detail::crc32c_hardware(0, big.data(), big.size(), &hw)) CHECK(hw == portable);
  else MESSAGE("no SSE4.2 here: only the portable CRC32C is tested");
  // Extending in pieces equals one pass, at every split.
  for (size_t cut : {0ul, 1ul, 7ul, 8ul, 9ul, 100ul, 4096ul})
    CHECK(crc32c_extend(crc32c_extend(0, big.data(), cut), big.data() + cut, big.size() - cut) == portable);
  CHECK(detail::crc32c_portable(0, "123456789", 9) == 0xE3069283u);
}

TEST_CASE("records: round trip, and every check names what failed") {
  std::string rec;
  append_record(&rec, 42, 3, "hello page");
  REQUIRE(rec.size() == kRecordHeaderSize + 10);
  auto r = decode_record(rec, 42, "t");
  REQUIRE(r.ok());
  CHECK(r->page_index == 42);
  CHECK(r->kind == 3);
  CHECK(r->payload == "hello page");

  auto fails_with = [](const std::string& bytes, uint64_t page, const char* needle) {
    auto d = decode_record(bytes, page, "t");
    REQUIRE_FALSE(d.ok());
    CHECK_MESSAGE(d.error().message().find(needle) != std::string::npos, d.error().message());
  };
  fails_with(rec, 43, "page index 42, expected 43");
  std::string bad = rec;
  bad[0] ^= 1;
  fails_with(bad, 42, "bad magic");
  bad = rec;
  bad[4] = 9;
  fails_with(bad, 42, "unsupported version");
  bad = rec;
  bad[kRecordHeaderSize + 3] ^= 0x40;
  fails_with(bad, 42, "checksum mismatch");
  bad = rec;
  bad[6] ^= 1;  // kind is covered by the CRC
  fails_with(bad, 42, "checksum mismatch");
  fails_with(rec.substr(0, rec.size() - 1), 42, "truncated");
  fails_with(rec.substr(0, 10), 42, "truncated header");
  fails_with(rec + "x", 42, "trailing bytes");
  bad = rec;
  bad[18] = 0x7f;  // payload length ~8 MiB
  fails_with(bad, 42, "over limit");
  // The bound itself is accepted.
  std::string maxrec;
  append_record(&maxrec, 1, 0, std::string(kMaxRecordPayload, 'x'));
  CHECK(decode_record(maxrec, 1, "t").ok());
}

TEST_CASE("pool: memory tier round trips and accounting") {
  sg::test::TempDir td;
  auto pool = open_pool(td.path(), 64 << 20);
  for (uint64_t p = 0; p < 100; ++p) REQUIRE(pool->put("sb-a", p, uint8_t(p % 5), payload_for(p, 100 + p)).ok());
  REQUIRE(pool->put("sb-b", 7, 1, "other sandbox").ok());
  for (uint64_t p = 0; p < 100; ++p) {
    auto r = pool->get("sb-a", p);
    REQUIRE(r.ok());
    CHECK(r->kind == p % 5);
    CHECK(r->payload == payload_for(p, 100 + p));
  }
  CHECK(pool->get("sb-b", 7)->payload == "other sandbox");
  auto nf = pool->get("sb-b", 8);
  REQUIRE_FALSE(nf.ok());
  CHECK(nf.error().kind() == sg::ErrorKind::kNotFound);
  CHECK(pool->get("nobody", 0).error().kind() == sg::ErrorKind::kNotFound);

  PoolStats a = pool->stats("sb-a");
  uint64_t payload = 0;
  for (uint64_t p = 0; p < 100; ++p) payload += 100 + p;
  CHECK(a.records == 100);
  CHECK(a.memory_records == 100);
  CHECK(a.file_records == 0);
  CHECK(a.payload_bytes == payload);
  CHECK(a.memory_record_bytes >= payload + 100 * kRecordHeaderSize);
  CHECK(a.metadata_bytes == 100 * Pool::memory_entry_overhead() + Pool::sandbox_overhead() + std::string("sb-a").capacity());
  CHECK(a.file_bytes == 0);
  PoolTotals t = pool->totals();
  CHECK(t.sandboxes == 2);
  CHECK(t.bytes.records == 101);
  CHECK(t.bytes.memory_bytes() == a.memory_bytes() + pool->stats("sb-b").memory_bytes());

  // Replacing a page keeps one record and the newest payload.
  REQUIRE(pool->put("sb-a", 5, 9, "replaced").ok());
  CHECK(pool->stats("sb-a").records == 100);
  CHECK(pool->get("sb-a", 5)->payload == "replaced");
  CHECK(pool->stats("sb-a").payload_bytes == payload - 105 + 8);

  // Too large a payload is refused and stores nothing.
  auto big = pool->put("sb-a", 500, 0, std::string(kMaxRecordPayload + 1, 'x'));
  CHECK_FALSE(big.ok());
  CHECK_FALSE(pool->contains("sb-a", 500));

  pool->erase("sb-a", 5);
  CHECK_FALSE(pool->contains("sb-a", 5));
  pool->drop("sb-a");
  CHECK(pool->stats("sb-a").records == 0);
  CHECK(pool->totals().bytes.memory_bytes() == pool->stats("sb-b").memory_bytes());
  pool->drop("sb-b");
  CHECK(pool->totals().bytes.memory_bytes() == 0);
}

TEST_CASE("pool: over budget, the oldest records spill to the file tier (io_uring and pread/pwrite)") {
  for (bool uring : {true, false}) {
    CAPTURE(uring);
    sg::test::TempDir td;
    const uint64_t budget = 256 << 10;
    auto pool = open_pool(td.path(), budget, uring);
    if (uring && !pool->totals().io_uring) MESSAGE("io_uring unavailable here: both passes use pread/pwrite");
    const uint64_t n = 400;
    for (uint64_t p = 0; p < n; ++p) {
      REQUIRE(pool->put(p % 2 ? "odd" : "even", p, 2, payload_for(p, 3000)).ok());
      CHECK(pool->totals().bytes.memory_bytes() <= budget);
    }
    PoolTotals t = pool->totals();
    CHECK(t.bytes.records == n);
    CHECK(t.bytes.file_records > 0);
    CHECK(t.bytes.memory_records > 0);
    CHECK(t.spills > 0);
    CHECK(t.spilled_records == t.bytes.file_records);
    // The oldest pages went first.
    CHECK(pool->stats("even").file_records > 0);
    std::string even_file = td.sub(pool_file_name("even"));
    CHECK(static_cast<uint64_t>(file_size(even_file)) == pool->stats("even").file_bytes);
    CHECK(pool->stats("even").file_bytes ==
          kPoolFileHeaderSize + pool->stats("even").file_records * (kRecordHeaderSize + 3000));
    for (uint64_t p = 0; p < n; ++p) {
      auto r = pool->get(p % 2 ? "odd" : "even", p);
      REQUIRE_MESSAGE(r.ok(), r.error().message());
      CHECK(r->payload == payload_for(p, 3000));
    }
    // A batch mixing both tiers and a missing page.
    std::vector<uint64_t> want = {0, 2, 398, 4, 1000};
    auto b = pool->get_batch("even", want);
    REQUIRE(b.size() == 5);
    for (int i = 0; i < 4; ++i) {
      REQUIRE(b[i].ok());
      CHECK(b[i]->payload == payload_for(want[i], 3000));
    }
    CHECK(b[4].error().kind() == sg::ErrorKind::kNotFound);
    // A page rewritten after its spill: the file copy becomes dead bytes.
    REQUIRE(pool->put("even", 0, 2, "new").ok());
    CHECK(pool->get("even", 0)->payload == "new");
    CHECK(pool->stats("even").dead_file_bytes == kRecordHeaderSize + 3000);
    CHECK(pool->totals().read_errors == 0);
    pool->drop("even");
    CHECK(file_size(even_file) == -1);
    CHECK(pool->stats("even").records == 0);
    CHECK(pool->totals().bytes.memory_bytes() == pool->stats("odd").memory_bytes());
  }
}

TEST_CASE("pool: budget 0 writes every record to its file; spill_all moves the rest") {
  sg::test::TempDir td;
  auto pool = open_pool(td.path(), 0);
  REQUIRE(pool->put("s", 1, 1, "one").ok());
  CHECK(pool->stats("s").memory_records == 0);
  CHECK(pool->stats("s").file_records == 1);
  CHECK(pool->get("s", 1)->payload == "one");
  sg::test::TempDir td2;
  auto p2 = open_pool(td2.path(), 1 << 20);
  for (uint64_t i = 0; i < 10; ++i) REQUIRE(p2->put("s", i, 0, payload_for(i, 500)).ok());
  REQUIRE(p2->spill_all("s").ok());
  CHECK(p2->stats("s").memory_records == 0);
  CHECK(p2->stats("s").file_records == 10);
  CHECK(p2->stats("s").memory_record_bytes == 0);
  CHECK(p2->stats("s").metadata_bytes == 10 * Pool::file_entry_overhead() + Pool::sandbox_overhead() + std::string("s").capacity());
  for (uint64_t i = 0; i < 10; ++i) CHECK(p2->get("s", i)->payload == payload_for(i, 500));
}

TEST_CASE("pool: a corrupt byte on disk is reported, never returned") {
  sg::test::TempDir td;
  auto pool = open_pool(td.path(), 1 << 20);
  for (uint64_t i = 0; i < 4; ++i) REQUIRE(pool->put("s", i, 0, payload_for(i, 1000)).ok());
  REQUIRE(pool->spill_all("s").ok());
  std::string path = td.sub(pool_file_name("s"));
  // Record 2 (page 2) starts at header + 2 records; flip a payload byte.
  off_t rec2 = kPoolFileHeaderSize + 2 * (kRecordHeaderSize + 1000);
  patch_byte(path, rec2 + kRecordHeaderSize + 500, 0x01);
  auto r = pool->get("s", 2);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().message().find("checksum mismatch") != std::string::npos);
  CHECK(r.error().message().find(path) != std::string::npos);
  CHECK(pool->get("s", 1).ok());
  CHECK(pool->get("s", 3).ok());
  // A header byte (the page index) is caught too: CRC, then the index check.
  patch_byte(path, kPoolFileHeaderSize + 8, 0x02);
  auto r0 = pool->get("s", 0);
  REQUIRE_FALSE(r0.ok());
  CHECK(r0.error().message().find("checksum mismatch") != std::string::npos);
  CHECK(pool->totals().read_errors == 2);
}

TEST_CASE("pool: reopening the directory recovers records; a torn last record is ignored and cut off") {
  sg::test::TempDir td;
  std::string path = td.sub(pool_file_name("sb/1"));
  {
    auto pool = open_pool(td.path(), 0);
    for (uint64_t i = 0; i < 5; ++i) REQUIRE(pool->put("sb/1", i * 10, 4, payload_for(i, 2000)).ok());
    REQUIRE(pool->put("sb/1", 0, 5, "newer page 0").ok());
  }
  off_t full = file_size(path);
  REQUIRE(full == off_t(kPoolFileHeaderSize + 5 * (kRecordHeaderSize + 2000) + kRecordHeaderSize + 12));
  {
    auto pool = open_pool(td.path(), 1 << 20, true, /*recover=*/true);
    CHECK(pool->stats("sb/1").records == 5);
    CHECK(pool->get("sb/1", 0)->payload == "newer page 0");
    CHECK(pool->get("sb/1", 0)->kind == 5);
    CHECK(pool->get("sb/1", 40)->payload == payload_for(4, 2000));
    CHECK(pool->stats("sb/1").dead_file_bytes == kRecordHeaderSize + 2000);
  }
  // Tear the last record: it and only it is lost, and the file is cut back.
  REQUIRE(::truncate(path.c_str(), full - 5) == 0);
  {
    auto pool = open_pool(td.path(), 1 << 20, false, true);
    CHECK(pool->stats("sb/1").records == 5);
    CHECK(pool->get("sb/1", 0)->payload == payload_for(0, 2000));  // the older copy is back in force
    CHECK(file_size(path) == off_t(kPoolFileHeaderSize + 5 * (kRecordHeaderSize + 2000)));
    // Appending after recovery continues at the cut.
    REQUIRE(pool->put("sb/1", 99, 0, "after").ok());
    REQUIRE(pool->spill_all("sb/1").ok());
  }
  {
    auto pool = open_pool(td.path(), 1 << 20, true, true);
    CHECK(pool->stats("sb/1").records == 6);
    CHECK(pool->get("sb/1", 99)->payload == "after");
  }
  // Truncated mid-header.
  off_t now = file_size(path);
  REQUIRE(::truncate(path.c_str(), now - (kRecordHeaderSize + 5) + 10) == 0);
  {
    auto pool = open_pool(td.path(), 1 << 20, true, true);
    CHECK(pool->stats("sb/1").records == 5);
    CHECK_FALSE(pool->contains("sb/1", 99));
  }
  // Without recover, leftover files are removed.
  {
    auto pool = open_pool(td.path(), 1 << 20, true, false);
    CHECK(pool->totals().sandboxes == 0);
    CHECK(file_size(path) == -1);
  }
}

TEST_CASE("pool: recovery stops at the first corrupt record, even mid-file") {
  sg::test::TempDir td;
  std::string path = td.sub(pool_file_name("s"));
  {
    auto pool = open_pool(td.path(), 0);
    for (uint64_t i = 0; i < 4; ++i) REQUIRE(pool->put("s", i, 0, payload_for(i, 100)).ok());
  }
  patch_byte(path, kPoolFileHeaderSize + 1 * (kRecordHeaderSize + 100) + kRecordHeaderSize + 1, 0x80);
  auto pool = open_pool(td.path(), 1 << 20, true, true);
  CHECK(pool->stats("s").records == 1);
  CHECK(pool->get("s", 0)->payload == payload_for(0, 100));
  CHECK_FALSE(pool->contains("s", 1));
  CHECK_FALSE(pool->contains("s", 3));
  CHECK(file_size(path) == off_t(kPoolFileHeaderSize + kRecordHeaderSize + 100));
}

TEST_CASE("pool: a put that cannot spill stores nothing and says so (file tier unwritable)") {
  sg::test::TempDir td;
  std::string dir = td.sub("pool");
  auto pool = open_pool(dir, 8 << 10);
  REQUIRE(pool->put("s", 0, 0, payload_for(0, 1000)).ok());
  // The directory disappears under the pool: every spill's open() fails.
  REQUIRE(sg::sys::remove_tree(dir).ok());
  sg::Status last;
  uint64_t stored = 1;
  for (uint64_t i = 1; i < 20 && last.ok(); ++i) {
    last = pool->put("s", i, 0, payload_for(i, 1000));
    if (last.ok()) ++stored;
  }
  REQUIRE_FALSE(last.ok());
  CHECK(last.error().kind() == sg::ErrorKind::kUnavailable);
  CHECK(last.error().message().find("keep the page resident") != std::string::npos);
  CHECK(pool->stats("s").records == stored);
  CHECK_FALSE(pool->contains("s", stored));
  CHECK(pool->totals().spill_errors > 0);
  for (uint64_t i = 0; i < stored; ++i) CHECK(pool->get("s", i)->payload == payload_for(i, 1000));
}

TEST_CASE("pool: concurrent puts and gets from several threads") {
  sg::test::TempDir td;
  auto pool = open_pool(td.path(), 64 << 10);
  std::vector<std::thread> ts;
  std::atomic<int> bad{0};
  for (int t = 0; t < 4; ++t)
    ts.emplace_back([&, t] {
      std::string sb = "sb" + std::to_string(t);
      for (uint64_t i = 0; i < 200; ++i) {
        if (!pool->put(sb, i, 0, payload_for(i, 700)).ok()) ++bad;
        auto r = pool->get(sb, i / 2);
        if (!r.ok() || r->payload != payload_for(i / 2, 700)) ++bad;
      }
    });
  for (auto& t : ts) t.join();
  CHECK(bad == 0);
  CHECK(pool->totals().bytes.records == 800);
  CHECK(pool->totals().bytes.memory_bytes() <= 64 << 10);
}

TEST_CASE("pool: a spill whose second write fails leaves no partial batch on disk (regression: torn spill resurrected by recovery)") {
  sg::test::TempDir td;
  int writes = 0;
  PoolConfig c = pool_config(64 << 20, td.path());
  bool armed = false;
  c.inject_io_error = [&](bool write, uint64_t, uint32_t) {
    if (!write || !armed) return 0;
    return ++writes == 2 ? EIO : 0;
  };
  auto pool = std::move(Pool::open(c)).value();
  for (uint64_t i = 0; i < 100; ++i) REQUIRE(pool->put("s", i, 0, payload_for(i, 4000)).ok());  // 400 KiB: 2 writes
  armed = true;
  auto st = pool->spill_all("s");
  REQUIRE_FALSE(st.ok());
  CHECK(st.error().message().find("Input/output error") != std::string::npos);
  std::string path = td.sub(pool_file_name("s"));
  CHECK(file_size(path) == off_t(kPoolFileHeaderSize));
  CHECK(pool->stats("s").memory_records == 100);
  CHECK(pool->totals().spill_errors == 1);
  REQUIRE(pool->spill_all("s").ok());
  CHECK(pool->stats("s").file_records == 100);
  pool.reset();
  auto again = open_pool(td.path(), 64 << 20, true, true);
  CHECK(again->stats("s").records == 100);
  for (uint64_t i = 0; i < 100; ++i) CHECK(again->get("s", i)->payload == payload_for(i, 4000));
}

TEST_CASE("pool: fail the Nth file operation: a put either stores or says so, a get returns right data or an error") {
  int failed_puts = 0, failed_gets = 0;
  for (bool uring : {true, false}) {
    for (int n = 1; n <= 40; ++n) {
      CAPTURE(uring);
      CAPTURE(n);
      sg::test::TempDir td;
      int ops = 0;
      PoolConfig c = pool_config(32 << 10, td.path(), false, uring);
      c.inject_io_error = [&](bool, uint64_t, uint32_t) { return ++ops == n ? ENOSPC : 0; };
      auto pool = std::move(Pool::open(c)).value();
      std::vector<bool> stored(60, false);
      for (uint64_t i = 0; i < 60; ++i) {
        stored[i] = pool->put("s", i, 1, payload_for(i, 1500)).ok();
        failed_puts += !stored[i];
        CHECK(pool->contains("s", i) == stored[i]);
      }
      for (uint64_t i = 0; i < 60; ++i) {
        auto r = pool->get("s", i);
        if (!stored[i]) {
          CHECK(r.error().kind() == sg::ErrorKind::kNotFound);
        } else if (r.ok()) {
          CHECK(r->payload == payload_for(i, 1500));
        } else {
          CHECK(r.error().message().find("No space left") != std::string::npos);
          ++failed_gets;
        }
      }
      // Once the fault has passed, everything stored reads back.
      for (uint64_t i = 0; i < 60; ++i)
        if (stored[i]) CHECK(pool->get("s", i)->payload == payload_for(i, 1500));
    }
  }
  CHECK(failed_puts > 0);  // the loop reached both the spill path and the read path
  CHECK(failed_gets > 0);
}
