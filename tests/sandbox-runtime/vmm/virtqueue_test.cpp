// Virtqueue on plain memory: configuration checks, chain walking, and
// every malformed-chain case a hostile driver can build (head or next out
// of range, loops, buffers outside RAM, indirect descriptors, an avail idx
// that runs ahead of the ring), index wrap-around, the used ring, state.
#include <doctest/doctest.h>

#include "sandbox-runtime/vmm/devices/virtqueue.h"
#include "tests/sandbox-runtime/vmm/vmm_harness.h"

using namespace sg;
using namespace sg::vmm;
using test::Buf;
using test::Ring;

namespace {

constexpr uint16_t kSize = 16;

struct Fixture {
  GuestMemory mem = test::make_ram();
  Virtqueue q;
  Ring ring{mem, test::desc_gpa(0), test::avail_gpa(0), test::used_gpa(0), kSize};
  Fixture() {
    q.size = kSize;
    q.desc_addr = test::desc_gpa(0);
    q.avail_addr = test::avail_gpa(0);
    q.used_addr = test::used_gpa(0);
    REQUIRE(q.valid_config(mem));
    q.ready = true;
  }
};

}  // namespace

TEST_CASE("virtqueue: valid_config checks size, alignment and that the rings lie in RAM") {
  Fixture f;
  Virtqueue& q = f.q;
  auto with = [&](auto change) {
    Virtqueue c = q;
    change(c);
    return c.valid_config(f.mem);
  };
  CHECK(with([](Virtqueue&) {}));
  CHECK(!with([](Virtqueue& c) { c.size = 0; }));
  CHECK(!with([](Virtqueue& c) { c.size = 12; }));   // not a power of two
  CHECK(!with([](Virtqueue& c) { c.size = 512; }));  // over max_size
  CHECK(with([](Virtqueue& c) { c.size = 256; }));
  CHECK(!with([](Virtqueue& c) { c.desc_addr += 8; }));
  CHECK(!with([](Virtqueue& c) { c.avail_addr += 1; }));
  CHECK(!with([](Virtqueue& c) { c.used_addr += 2; }));
  const uint64_t end = f.mem.size();
  CHECK(!with([&](Virtqueue& c) { c.desc_addr = end - 16 * 8; }));  // table runs past RAM
  CHECK(with([&](Virtqueue& c) { c.desc_addr = end - 16 * kSize; }));
  CHECK(!with([&](Virtqueue& c) { c.avail_addr = end - (6 + 2 * kSize) + 2; }));
  CHECK(with([&](Virtqueue& c) { c.avail_addr = end - (6 + 2 * kSize); }));
  CHECK(!with([&](Virtqueue& c) { c.used_addr = end - (6 + 8 * kSize) + 4; }));
  CHECK(!with([](Virtqueue& c) { c.used_addr = kMmioStart; }));
  CHECK(!with([](Virtqueue& c) { c.desc_addr = UINT64_MAX - 15; }));
}

TEST_CASE("virtqueue: a well-formed chain is walked in order") {
  Fixture f;
  CHECK(!f.q.pop(f.mem));  // empty ring
  CHECK(!f.q.has_available(f.mem));
  uint16_t head = f.ring.add_chain({{test::kDataBase, 16, false}, {test::kDataBase + 0x1000, 512, true},
                                    {test::kDataBase + 0x2000, 1, true}});
  CHECK(f.q.has_available(f.mem));
  auto c = f.q.pop(f.mem);
  REQUIRE(c);
  CHECK(c->valid);
  CHECK(c->head == head);
  REQUIRE(c->descs.size() == 3);
  CHECK(c->descs[0].addr == test::kDataBase);
  CHECK(c->descs[0].len == 16);
  CHECK(!c->descs[0].write);
  CHECK(c->descs[1].write);
  CHECK(c->descs[2].len == 1);
  CHECK(c->readable_bytes() == 16);
  CHECK(c->writable_bytes() == 513);
  CHECK(f.q.next_avail == 1);
  CHECK(!f.q.pop(f.mem));
  CHECK(!f.q.has_available(f.mem));
}

TEST_CASE("virtqueue: nothing is popped from a queue that is not ready") {
  Fixture f;
  f.ring.add_chain({{test::kDataBase, 16, false}});
  f.q.ready = false;
  CHECK(!f.q.has_available(f.mem));
  CHECK(!f.q.pop(f.mem));
  CHECK(f.q.next_avail == 0);
}

