// process/swap.h without root: overlap, the prefetch's set (the pages
// resident at two page-outs in a row, per process), and the host-swap mode
// on a swap table of the test's own.
#include <doctest/doctest.h>

#include "base/sys.h"
#include "sandbox-runtime/process/swap.h"
#include "tests/support/temp_dir.h"

namespace sg::process {
namespace {

TEST_CASE("the prefetch reads back what two page-outs in a row found resident, per process") {
  std::vector<ProcessPages> a{{10, {{0x1000, 4}, {0x10000, 2}, {0x20000, 8}}}, {11, {{0x1000, 1}}}, {12, {{0x1000, 3}}}};
  std::vector<ProcessPages> b{{10, {{0x3000, 4}, {0x11000, 1}, {0x1f000, 2}, {0x22000, 1}, {0x27000, 9}}},
                              {12, {{0x1000, 3}}},
                              {13, {{0x1000, 5}}}};
  std::vector<ProcessPages> both = overlap(a, b);
  REQUIRE(both.size() == 2);
  CHECK(both[0].pid == 10);
  // [0x1000,+4) & [0x3000,+4) = 0x3000,+2; [0x10000,+2) & [0x11000,+1) = 0x11000,+1;
  // [0x20000,+8) & [0x1f000,+2) = 0x20000,+1, & [0x22000,+1), & [0x27000,+9) = 0x27000,+1.
  std::vector<std::pair<uint64_t, uint64_t>> runs;
  for (const PageRange& r : both[0].ranges) runs.push_back({r.start, r.pages});
  CHECK(runs == std::vector<std::pair<uint64_t, uint64_t>>{{0x3000, 2}, {0x11000, 1}, {0x20000, 1}, {0x22000, 1}, {0x27000, 1}});
  CHECK(both[1].pid == 12);
  CHECK(both[1].ranges.size() == 1);
  CHECK(page_count(both) == 6 + 3);
  // The first page-out has no predecessor: nothing is read back.
  CHECK(overlap({}, b).empty());
  CHECK(overlap(a, {}).empty());
  CHECK(page_count({}) == 0);
}

TEST_CASE("--process-swap host: no active swap is kUnavailable with the reason; a listed one is used") {
  test::TempDir dir;
  SwapConfig cfg;
  cfg.mode = "host";
  cfg.proc_swaps = dir.path() + "/swaps";
  std::string header = "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n";
  REQUIRE(sys::write_file(cfg.proc_swaps, header));
  Result<std::unique_ptr<SwapDevice>> none = SwapDevice::open(cfg);
  REQUIRE(!none);
  CHECK(none.error().kind() == ErrorKind::kUnavailable);
  CHECK(none.error().message().find("no active swap") != std::string::npos);
  REQUIRE(sys::write_file(cfg.proc_swaps, header + "/swapfile                                file\t\t1048572\t\t2048\t\t-2\n"));
  Result<std::unique_ptr<SwapDevice>> host = SwapDevice::open(cfg);
  REQUIRE(host);
  CHECK((*host)->describe() == "host swap (/swapfile)");
  Result<SwapStats> st = (*host)->stats();
  REQUIRE(st);
  CHECK(st->used_bytes == 2048 * 1024);
  CHECK(st->stored_bytes == st->used_bytes);
  cfg.mode = "tmpfs";
  Result<std::unique_ptr<SwapDevice>> bad = SwapDevice::open(cfg);
  REQUIRE(!bad);
  CHECK(bad.error().kind() == ErrorKind::kInvalid);
}

}  // namespace
}  // namespace sg::process
