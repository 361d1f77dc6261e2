// The memory engine end to end without KVM: the VMM's own GuestMemory code
// (a clone's MAP_PRIVATE snapshot mapping, or a booted VM's memfd) in this
// process stands in for the VMM, so offload reads it through
// process_vm_readv and /proc/self/pagemap exactly as it reads a VMM, and
// the release is the VMM's release_to_userfaultfd. Guest accesses after
// the release are made on another thread with a deadline: a fault the
// engine fails to serve fails the test instead of hanging it.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <chrono>
#include <cstring>
#include <future>
#include <random>
#include <vector>

#include "sandbox-runtime/vmm/kvm/memory.h"
#include "wait-engine/memory/offload.h"
#include "wait-engine/memory/pressure.h"
#include "storage/store.h"
#include "tests/support/faulty_os.h"
#include "tests/support/temp_dir.h"
#include "base/sys.h"

using namespace sg;
using namespace sg::memory;
using namespace std::chrono_literals;

namespace {

constexpr uint64_t kPg = 4096;
constexpr uint64_t kPages = 512;  // 2 MiB of "guest RAM"

// Template contents: random pages, zero pages, text-like pages.
std::vector<uint8_t> make_template() {
  std::vector<uint8_t> t(kPages * kPg, 0);
  std::mt19937_64 rng(42);
  for (uint64_t p = 0; p < kPages; ++p) {
    uint8_t* pg = t.data() + p * kPg;
    if (p % 4 == 0) continue;  // zero
    if (p % 4 == 1) {
      for (uint64_t i = 0; i < kPg; i += 8) {
        uint64_t v = rng();
        std::memcpy(pg + i, &v, 8);
      }
    } else {
      for (uint64_t i = 0; i < kPg; ++i) pg[i] = static_cast<uint8_t>("def fn(x):\n  return x * 2\n"[(i + p) % 27]);
    }
  }
  return t;
}

uint64_t present_pages(const uint8_t* base, uint64_t pages) {
  int fd = ::open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  std::vector<uint64_t> pm(pages);
  REQUIRE(::pread(fd, pm.data(), pages * 8, static_cast<off_t>(reinterpret_cast<uintptr_t>(base) / kPg * 8)) ==
          static_cast<ssize_t>(pages * 8));
  ::close(fd);
  uint64_t n = 0;
  for (uint64_t e : pm) n += (e >> 63) & 1;
  return n;
}

// Reads the whole region on another thread (where the faults happen) and
// compares with want; false on a mismatch or when it took over 10 s.
bool reads_back(const uint8_t* base, const std::vector<uint8_t>& want, std::string* why) {
  auto f = std::async(std::launch::async, [&] {
    for (uint64_t p = 0; p < kPages; ++p)
      if (std::memcmp(base + p * kPg, want.data() + p * kPg, kPg) != 0) return static_cast<int64_t>(p);
    return int64_t{-1};
  });
  if (f.wait_for(10s) != std::future_status::ready) {
    *why = "reads did not finish in 10 s (a fault not served)";
    std::abort();  // the reader is blocked in a fault: nothing else can end it
  }
  int64_t bad = f.get();
  if (bad >= 0) *why = "page " + std::to_string(bad) + " differs";
  return bad < 0;
}

// Fills the clone's RAM with random bytes (every page then differs from
// the template) and returns them.
std::vector<uint8_t> fill_random(uint8_t* base, uint64_t seed) {
  std::vector<uint8_t> want(kPages * kPg);
  std::mt19937_64 rng(seed);
  for (auto& b : want) b = static_cast<uint8_t>(rng());
  std::memcpy(base, want.data(), want.size());
  return want;
}

// A target for RAM mapped in this process, released by the VMM's own code.
OffloadTarget target_for(vmm::GuestMemory& mem, const std::string& template_path, const CohortKey& key = {}) {
  OffloadTarget t;
  t.cohort = key.tenant_id.empty() ? "tenant/template" : key.tenant_id + "/" + key.template_id;
  t.cohort_key = key;
  t.pid = ::getpid();
  t.base = reinterpret_cast<uintptr_t>(mem.host_base());
  t.size = mem.size();
  t.backing = mem.backing();
  t.template_memory = template_path;
  vmm::GuestMemory* m = &mem;
  t.release = [m]() -> Result<std::pair<UniqueFd, uint64_t>> {
    uint64_t features = 0;
    Result<int> r = m->release_to_userfaultfd(&features);
    if (!r) return r.error();
    return std::make_pair(UniqueFd(*r), features);
  };
  return t;
}

struct Env {
  test::TempDir dir;
  std::string tmpl_path = dir.sub("memory");
  std::vector<uint8_t> tmpl = make_template();
  std::unique_ptr<MemoryEngine> engine;
  std::atomic<int> lost{0};
  Env(uint64_t budget = 16 << 20) {
    REQUIRE(sys::write_file(tmpl_path, std::string(tmpl.begin(), tmpl.end())));
    MemoryEngineConfig cfg;
    cfg.pool.dir = dir.sub("pool");
    cfg.pool.memory_budget = budget;
    cfg.on_lost = [this](const std::string&, const std::string&) { lost.fetch_add(1); };
    auto e = MemoryEngine::open(cfg);
    REQUIRE_MESSAGE(e, (e ? "" : e.error().message()));
    engine = std::move(*e);
  }
  OffloadTarget target(vmm::GuestMemory& mem, bool with_template) {
    return target_for(mem, with_template ? tmpl_path : "");
  }
};

}  // namespace