TEST_CASE("virtqueue: head index out of range") {
  Fixture f;
  f.ring.push_avail(kSize);  // one past the table
  f.ring.push_avail(0xffff);
  for (int i = 0; i < 2; ++i) {
    auto c = f.q.pop(f.mem);
    REQUIRE(c);
    CHECK(!c->valid);
    CHECK(c->head < kSize);  // never an index the device could not complete
    CHECK(c->descs.empty());
  }
  CHECK(f.q.next_avail == 2);
  CHECK(!f.q.broken());
}

TEST_CASE("virtqueue: next index out of range") {
  Fixture f;
  f.ring.put_desc(3, test::kDataBase, 16, kDescFlagNext, kSize + 5);
  f.ring.push_avail(3);
  auto c = f.q.pop(f.mem);
  REQUIRE(c);
  CHECK(!c->valid);
  CHECK(c->head == 3);
}

TEST_CASE("virtqueue: a loop in the chain ends the walk") {
  Fixture f;
  f.ring.put_desc(0, test::kDataBase, 16, kDescFlagNext, 1);
  f.ring.put_desc(1, test::kDataBase, 16, kDescFlagNext, 2);
  f.ring.put_desc(2, test::kDataBase, 16, kDescFlagNext, 0);
  f.ring.push_avail(0);
  f.ring.put_desc(5, test::kDataBase, 16, kDescFlagNext, 5);  // a self loop
  f.ring.push_avail(5);
  for (uint16_t head : {0, 5}) {
    auto c = f.q.pop(f.mem);
    REQUIRE(c);
    CHECK(!c->valid);
    CHECK(c->head == head);
    CHECK(c->descs.size() <= kSize);
  }
}

TEST_CASE("virtqueue: a chain using every descriptor once is valid") {
  Fixture f;
  for (uint16_t i = 0; i < kSize; ++i)
    f.ring.put_desc(i, test::kDataBase + i * 64ull, 64, i + 1 < kSize ? kDescFlagNext : 0, i + 1);
  f.ring.push_avail(0);
  auto c = f.q.pop(f.mem);
  REQUIRE(c);
  CHECK(c->valid);
  CHECK(c->descs.size() == kSize);
  CHECK(c->readable_bytes() == 64ull * kSize);
}

TEST_CASE("virtqueue: buffers outside RAM make the chain invalid") {
  Fixture f;
  const uint64_t end = f.mem.size();
  struct Case {
    uint64_t addr;
    uint32_t len;
  } cases[] = {
      {end - 8, 16},             // runs past the end
      {end, 1},                  // just past
      {kMmioStart + 0x1000, 4},  // in the MMIO hole
      {UINT64_MAX - 3, 16},      // wraps
      {0, UINT32_MAX},           // longer than RAM
  };
  for (const Case& k : cases) {
    Fixture g;
    g.ring.add_chain({{test::kDataBase, 16, false}, {k.addr, k.len, true}});
    auto c = g.q.pop(g.mem);
    REQUIRE(c);
    CHECK(!c->valid);
  }
  // The last byte of RAM is fine.
  f.ring.add_chain({{end - 1, 1, true}});
  auto c = f.q.pop(f.mem);
  REQUIRE(c);
  CHECK(c->valid);
}

TEST_CASE("virtqueue: indirect descriptors are refused") {
  Fixture f;
  f.ring.put_desc(0, test::kDataBase, 16 * 4, kDescFlagIndirect, 0);
  f.ring.push_avail(0);
  f.ring.put_desc(1, test::kDataBase, 16, kDescFlagNext, 2);
  f.ring.put_desc(2, test::kDataBase, 16 * 4, kDescFlagIndirect | kDescFlagWrite, 0);
  f.ring.push_avail(1);
  for (int i = 0; i < 2; ++i) {
    auto c = f.q.pop(f.mem);
    REQUIRE(c);
    CHECK(!c->valid);
  }
}

TEST_CASE("virtqueue: an avail idx more than the ring size ahead breaks the queue") {
  Fixture f;
  f.ring.add_chain({{test::kDataBase, 16, false}});
  f.ring.set_avail_idx(kSize + 1);
  CHECK(!f.q.pop(f.mem));
  CHECK(f.q.broken());
  CHECK(f.q.next_avail == 0);
  f.ring.set_avail_idx(1);  // the driver cannot take it back
  CHECK(!f.q.pop(f.mem));
  CHECK(!f.q.has_available(f.mem));
  f.q.reset();
  CHECK(!f.q.broken());
  CHECK(!f.q.ready);
}

