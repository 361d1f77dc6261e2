// process::overlap, the prefetch's set (process/swap.h): the pages resident
// at two page-outs in a row, per process.
#include <doctest/doctest.h>

#include "sandbox-runtime/process/swap.h"

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

}  // namespace
}  // namespace sg::process