TEST_CASE("offload of a clone's RAM: only changed pages stored, all released, every page restored on touch") {
  Env env;
  auto mem = vmm::GuestMemory::map_private_file(env.tmpl_path);
  REQUIRE(mem);
  CHECK(std::string(mem->backing()) == "file");
  // The "guest" runs: it reads most of RAM (page cache, shared), writes a
  // few bytes into some pages, rewrites others, zeroes some.
  std::vector<uint8_t> want = env.tmpl;
  uint8_t* base = mem->host_base();
  uint64_t sum = 0;
  for (uint64_t p = 0; p < kPages; p += 2) sum += base[p * kPg];
  CHECK(sum < ~0ull);
  std::mt19937_64 rng(7);
  for (uint64_t p = 1; p < kPages; p += 10) {  // near the template: a few bytes
    base[p * kPg + 100] ^= 0x5a;
    want[p * kPg + 100] ^= 0x5a;
  }
  for (uint64_t p = 3; p < kPages; p += 50) {  // new random content
    for (uint64_t i = 0; i < kPg; ++i) base[p * kPg + i] = want[p * kPg + i] = static_cast<uint8_t>(rng());
  }
  for (uint64_t p = 2; p < kPages; p += 40) {  // zeroed
    std::memset(base + p * kPg, 0, kPg);
    std::memset(want.data() + p * kPg, 0, kPg);
  }
  REQUIRE(present_pages(base, kPages) > 0);

  std::atomic<bool> cancel{false};
  auto rep = env.engine->offload("sb1", env.target(*mem, true), cancel);
  REQUIRE_MESSAGE(rep, (rep ? "" : rep.error().message()));
  CHECK(rep->pages_read > 0);
  CHECK(rep->pages_stored > 0);
  // Only the changed pages are stored; the rest equal the template.
  CHECK(rep->pages_stored <= kPages / 10 + kPages / 50 + kPages / 40 + 3);
  CHECK(rep->pages_base + rep->pages_stored == rep->pages_read);
  CHECK(rep->bytes_stored < rep->pages_stored * kPg / 4);
  CHECK(std::string(mem->backing()) == "userfaultfd");
  CHECK(present_pages(base, kPages) == 0);
  CHECK(rep->pool_bytes > 0);
  CHECK(env.engine->pool_bytes("sb1") == rep->pool_bytes);

  std::string why;
  CHECK_MESSAGE(reads_back(base, want, &why), why);
  auto st = env.engine->stats("sb1");
  REQUIRE(st);
  CHECK(st->faults.faults >= kPages);  // every page faulted once (no prefetch yet)
  CHECK(st->faults.source_errors == 0);
  CHECK(st->pool.records == 0);  // installed pages leave the pool
  CHECK(env.lost == 0);

  SUBCASE("a second round stores what changed since, a prefetch installs the pages touched last time") {
    for (uint64_t p = 5; p < kPages; p += 30) {
      base[p * kPg + 7] = 0x11;
      want[p * kPg + 7] = 0x11;
    }
    auto rep2 = env.engine->offload("sb1", env.target(*mem, true), cancel);
    REQUIRE_MESSAGE(rep2, (rep2 ? "" : rep2.error().message()));
    CHECK(rep2->pages_read == kPages);  // all were faulted back
    CHECK(present_pages(base, kPages) == 0);
    // The history predictor: the last post-resume trace was every page.
    auto n = env.engine->prefetch("sb1");
    REQUIRE_MESSAGE(n, (n ? "" : n.error().message()));
    CHECK(*n == kPages);
    auto before = env.engine->stats("sb1")->faults.faults;
    CHECK_MESSAGE(reads_back(base, want, &why), why);
    CHECK(env.engine->stats("sb1")->faults.faults == before);  // nothing faulted on demand
    // Write to 20 prefetched pages: the next offload counts them as used.
    for (uint64_t p = 0; p < 20; ++p) base[p * kPg + 1] = want[p * kPg + 1] = 0x77;
    auto rep3 = env.engine->offload("sb1", env.target(*mem, true), cancel);
    REQUIRE(rep3);
    auto t = env.engine->totals();
    CHECK(t.prefetch_used == 20);
    CHECK(t.prefetch_wasted == kPages - 20);
    CHECK_MESSAGE(reads_back(base, want, &why), why);
    std::string m;
    env.engine->render_metrics(m);
    CHECK(m.find("sandgate_memory_offloads_total 3") != std::string::npos);
    CHECK(m.find("sandgate_memory_prefetch_used_total 20") != std::string::npos);
  }
  SUBCASE("forget drops the pool") {
    env.engine->forget("sb1");
    CHECK_FALSE(env.engine->stats("sb1"));
    CHECK(env.engine->totals().pool.bytes.records == 0);
  }
}

