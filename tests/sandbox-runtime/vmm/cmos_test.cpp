// Cmos (MC146818 RTC): BCD time from an injected clock, the status
// registers, NVRAM, read-only clock registers, index masking, save/restore.
#include <doctest/doctest.h>

#include <cstdint>

#include "sandbox-runtime/vmm/devices/cmos.h"

using namespace sg::vmm;

namespace {

// 2026-12-01 08:09:10 UTC, a Tuesday.
constexpr int64_t kTuesday = 1796112550;

uint8_t reg(Cmos& c, uint8_t index) {
  c.write(0, &index, 1);
  uint8_t v = 0;
  c.read(1, &v, 1);
  return v;
}
void set_reg(Cmos& c, uint8_t index, uint8_t v) {
  c.write(0, &index, 1);
  c.write(1, &v, 1);
}

}  // namespace

TEST_CASE("cmos: the clock reads the injected time in BCD") {
  Cmos c([] { return kTuesday; });
  CHECK(reg(c, 0x00) == 0x10);  // seconds
  CHECK(reg(c, 0x02) == 0x09);  // minutes
  CHECK(reg(c, 0x04) == 0x08);  // hours, 24-hour mode
  CHECK(reg(c, 0x06) == 0x03);  // weekday, 1 = Sunday
  CHECK(reg(c, 0x07) == 0x01);  // day of month
  CHECK(reg(c, 0x08) == 0x12);  // month
  CHECK(reg(c, 0x09) == 0x26);  // year
  CHECK(reg(c, 0x32) == 0x20);  // century
  CHECK(reg(c, 0x01) == 0x00);  // alarm registers
  CHECK(reg(c, 0x03) == 0x00);
  CHECK(reg(c, 0x05) == 0x00);
}

TEST_CASE("cmos: every read samples the clock") {
  int64_t now = kTuesday + 49;  // 08:09:59
  Cmos c([&] { return now; });
  CHECK(reg(c, 0x00) == 0x59);
  now += 1;
  CHECK(reg(c, 0x00) == 0x00);
  CHECK(reg(c, 0x02) == 0x10);
  now = 946684799;  // 1999-12-31 23:59:59
  CHECK(reg(c, 0x09) == 0x99);
  CHECK(reg(c, 0x32) == 0x19);
  CHECK(reg(c, 0x04) == 0x23);
}

TEST_CASE("cmos: status registers") {
  Cmos c([] { return kTuesday; });
  CHECK(reg(c, 0x0a) == 0x26);  // no update in progress
  CHECK(reg(c, 0x0b) == 0x02);  // 24-hour, BCD
  CHECK(reg(c, 0x0c) == 0x00);
  CHECK(reg(c, 0x0d) == 0x80);  // valid RAM and time
}

TEST_CASE("cmos: clock and status registers are read-only") {
  Cmos c([] { return kTuesday; });
  for (uint8_t i : {0x00, 0x02, 0x04, 0x07, 0x09, 0x0a, 0x0b, 0x0c, 0x0d, 0x32}) set_reg(c, i, 0x55);
  CHECK(reg(c, 0x00) == 0x10);
  CHECK(reg(c, 0x04) == 0x08);
  CHECK(reg(c, 0x09) == 0x26);
  CHECK(reg(c, 0x0a) == 0x26);
  CHECK(reg(c, 0x0b) == 0x02);
  CHECK(reg(c, 0x0d) == 0x80);
  CHECK(reg(c, 0x32) == 0x20);
}

TEST_CASE("cmos: NVRAM bytes are kept") {
  Cmos c([] { return kTuesday; });
  CHECK(reg(c, 0x40) == 0x00);
  set_reg(c, 0x0e, 0x11);
  set_reg(c, 0x40, 0xab);
  set_reg(c, 0x7f, 0xcd);
  CHECK(reg(c, 0x0e) == 0x11);
  CHECK(reg(c, 0x40) == 0xab);
  CHECK(reg(c, 0x7f) == 0xcd);
  CHECK(reg(c, 0x41) == 0x00);
}

TEST_CASE("cmos: the NMI-mask bit of the index is ignored") {
  Cmos c([] { return kTuesday; });
  set_reg(c, 0x40, 0xab);
  uint8_t idx = 0x80 | 0x40;
  c.write(0, &idx, 1);
  uint8_t v = 0;
  c.read(0, &v, 1);
  CHECK(v == 0x40);
  c.read(1, &v, 1);
  CHECK(v == 0xab);
  CHECK(reg(c, 0x80) == 0x10);  // 0x80 is index 0: seconds
  set_reg(c, 0xff, 0x99);       // index 0x7f
  CHECK(reg(c, 0x7f) == 0x99);
  uint8_t wide[2] = {};
  c.read(1, wide, 2);
  CHECK(wide[0] == 0x99);
  CHECK(wide[1] == 0xff);
}

TEST_CASE("cmos: save and restore keep the index and NVRAM") {
  Cmos a([] { return kTuesday; });
  set_reg(a, 0x50, 0x42);
  set_reg(a, 0x7e, 0x24);
  uint8_t idx = 0x50;
  a.write(0, &idx, 1);
  StateWriter w;
  a.save(w);
  Cmos b([] { return kTuesday; });
  StateReader r(w.bytes().data(), w.bytes().size());
  REQUIRE(b.restore(r));
  CHECK(r.done());
  uint8_t v = 0;
  b.read(1, &v, 1);  // the restored index still selects 0x50
  CHECK(v == 0x42);
  CHECK(reg(b, 0x7e) == 0x24);

  StateReader t(w.bytes().data(), w.bytes().size() - 1);
  Cmos d;
  CHECK(!d.restore(t));
  std::vector<uint8_t> bad = w.bytes();
  bad[0] = 0xd0;  // hostile index: masked to 0x50
  Cmos e;
  StateReader u(bad.data(), bad.size());
  REQUIRE(e.restore(u));
  e.read(1, &v, 1);
  CHECK(v == 0x42);
}