TEST_CASE("virtqueue: exactly a ring's worth of buffers is fine") {
  Fixture f;
  for (uint16_t i = 0; i < kSize; ++i) f.ring.add_chain({{test::kDataBase + i * 16ull, 16, false}});
  int n = 0;
  while (auto c = f.q.pop(f.mem)) {
    CHECK(c->valid);
    CHECK(c->head == n);
    ++n;
  }
  CHECK(n == kSize);
  CHECK(!f.q.broken());
}

TEST_CASE("virtqueue: the 16-bit ring indices wrap") {
  Fixture f;
  f.q.next_avail = 0xfffe;
  f.q.next_used = 0xfffe;
  for (uint16_t i = 0; i < 3; ++i) f.ring.put_desc(i, test::kDataBase + i * 16ull, 16, 0, 0);
  // Slots 0xfffe % 16 = 14, 15, then 0.
  REQUIRE(f.mem.write_obj<uint16_t>(test::avail_gpa(0) + 4 + 2 * 14, 0));
  REQUIRE(f.mem.write_obj<uint16_t>(test::avail_gpa(0) + 4 + 2 * 15, 1));
  REQUIRE(f.mem.write_obj<uint16_t>(test::avail_gpa(0) + 4 + 2 * 0, 2));
  f.ring.set_avail_idx(1);
  for (uint16_t want = 0; want < 3; ++want) {
    auto c = f.q.pop(f.mem);
    REQUIRE(c);
    CHECK(c->head == want);
    f.q.add_used(f.mem, c->head, 100u + want);
  }
  CHECK(!f.q.pop(f.mem));
  CHECK(f.q.next_avail == 1);
  CHECK(f.ring.used_idx() == 1);
  CHECK(f.ring.used_elem(14) == std::pair<uint32_t, uint32_t>{0, 100});
  CHECK(f.ring.used_elem(15) == std::pair<uint32_t, uint32_t>{1, 101});
  CHECK(f.ring.used_elem(0) == std::pair<uint32_t, uint32_t>{2, 102});
}

TEST_CASE("virtqueue: undo_pop returns the same chain again") {
  Fixture f;
  uint16_t head = f.ring.add_chain({{test::kDataBase, 16, true}});
  auto a = f.q.pop(f.mem);
  REQUIRE(a);
  f.q.undo_pop();
  auto b = f.q.pop(f.mem);
  REQUIRE(b);
  CHECK(b->head == head);
  CHECK(!f.q.pop(f.mem));
}

TEST_CASE("virtqueue: interrupt suppression follows the avail flags") {
  Fixture f;
  CHECK(!f.q.interrupt_suppressed(f.mem));
  f.ring.set_avail_flags(kAvailFlagNoInterrupt);
  CHECK(f.q.interrupt_suppressed(f.mem));
}

TEST_CASE("virtqueue: add_used on a queue that is not set up writes nothing") {
  Fixture f;
  Virtqueue q;  // size 0, not ready
  q.used_addr = test::used_gpa(0);
  q.add_used(f.mem, 1, 2);
  CHECK(q.next_used == 0);
  CHECK(f.ring.used_idx() == 0);
}

TEST_CASE("virtqueue: save and restore") {
  Fixture f;
  f.ring.add_chain({{test::kDataBase, 16, false}});
  auto c = f.q.pop(f.mem);
  REQUIRE(c);
  f.q.add_used(f.mem, c->head, 0);
  StateWriter w;
  f.q.save(w);
  Virtqueue r;
  StateReader rd(w.bytes().data(), w.bytes().size());
  REQUIRE(r.restore(rd));
  CHECK(rd.done());
  CHECK(r.size == kSize);
  CHECK(r.ready);
  CHECK(r.desc_addr == f.q.desc_addr);
  CHECK(r.avail_addr == f.q.avail_addr);
  CHECK(r.used_addr == f.q.used_addr);
  CHECK(r.next_avail == 1);
  CHECK(r.next_used == 1);
  CHECK(!r.broken());

  Virtqueue small;
  small.max_size = 8;  // the saved size 16 is over its maximum
  StateReader rd2(w.bytes().data(), w.bytes().size());
  CHECK(!small.restore(rd2));
  Virtqueue t;
  StateReader rd3(w.bytes().data(), w.bytes().size() - 1);
  CHECK(!t.restore(rd3));
}