TEST_CASE("offload: a prefetch racing demand faults on the same pages installs each page's own content") {
  // Every page differs from the template, so each has a pool record. After
  // the first round the predictor prefetches every page at the resume
  // while a reader faults them in the other order: the two meet on
  // pages in flight. A record forgotten before its page was installed let
  // the loser of that race install the template's page instead.
  Env env(64 << 20);
  auto mem = vmm::GuestMemory::map_private_file(env.tmpl_path);
  REQUIRE(mem);
  uint8_t* base = mem->host_base();
  std::vector<uint8_t> want = fill_random(base, 11);
  std::atomic<bool> cancel{false};
  std::string why;
  for (int round = 0; round < 12; ++round) {
    for (uint64_t p = 0; p < kPages; ++p) base[p * kPg + 9] = want[p * kPg + 9] = static_cast<uint8_t>(round + p);
    auto rep = env.engine->offload("race", env.target(*mem, true), cancel);
    REQUIRE_MESSAGE(rep, (rep ? "" : rep.error().message()));
    REQUIRE(rep->pages_stored == kPages);
    if (round == 0) {
      CHECK_MESSAGE(reads_back(base, want, &why), why);  // the trace the predictor learns from
      continue;
    }
    // Demand faults from the top while the prefetch goes from the bottom.
    auto reader = std::async(std::launch::async, [&] {
      for (uint64_t p = kPages; p-- > 0;)
        if (std::memcmp(base + p * kPg, want.data() + p * kPg, kPg) != 0) return static_cast<int64_t>(p);
      return int64_t{-1};
    });
    auto n = env.engine->prefetch("race");
    REQUIRE_MESSAGE(n, (n ? "" : n.error().message()));
    REQUIRE(reader.wait_for(10s) == std::future_status::ready);
    int64_t bad = reader.get();
    CHECK_MESSAGE(bad < 0, "round " << round << ": page " << bad << " lost its content to the race");
    CHECK_MESSAGE(reads_back(base, want, &why), "round " << round << ": " << why);
    if (bad >= 0) break;
  }
  CHECK(env.engine->stats("race")->pool.records == 0);  // every installed page left the pool
  CHECK(env.lost == 0);
}

