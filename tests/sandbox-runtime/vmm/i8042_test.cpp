// I8042: the CTR read/write commands, the self tests, the status register's
// output-full bit, and the reset line.
#include <doctest/doctest.h>

#include "sandbox-runtime/vmm/devices/i8042.h"

using namespace sg::vmm;

namespace {

constexpr uint64_t kData = 0, kCmd = 4;

uint8_t rd(I8042& d, uint64_t off) {
  uint8_t v = 0;
  d.read(off, &v, 1);
  return v;
}
void wr(I8042& d, uint64_t off, uint8_t v) { d.write(off, &v, 1); }

}  // namespace

TEST_CASE("i8042: CTR written with 0x60 reads back with 0x20") {
  int resets = 0;
  I8042 d([&] { ++resets; });
  CHECK(rd(d, kCmd) == 0x04);  // system flag, output empty
  wr(d, kCmd, 0x20);
  CHECK(rd(d, kCmd) == 0x05);  // output full
  CHECK(rd(d, kData) == 0x00);
  CHECK(rd(d, kCmd) == 0x04);  // reading the data port emptied it

  wr(d, kCmd, 0x60);
  wr(d, kData, 0x47);
  wr(d, kCmd, 0x20);
  CHECK(rd(d, kData) == 0x47);

  wr(d, kData, 0x11);  // a data byte with no 0x60 before it: not the CTR
  wr(d, kCmd, 0x20);
  CHECK(rd(d, kData) == 0x47);
  CHECK(resets == 0);
}

TEST_CASE("i8042: self tests answer") {
  I8042 d(nullptr);
  wr(d, kCmd, 0xaa);
  CHECK(rd(d, kData) == 0x55);
  wr(d, kCmd, 0xab);
  CHECK(rd(d, kData) == 0x00);
  wr(d, kCmd, 0xa9);
  CHECK(rd(d, kCmd) == 0x05);
  CHECK(rd(d, kData) == 0x00);
  for (uint8_t c : {0xad, 0xae, 0xa7, 0xa8, 0x00}) wr(d, kCmd, c);  // accepted, no reply
  CHECK(rd(d, kCmd) == 0x04);
  CHECK(rd(d, 2) == 0xff);  // offsets 1..3 are not registers
  wr(d, kCmd, 0xfe);        // no callback: nothing to do, no crash
}

TEST_CASE("i8042: 0xfe pulses the reset line once, outside the device lock") {
  int resets = 0;
  I8042* dev = nullptr;
  uint8_t status_in_callback = 0;
  I8042 d([&] {
    ++resets;
    status_in_callback = rd(*dev, kCmd);  // would deadlock if called under the lock
  });
  dev = &d;
  wr(d, kCmd, 0x20);
  CHECK(resets == 0);
  wr(d, kData, 0xfe);  // on the data port it is just a byte
  CHECK(resets == 0);
  wr(d, kCmd, 0xfe);
  CHECK(resets == 1);
  CHECK(status_in_callback == 0x05);
  uint8_t none = 0xfe;
  d.write(kCmd, &none, 0);
  CHECK(resets == 1);
}
