// Bus: window overlap rejection, lookups at the edges of a window, and
// the unclaimed-access answers (reads all ones, writes dropped).
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "sandbox-runtime/vmm/devices/bus.h"

using namespace sg::vmm;

namespace {

struct Access {
  bool write;
  uint64_t offset;
  size_t len;
};

// Records accesses; reads answer offset + i in byte i.
struct RecordingDevice final : BusDevice {
  std::vector<Access> log;
  void read(uint64_t offset, uint8_t* data, size_t len) override {
    log.push_back({false, offset, len});
    for (size_t i = 0; i < len; ++i) data[i] = static_cast<uint8_t>(offset + i);
  }
  void write(uint64_t offset, const uint8_t*, size_t len) override { log.push_back({true, offset, len}); }
};

}  // namespace

TEST_CASE("bus: overlapping, empty and wrapping windows are rejected") {
  Bus bus;
  RecordingDevice a, b;
  REQUIRE(bus.add(0x3f8, 8, &a).ok());
  CHECK(!bus.add(0x3f8, 8, &b).ok());        // same window
  CHECK(!bus.add(0x3ff, 1, &b).ok());        // last byte
  CHECK(!bus.add(0x3f0, 9, &b).ok());        // runs into the first byte
  CHECK(!bus.add(0x3fa, 2, &b).ok());        // inside
  CHECK(!bus.add(0x300, 0x200, &b).ok());    // covers it
  CHECK(!bus.add(0x500, 0, &b).ok());        // empty
  CHECK(!bus.add(UINT64_MAX - 3, 8, &b).ok());  // wraps past 2^64
  CHECK(bus.add(0x3f0, 8, &b).ok());         // ends exactly where a starts
  CHECK(bus.add(0x400, 1, &b).ok());         // starts exactly where a ends
}

TEST_CASE("bus: lookups at the edges of a window") {
  Bus bus;
  RecordingDevice d, low;
  REQUIRE(bus.add(0x1000, 0x100, &d).ok());
  REQUIRE(bus.add(0x0f00, 0x100, &low).ok());  // adjacent below
  CHECK(bus.find(0x1000, 1).device == &d);
  CHECK(bus.find(0x1000, 1).offset == 0);
  CHECK(bus.find(0x10ff, 1).device == &d);
  CHECK(bus.find(0x10ff, 1).offset == 0xff);
  CHECK(bus.find(0x10f8, 8).device == &d);
  CHECK(bus.find(0x1000, 0x100).device == &d);
  CHECK(bus.find(0x10ff, 2).device == nullptr);    // crosses the end
  CHECK(bus.find(0x1000, 0x101).device == nullptr);
  CHECK(bus.find(0x1100, 1).device == nullptr);    // just past
  CHECK(bus.find(0x0fff, 2).device == nullptr);    // straddles two windows
  CHECK(bus.find(0x0fff, 1).device == &low);
  CHECK(bus.find(0x0eff, 1).device == nullptr);    // below everything
  CHECK(bus.find(0x1001, UINT64_MAX).device == nullptr);
  CHECK(bus.find(UINT64_MAX, 8).device == nullptr);
  CHECK(bus.find(0, 1).device == nullptr);
}

TEST_CASE("bus: unclaimed reads are all ones, unclaimed writes are dropped") {
  Bus bus;
  RecordingDevice d;
  REQUIRE(bus.add(0x60, 5, &d).ok());
  uint8_t buf[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  CHECK(!bus.read(0x70, buf, 8));
  for (uint8_t b : buf) CHECK(b == 0xff);
  CHECK(!bus.write(0x70, buf, 4));
  CHECK(!bus.read(0x63, buf, 4));  // starts inside, ends outside
  CHECK(d.log.empty());

  CHECK(bus.read(0x62, buf, 2));
  CHECK(buf[0] == 2);
  CHECK(buf[1] == 3);
  CHECK(bus.write(0x64, buf, 1));
  REQUIRE(d.log.size() == 2);
  CHECK(!d.log[0].write);
  CHECK(d.log[0].offset == 2);
  CHECK(d.log[1].write);
  CHECK(d.log[1].offset == 4);
  CHECK(d.log[1].len == 1);
}