TEST_CASE("offload: a fault served after the page map was read is not dropped by the release") {
  // A vCPU kicked out of a fault by the pause leaves the event with the
  // fault server, which may serve it while the next offload runs. Served
  // after the page map was read, the page was not read out, its record
  // was erased as installed, and the release dropped it: the guest got
  // the template's page back. Here the fault comes from a reader started
  // inside the release hook, after the pages were encoded.
  Env env(64 << 20);
  auto mem = vmm::GuestMemory::map_private_file(env.tmpl_path);
  REQUIRE(mem);
  uint8_t* base = mem->host_base();
  std::vector<uint8_t> want = fill_random(base, 23);
  std::atomic<bool> cancel{false};
  auto rep = env.engine->offload("late", env.target(*mem, true), cancel);
  REQUIRE_MESSAGE(rep, (rep ? "" : rep.error().message()));
  REQUIRE(present_pages(base, kPages) == 0);
  // Round 2: page 5 stays out (its record is its only copy) while the
  // others come back and change.
  for (uint64_t p = 0; p < kPages; ++p)
    if (p != 5) base[p * kPg + 3] = want[p * kPg + 3] = static_cast<uint8_t>(p + 1);
  const uint64_t page = 5;
  std::future<bool> reader;
  OffloadTarget t = env.target(*mem, true);
  auto release = t.release;
  bool late_served = false;
  t.release = [&]() -> Result<std::pair<UniqueFd, uint64_t>> {
    reader = std::async(std::launch::async, [&] {
      return std::memcmp(base + page * kPg, want.data() + page * kPg, kPg) == 0;
    });
    // Unheld, the fault is served at once; held, not before the release.
    late_served = reader.wait_for(500ms) == std::future_status::ready;
    return release();
  };
  auto rep2 = env.engine->offload("late", t, cancel);
  REQUIRE_MESSAGE(rep2, (rep2 ? "" : rep2.error().message()));
  CHECK_FALSE(late_served);
  REQUIRE(reader.valid());
  REQUIRE(reader.wait_for(10s) == std::future_status::ready);
  CHECK(reader.get());
  std::string why;
  CHECK_MESSAGE(reads_back(base, want, &why), why);
  CHECK(env.engine->stats("late")->faults.source_errors == 0);
  CHECK(env.lost == 0);
}

TEST_CASE("offload: cancelled between pages, nothing released and nothing kept") {
  Env env;
  auto mem = vmm::GuestMemory::map_private_file(env.tmpl_path);
  REQUIRE(mem);
  uint8_t* base = mem->host_base();
  for (uint64_t p = 0; p < kPages; ++p) base[p * kPg] = 0xee;
  std::atomic<bool> cancel{true};
  auto rep = env.engine->offload("sb", env.target(*mem, true), cancel);
  REQUIRE_FALSE(rep);
  CHECK(rep.error().kind() == ErrorKind::kConflict);
  CHECK(std::string(mem->backing()) == "file");  // not released
  CHECK(present_pages(base, kPages) == kPages);
  CHECK(env.engine->stats("sb")->pool.records == 0);
  CHECK(env.engine->totals().offloads_cancelled == 1);
  for (uint64_t p = 0; p < kPages; ++p) CHECK(base[p * kPg] == 0xee);
}

TEST_CASE("offload: a release the VMM refuses leaves RAM whole and the pool empty") {
  Env env;
  auto mem = vmm::GuestMemory::map_private_file(env.tmpl_path);
  REQUIRE(mem);
  uint8_t* base = mem->host_base();
  for (uint64_t p = 0; p < kPages; ++p) base[p * kPg] = 0x42;
  OffloadTarget t = env.target(*mem, true);
  t.release = []() -> Result<std::pair<UniqueFd, uint64_t>> {
    return Error(ErrorKind::kConflict, "release the guest memory of a paused machine only");
  };
  std::atomic<bool> cancel{false};
  auto rep = env.engine->offload("sb", t, cancel);
  REQUIRE_FALSE(rep);
  CHECK(rep.error().kind() == ErrorKind::kUnavailable);
  CHECK(rep.error().message().find("paused machine") != std::string::npos);
  CHECK(env.engine->stats("sb")->pool.records == 0);
  for (uint64_t p = 0; p < kPages; ++p) CHECK(base[p * kPg] == 0x42);
  // A target that moved is refused.
  OffloadTarget moved = env.target(*mem, true);
  moved.base += kPg;
  auto r2 = env.engine->offload("sb", moved, cancel);
  REQUIRE_FALSE(r2);
  CHECK(r2.error().kind() == ErrorKind::kInvalid);
}

