// GuestMemory on anonymous memory: size checks, span() bounds with
// overflow-prone addresses and lengths, the MMIO hole and the high region
// above 4 GiB, zero-length spans, moves.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>

#include "sandbox-runtime/vmm/kvm/memory.h"
#include "tests/sandbox-runtime/vmm/vmm_harness.h"

using namespace sg;
using namespace sg::vmm;

TEST_CASE("memory: create_anonymous rejects bad sizes") {
  CHECK(!GuestMemory::create_anonymous(0).ok());
  CHECK(!GuestMemory::create_anonymous((1u << 20) - 4096).ok());   // under 1 MiB
  CHECK(!GuestMemory::create_anonymous((1u << 20) + 1).ok());      // not page aligned
  CHECK(!GuestMemory::create_anonymous((1ull << 40) + 4096).ok()); // over 1 TiB
  CHECK(GuestMemory::create_anonymous(1u << 20).ok());  // the smallest allowed
  auto m = GuestMemory::create_anonymous(2u << 20);
  REQUIRE(m.ok());
  CHECK(m->size() == (2u << 20));
  CHECK(m->low_size() == (2u << 20));
  CHECK(m->high_size() == 0);
  CHECK(m->backing_fd() == -1);
  CHECK(!m->is_memfd());
}

TEST_CASE("memory: span bounds in a small guest") {
  GuestMemory m = test::make_ram(1u << 20);
  const uint64_t n = m.size();
  CHECK(m.span(0, n) == m.host_base());
  CHECK(m.span(n - 1, 1) == m.host_base() + n - 1);
  CHECK(m.span(0, n + 1) == nullptr);
  CHECK(m.span(n - 1, 2) == nullptr);
  CHECK(m.span(n, 1) == nullptr);
  CHECK(m.span(kMmioStart, 1) == nullptr);
  CHECK(m.span(kHighStart, 1) == nullptr);
  // Overflow-prone: gpa + len wraps around 2^64.
  CHECK(m.span(UINT64_MAX, 1) == nullptr);
  CHECK(m.span(UINT64_MAX - 1, 2) == nullptr);
  CHECK(m.span(UINT64_MAX, UINT64_MAX) == nullptr);
  CHECK(m.span(1, UINT64_MAX) == nullptr);
  CHECK(m.span(n - 1, UINT64_MAX) == nullptr);
  CHECK(m.span(0, UINT64_MAX) == nullptr);
  CHECK(m.span(4096, UINT64_MAX - 4095) == nullptr);  // gpa + len == 2^64 exactly
}

TEST_CASE("memory: zero-length spans") {
  GuestMemory m = test::make_ram(1u << 20);
  CHECK(m.span(0, 0) == m.host_base());
  CHECK(m.span(12345, 0) == m.host_base() + 12345);
  CHECK(m.span(m.size() + 4096, 0) == nullptr);  // past the end
  CHECK(m.span(kMmioStart + 8, 0) == nullptr);   // in the hole
  CHECK(m.span(UINT64_MAX, 0) == nullptr);
}

TEST_CASE("memory: read and write check bounds and touch nothing when out of range") {
  GuestMemory m = test::make_ram(1u << 20);
  const uint64_t n = m.size();
  uint64_t v = 0x1122334455667788ull;
  CHECK(m.write_obj(n - 8, v));
  uint64_t back = 0;
  CHECK(m.read_obj(n - 8, &back));
  CHECK(back == v);
  std::memset(m.host_base() + n - 8, 0xab, 8);
  CHECK(!m.write_obj(n - 4, v));  // straddles the end
  for (uint64_t i = n - 8; i < n; ++i) CHECK(m.host_base()[i] == 0xab);
  back = 7;
  CHECK(!m.read_obj(n - 4, &back));
  CHECK(back == 7);
  CHECK(!m.write(UINT64_MAX - 3, &v, 8));
}

TEST_CASE("memory: the high region above 4 GiB and the MMIO hole") {
  // 3 GiB + 64 MiB: the low region ends at the hole, 64 MiB sit above 4 GiB.
  // MAP_NORESERVE: only the pages touched here are ever allocated.
  const uint64_t high = 64ull << 20;
  GuestMemory m = test::make_ram(kMmioStart + high);
  REQUIRE(m.low_size() == kMmioStart);
  REQUIRE(m.high_size() == high);
  uint8_t* base = m.host_base();
  CHECK(m.span(kMmioStart - 1, 1) == base + kMmioStart - 1);
  CHECK(m.span(kMmioStart - 1, 2) == nullptr);  // runs into the hole
  CHECK(m.span(kMmioStart, 1) == nullptr);
  CHECK(m.span(kHighStart - 1, 1) == nullptr);
  CHECK(m.span(kHighStart - 1, 2) == nullptr);  // starts in the hole, ends in RAM
  CHECK(m.span(kMmioStart - 8, kHighStart) == nullptr);
  CHECK(m.span(kHighStart, 1) == base + kMmioStart);
  CHECK(m.span(kHighStart, high) == base + kMmioStart);
  CHECK(m.span(kHighStart, high + 1) == nullptr);
  CHECK(m.span(kHighStart + high - 1, 1) == base + kMmioStart + high - 1);
  CHECK(m.span(kHighStart + high, 1) == nullptr);
  CHECK(m.span(kHighStart + high + 4096, 0) == nullptr);
  CHECK(m.span(kHighStart + 1, UINT64_MAX) == nullptr);
  CHECK(m.span(UINT64_MAX - 15, 16) == nullptr);
  // The high region is the part of the mapping after the low one.
  uint32_t v = 0xfeedf00d;
  CHECK(m.write_obj(kHighStart + 4096, v));
  uint32_t back = 0;
  std::memcpy(&back, base + kMmioStart + 4096, 4);
  CHECK(back == v);
}

TEST_CASE("memory: move leaves the source empty") {
  GuestMemory a = test::make_ram(1u << 20);
  uint8_t* base = a.host_base();
  GuestMemory b(std::move(a));
  CHECK(b.host_base() == base);
  CHECK(b.size() == (1u << 20));
  CHECK(a.host_base() == nullptr);
  CHECK(a.size() == 0);
  CHECK(a.span(0, 1) == nullptr);
  GuestMemory c = test::make_ram(2u << 20);
  c = std::move(b);
  CHECK(c.host_base() == base);
  CHECK(c.size() == (1u << 20));
}