TEST_CASE("offload of a booted VM's memfd RAM (no template): zero pages cost nothing, data comes back") {
  Env env(0);  // budget 0: every record goes through the file tier
  auto mem = vmm::GuestMemory::create_memfd(kPages * kPg);
  REQUIRE(mem);
  uint8_t* base = mem->host_base();
  std::vector<uint8_t> want(kPages * kPg, 0);
  for (uint64_t p = 0; p < kPages; p += 3) {
    for (uint64_t i = 0; i < kPg; i += 64) base[p * kPg + i] = want[p * kPg + i] = static_cast<uint8_t>(p + i);
  }
  std::atomic<bool> cancel{false};
  auto rep = env.engine->offload("vm", env.target(*mem, false), cancel);
  REQUIRE_MESSAGE(rep, (rep ? "" : rep.error().message()));
  CHECK(rep->pages_read == kPages);  // memfd: every page read once
  CHECK(rep->pages_stored == (kPages + 2) / 3);
  CHECK(rep->pages_base == kPages - rep->pages_stored);
  CHECK(rep->pool_bytes < 64 * 1024);  // file tier: only the index is RAM
  CHECK(env.engine->totals().pool.bytes.file_bytes > 0);
  std::string why;
  CHECK_MESSAGE(reads_back(base, want, &why), why);
  auto st = env.engine->stats("vm");
  REQUIRE(st);
  CHECK(st->faults.zero_pages == rep->pages_base);
  CHECK(st->faults.copies == rep->pages_stored);
}

TEST_CASE("pressure gate: on below the low mark, off only above the high mark") {
  PressureGate g(0.2, 0.3);
  CHECK_FALSE(g.update(50, 100));
  CHECK(g.update(19, 100));   // pressure: offload
  CHECK(g.update(25, 100));   // between the marks: stays on
  CHECK(g.update(30, 100));   // at the high mark: still on
  CHECK_FALSE(g.update(31, 100));
  CHECK_FALSE(g.update(25, 100));  // between the marks: stays off
  CHECK_FALSE(g.update(0, 0));     // no reading: unchanged
  auto m = parse_meminfo("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   12000000 kB\n");
  REQUIRE(m);
  CHECK(m->total == 24000000ull * 1024);
  CHECK(m->available == 12000000ull * 1024);
  CHECK_FALSE(parse_meminfo("MemTotal: 5 kB\n"));
  CHECK_FALSE(parse_meminfo("MemTotal: x kB\nMemAvailable: 1 kB\n"));
  auto host = read_host_memory();
  REQUIRE(host);
  CHECK(host->available <= host->total);
}

namespace {

// JSON-ish text from a small vocabulary: what an interpreter's heap holds,
// alike across siblings in content, not in layout.
void fill_text(uint8_t* page, uint32_t seed) {
  static const char* kWords[] = {"request", "tool_call", "sandbox", "template", "function", "arguments", "result",
                                 "status", "content", "assistant", "message", "python", "import", "return"};
  std::mt19937 rng(seed);
  std::string s;
  while (s.size() < kPg) {
    s += "{\"";
    s += kWords[rng() % 14];
    s += "\": \"";
    s += kWords[rng() % 14];
    s += "\", \"id\": " + std::to_string(rng() % 100000) + "},\n";
  }
  std::memcpy(page, s.data(), kPg);
}

}  // namespace

TEST_CASE("offload with cohort dictionaries: trained after a first offload, used from the next, shared by a sibling, released") {
  test::TempDir dir;
  auto store = storage::Store::open(dir.sub("s.db"));
  REQUIRE(store);
  DictionaryRegistry reg(**store);
  MemoryEngineConfig cfg;
  cfg.pool.dir = dir.sub("pool");
  cfg.dictionaries = &reg;
  auto e = MemoryEngine::open(cfg);
  REQUIRE(e);
  MemoryEngine& engine = **e;
  auto target = [](vmm::GuestMemory& mem) { return target_for(mem, "", CohortKey{"tenant-a", "tpl", ""}); };
  auto fill = [](vmm::GuestMemory& mem, uint32_t base_seed, std::vector<uint8_t>& want) {
    want.assign(kPages * kPg, 0);
    for (uint64_t p = 0; p < kPages; ++p) fill_text(want.data() + p * kPg, base_seed + static_cast<uint32_t>(p));
    std::memcpy(mem.host_base(), want.data(), want.size());
  };
  std::atomic<bool> cancel{false};
  std::string why;

  auto a = vmm::GuestMemory::create_memfd(kPages * kPg);
  REQUIRE(a);
  std::vector<uint8_t> want_a;
  fill(*a, 1, want_a);
  auto r1 = engine.offload("a", target(*a), cancel);
  REQUIRE_MESSAGE(r1, (r1 ? "" : r1.error().message()));
  CHECK(r1->dictionary == 0);  // none yet: trained from this offload's pages
  CHECK(r1->trained);
  engine.wait_for_training();
  auto acq = reg.acquire(CohortKey{"tenant-a", "tpl", ""});
  REQUIRE(acq);
  REQUIRE(acq->has_value());
  uint32_t id = (*acq)->id();
  REQUIRE(reg.release("tenant-a", id));  // the test's own reference back
  CHECK_MESSAGE(reads_back(a->host_base(), want_a, &why), why);

  // Round 2: the same content, now with the dictionary: smaller.
  auto r2 = engine.offload("a", target(*a), cancel);
  REQUIRE(r2);
  CHECK(r2->dictionary == id);
  CHECK(r2->pages_stored == r1->pages_stored);
  MESSAGE("text pages: " << r1->bytes_stored << " bytes without the dictionary, " << r2->bytes_stored << " with it");
  CHECK(r2->bytes_stored < r1->bytes_stored * 9 / 10);
  CHECK_MESSAGE(reads_back(a->host_base(), want_a, &why), why);

  // A sibling of the cohort uses it from its first offload.
  auto b = vmm::GuestMemory::create_memfd(kPages * kPg);
  REQUIRE(b);
  std::vector<uint8_t> want_b;
  fill(*b, 100000, want_b);
  auto rb = engine.offload("b", target(*b), cancel);
  REQUIRE(rb);
  CHECK(rb->dictionary == id);
  CHECK_FALSE(rb->trained);
  CHECK_MESSAGE(reads_back(b->host_base(), want_b, &why), why);
  auto row = (*store)->get_memory_dictionary("tenant-a", id);
  REQUIRE(row);
  REQUIRE(row->has_value());
  CHECK((*row)->refcount == 2);  // a's (the publisher's) and b's
  // Each sandbox gives its reference back when it goes; the last deletes it.
  engine.forget("a");
  row = (*store)->get_memory_dictionary("tenant-a", id);
  REQUIRE(row);
  REQUIRE(row->has_value());
  CHECK((*row)->refcount == 1);
  engine.forget("b");
  row = (*store)->get_memory_dictionary("tenant-a", id);
  REQUIRE(row);
  CHECK_FALSE(row->has_value());
  CHECK(engine.totals().dictionaries_published == 1);
}

TEST_CASE("a release without a userfaultfd loses the sandbox: reported once by take_lost, and on_lost") {
  Env env;
  auto mem = vmm::GuestMemory::map_private_file(env.tmpl_path);
  REQUIRE(mem);
  OffloadTarget t = env.target(*mem, true);
  t.release = []() -> Result<std::pair<UniqueFd, uint64_t>> { return std::make_pair(UniqueFd(), uint64_t{0}); };
  std::atomic<bool> cancel{false};
  auto rep = env.engine->offload("sb-lost", t, cancel);
  REQUIRE_FALSE(rep);
  CHECK(rep.error().kind() == ErrorKind::kInternal);
  CHECK(env.lost == 1);
  auto lost = env.engine->take_lost();
  REQUIRE(lost.size() == 1);
  CHECK(lost[0].first == "sb-lost");
  CHECK(lost[0].second.find("userfaultfd") != std::string::npos);
  CHECK(env.engine->take_lost().empty());  // once
  // A lost sandbox is not offloaded again.
  CHECK_FALSE(env.engine->offload("sb-lost", env.target(*mem, true), cancel));
}

// The syscall seam (base/os.h, tests/support/faulty_os.h): every host call
// an offload makes up to the release (the pool file's creation, each pool
// write, the cut after a failed write, the VMM's release) is failed in
// turn. An offload that fails must leave the guest's RAM whole and
// resident, the pool without a record of it, and the engine ready for the
// next offload of the same sandbox, which then succeeds and reads back.
TEST_CASE("offload: every host call up to the release failed in turn: RAM stays whole, the pool keeps nothing") {
  test::TempDir dir;
  std::string tmpl_path = dir.sub("memory");
  std::vector<uint8_t> tmpl = make_template();
  REQUIRE(sys::write_file(tmpl_path, std::string(tmpl.begin(), tmpl.end())));
  test::FaultyOs os;
  MemoryEngineConfig cfg;
  cfg.pool.dir = dir.sub("pool");
  cfg.pool.memory_budget = 0;  // every record through the file tier
  cfg.pool.os = &os;
  cfg.pool.inject_io_error = [&os](bool write, uint64_t offset, uint32_t) {
    return os.inject(write ? "pool write" : "pool read", "offset " + std::to_string(offset)) ? EIO : 0;
  };
  auto engine = MemoryEngine::open(cfg);
  REQUIRE_MESSAGE(engine, (engine ? "" : engine.error().message()));
  MemoryEngine& e = **engine;

  // One guest: the template with every fifth page rewritten.
  uint64_t offload_calls = 0;  // the calls of the last run's offload itself
  auto run = [&](const std::string& id, uint64_t fail_at, std::string* fired) -> bool {
    auto mem = vmm::GuestMemory::map_private_file(tmpl_path);
    REQUIRE(mem);
    std::vector<uint8_t> want = tmpl;
    uint8_t* base = mem->host_base();
    for (uint64_t p = 0; p < kPages; p += 5)
      for (uint64_t i = 0; i < kPg; i += 64) base[p * kPg + i] = want[p * kPg + i] = static_cast<uint8_t>(p + i);
    OffloadTarget t = target_for(*mem, tmpl_path);
    auto release = t.release;
    t.release = [&os, release]() -> Result<std::pair<UniqueFd, uint64_t>> {
      if (os.inject("release", "guest RAM")) return Error(ErrorKind::kUnavailable, "release: injected failure");
      return release();
    };
    const uint64_t resident = present_pages(base, kPages);
    os.reset();
    os.fail_at(fail_at);
    std::atomic<bool> cancel{false};
    auto rep = e.offload(id, t, cancel);
    offload_calls = os.calls();
    *fired = os.fired();
    os.fail_at(0);
    std::string why;
    if (rep) {
      CHECK(std::string(mem->backing()) == "userfaultfd");
      CHECK_MESSAGE(reads_back(base, want, &why), why);
    } else {
      CHECK(std::string(mem->backing()) == "file");  // not released
      CHECK(present_pages(base, kPages) == resident);
      CHECK(std::memcmp(base, want.data(), want.size()) == 0);
      auto st = e.stats(id);
      CHECK((!st || st->pool.records == 0));
      // The next offload of the same sandbox goes through.
      auto again = e.offload(id, t, cancel);
      CHECK_MESSAGE(again, (again ? "" : again.error().message()));
      if (again) CHECK_MESSAGE(reads_back(base, want, &why), why);
    }
    e.forget(id);
    return rep.ok();
  };

  std::string fired;
  REQUIRE(run("probe", 0, &fired));
  const uint64_t calls = offload_calls;
  MESSAGE("offload up to the release: " << calls << " host calls");
  REQUIRE(calls >= 3);
  int failed = 0;
  for (uint64_t n = 1; n <= calls; ++n) {
    CAPTURE(n);
    bool ok = run("sb" + std::to_string(n), n, &fired);
    CAPTURE(fired);
    CHECK_FALSE(fired.empty());
    CHECK_FALSE(ok);  // each of these calls is needed: its failure fails the offload
    failed += !ok;
  }
  CHECK(failed == static_cast<int>(calls));
  CHECK(e.take_lost().empty());
  CHECK(e.totals().pool.bytes.records == 0);
  // No pool file outlives its sandbox.
  for (const auto& entry : std::filesystem::directory_iterator(cfg.pool.dir)) CHECK_MESSAGE(false, entry.path());
}
