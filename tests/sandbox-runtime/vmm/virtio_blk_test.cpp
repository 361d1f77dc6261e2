// VirtioBlk over a temp file, driven through the transport like Linux's
// virtio_blk: reads and writes at the right offsets, read-only disks,
// every malformed request (past the end, partial sectors, wrong-direction
// buffers, missing status byte), GET_ID, FLUSH, unknown types, used
// lengths, and a broken ring.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "sandbox-runtime/vmm/devices/virtio_blk.h"
#include "tests/support/temp_dir.h"
#include "base/fd.h"
#include "tests/sandbox-runtime/vmm/vmm_harness.h"

using namespace sg;
using namespace sg::vmm;
using namespace sg::vmm::test;

namespace {

constexpr uint32_t kIn = 0, kOut = 1, kFlush = 4, kGetId = 8;
constexpr uint8_t kOk = 0, kIoErr = 1, kUnsupp = 2;
constexpr uint64_t kSectors = 64;
constexpr uint64_t kHdr = kDataBase, kStatus = kDataBase + 0x100, kBuf = kDataBase + 0x10000;

uint8_t disk_byte(uint64_t off) { return static_cast<uint8_t>(off * 7 + (off >> 9)); }

struct Fixture {
  sg::test::TempDir dir;
  std::string path = dir.sub("disk.img");
  UniqueFd fd;
  GuestMemory mem = make_ram();
  FakeIrq irq;
  VirtioBlk blk;
  VirtioMmio t;
  Driver drv{t, mem};

  explicit Fixture(bool read_only = false, std::string id = "sandgate-disk-0")
      : fd(open_disk(path, read_only)), blk(fd.get(), kSectors * 512 + 100, read_only, std::move(id)), t(mem, irq, blk) {
    drv.bring_up(1);
  }
  static int open_disk(const std::string& path, bool read_only) {
    {
      UniqueFd w(::open(path.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0600));
      REQUIRE(w);
      std::string data(kSectors * 512 + 100, '\0');
      for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(disk_byte(i));
      REQUIRE(::pwrite(w.get(), data.data(), data.size(), 0) == static_cast<ssize_t>(data.size()));
    }
    int fd = ::open(path.c_str(), (read_only ? O_RDONLY : O_RDWR) | O_CLOEXEC);
    REQUIRE(fd >= 0);
    return fd;
  }
  std::string file() const {
    std::string s(kSectors * 512 + 100, '\0');
    REQUIRE(::pread(fd.get(), s.data(), s.size(), 0) == static_cast<ssize_t>(s.size()));
    return s;
  }
  void header(uint32_t type, uint64_t sector) {
    uint8_t h[16] = {};
    std::memcpy(h, &type, 4);
    std::memcpy(h + 8, &sector, 8);
    REQUIRE(mem.write(kHdr, h, 16));
    REQUIRE(mem.write_obj<uint8_t>(kStatus, 0xee));
  }
  uint8_t status() const {
    uint8_t s = 0;
    REQUIRE(mem.read_obj(kStatus, &s));
    return s;
  }
  // Submits one chain, notifies and returns the used length.
  uint32_t submit(const std::vector<Buf>& bufs) {
    uint16_t before = drv.ring(0).used_idx();
    uint16_t head = drv.add_chain(0, bufs);
    drv.notify(0);
    REQUIRE(drv.ring(0).used_idx() == static_cast<uint16_t>(before + 1));
    auto [id, len] = drv.ring(0).used_elem(before);
    CHECK(id == head);
    return len;
  }
  uint8_t* guest(uint64_t gpa, uint64_t len) { return mem.span(gpa, len); }
};

Buf hdr() { return {kHdr, 16, false}; }
Buf status_buf() { return {kStatus, 1, true}; }

}  // namespace

TEST_CASE("virtio-blk: features and config space") {
  Fixture f;
  uint64_t feat = f.drv.device_features();
  CHECK((feat & kVirtioFVersion1) != 0);
  CHECK((feat & (1ull << 9)) != 0);   // FLUSH
  CHECK((feat & (1ull << 6)) != 0);   // BLK_SIZE
  CHECK((feat & (1ull << 2)) != 0);   // SEG_MAX
  CHECK((feat & (1ull << 5)) == 0);   // not read-only
  CHECK(f.drv.r32(kRegDeviceId) == 2);
  CHECK(f.drv.r32(kRegConfig + 0x00) == kSectors);  // capacity rounds down to whole sectors
  CHECK(f.drv.r32(kRegConfig + 0x04) == 0);
  CHECK(f.drv.r32(kRegConfig + 0x0c) == 126);
  CHECK(f.drv.r32(kRegConfig + 0x14) == 512);
  CHECK(f.drv.r32(kRegConfig + 0x100) == 0);  // past the config struct
  uint8_t b = 0xaa;
  f.t.read(kRegConfig + 0x15, &b, 1);
  CHECK(b == 0x02);
  Fixture ro(true);
  CHECK((ro.drv.device_features() & (1ull << 5)) != 0);
}

TEST_CASE("virtio-blk: IN reads the right sectors into every data buffer") {
  Fixture f;
  f.header(kIn, 3);
  std::memset(f.guest(kBuf, 0x3000), 0x55, 0x3000);
  uint32_t len = f.submit({hdr(), {kBuf, 512, true}, {kBuf + 0x1000, 1024, true}, status_buf()});
  CHECK(f.status() == kOk);
  CHECK(len == 512 + 1024 + 1);
  for (uint64_t i = 0; i < 512; ++i) REQUIRE(f.guest(kBuf, 512)[i] == disk_byte(3 * 512 + i));
  for (uint64_t i = 0; i < 1024; ++i) REQUIRE(f.guest(kBuf + 0x1000, 1024)[i] == disk_byte(4 * 512 + i));
  CHECK(f.guest(kBuf + 512, 1)[0] == 0x55);  // nothing past the buffer
  CHECK(f.blk.requests() == 1);
  CHECK(f.blk.errors() == 0);
}

TEST_CASE("virtio-blk: OUT writes the guest's bytes at the right offset and nothing else") {
  Fixture f;
  std::string before = f.file();
  f.header(kOut, 5);
  std::memset(f.guest(kBuf, 512), 'A', 512);
  std::memset(f.guest(kBuf + 0x1000, 512), 'B', 512);
  uint32_t len = f.submit({hdr(), {kBuf, 512, false}, {kBuf + 0x1000, 512, false}, status_buf()});
  CHECK(f.status() == kOk);
  CHECK(len == 1);  // the device wrote only the status byte
  std::string after = f.file();
  CHECK(after.substr(0, 5 * 512) == before.substr(0, 5 * 512));
  CHECK(after.substr(5 * 512, 512) == std::string(512, 'A'));
  CHECK(after.substr(6 * 512, 512) == std::string(512, 'B'));
  CHECK(after.substr(7 * 512) == before.substr(7 * 512));
}

TEST_CASE("virtio-blk: a read-only disk refuses OUT and keeps its bytes") {
  Fixture f(true);
  std::string before = f.file();
  f.header(kOut, 0);
  std::memset(f.guest(kBuf, 512), 'X', 512);
  uint32_t len = f.submit({hdr(), {kBuf, 512, false}, status_buf()});
  CHECK(f.status() == kIoErr);
  CHECK(len == 1);
  CHECK(f.file() == before);
  CHECK(f.blk.errors() == 1);
  f.header(kIn, 0);  // reads still work
  CHECK(f.submit({hdr(), {kBuf, 512, true}, status_buf()}) == 513);
  CHECK(f.status() == kOk);
  f.header(kFlush, 0);
  CHECK(f.submit({hdr(), status_buf()}) == 1);
  CHECK(f.status() == kOk);
}

TEST_CASE("virtio-blk: requests past the end of the disk fail") {
  Fixture f;
  std::string before = f.file();
  struct Case {
    uint32_t type;
    uint64_t sector;
    uint32_t len;
  } cases[] = {
      {kIn, kSectors - 1, 1024}, {kIn, kSectors, 512},      {kOut, kSectors - 1, 1024},
      {kIn, UINT64_MAX, 512},    {kOut, UINT64_MAX / 512 + 1, 512}, {kIn, kSectors + 1, 0},
  };
  for (const Case& c : cases) {
    f.header(c.type, c.sector);
    std::memset(f.guest(kBuf, 1024), 0x33, 1024);
    std::vector<Buf> bufs{hdr()};
    if (c.len) bufs.push_back({kBuf, c.len, c.type == kIn});
    bufs.push_back(status_buf());
    CHECK(f.submit(bufs) == 1);
    CHECK(f.status() == kIoErr);
    CHECK(f.guest(kBuf, 1)[0] == 0x33);
  }
  CHECK(f.file() == before);
  f.header(kIn, kSectors - 2);  // the last two sectors are fine
  CHECK(f.submit({hdr(), {kBuf, 1024, true}, status_buf()}) == 1025);
  CHECK(f.status() == kOk);
}

TEST_CASE("virtio-blk: data that is not a multiple of 512 bytes fails and touches nothing") {
  Fixture f;
  std::string before = f.file();
  f.header(kIn, 0);
  std::memset(f.guest(kBuf, 1024), 0x44, 1024);
  CHECK(f.submit({hdr(), {kBuf, 512, true}, {kBuf + 512, 100, true}, status_buf()}) == 1);
  CHECK(f.status() == kIoErr);
  CHECK(f.guest(kBuf, 1)[0] == 0x44);
  f.header(kOut, 0);
  CHECK(f.submit({hdr(), {kBuf, 511, false}, status_buf()}) == 1);
  CHECK(f.status() == kIoErr);
  CHECK(f.file() == before);
}

TEST_CASE("virtio-blk: a data buffer of the wrong direction fails the request") {
  Fixture f;
  f.header(kIn, 0);
  std::memset(f.guest(kBuf, 512), 0x66, 512);
  CHECK(f.submit({hdr(), {kBuf, 512, false}, status_buf()}) == 1);  // IN into a device-readable buffer
  CHECK(f.status() == kIoErr);
  CHECK(f.guest(kBuf, 1)[0] == 0x66);
  f.header(kOut, 0);
  std::string before = f.file();
  CHECK(f.submit({hdr(), {kBuf, 512, true}, status_buf()}) == 1);
  CHECK(f.status() == kIoErr);
  CHECK(f.file() == before);
}

// Regression: the direction of each data buffer was checked only when its
// turn came, so an OUT whose second buffer was device-writable wrote the
// first buffer to the disk and then failed with IOERR, and an IN filled
// its first buffer before failing on the second.
TEST_CASE("virtio-blk: a wrong-direction buffer after a good one touches nothing") {
  Fixture f;
  std::string before = f.file();
  f.header(kOut, 2);
  std::memset(f.guest(kBuf, 1024), 'W', 1024);
  CHECK(f.submit({hdr(), {kBuf, 512, false}, {kBuf + 512, 512, true}, status_buf()}) == 1);
  CHECK(f.status() == kIoErr);
  CHECK(f.file() == before);

  f.header(kIn, 2);
  std::memset(f.guest(kBuf, 1024), 0x77, 1024);
  CHECK(f.submit({hdr(), {kBuf, 512, true}, {kBuf + 512, 512, false}, status_buf()}) == 1);
  CHECK(f.status() == kIoErr);
  CHECK(f.guest(kBuf, 1)[0] == 0x77);
}

TEST_CASE("virtio-blk: a bad header fails the request") {
  Fixture f;
  f.header(kIn, 0);
  CHECK(f.submit({{kHdr, 16, true}, {kBuf, 512, true}, status_buf()}) == 1);  // header device-writable
  CHECK(f.status() == kIoErr);
  f.header(kIn, 0);
  CHECK(f.submit({{kHdr, 8, false}, {kBuf, 512, true}, status_buf()}) == 1);  // header too short
  CHECK(f.status() == kIoErr);
}

TEST_CASE("virtio-blk: GET_ID") {
  Fixture f;
  f.header(kGetId, 0);
  std::memset(f.guest(kBuf, 32), 0xcc, 32);
  CHECK(f.submit({hdr(), {kBuf, 20, true}, status_buf()}) == 21);
  CHECK(f.status() == kOk);
  std::string id(reinterpret_cast<const char*>(f.guest(kBuf, 20)), 20);
  CHECK(id == std::string("sandgate-disk-0") + std::string(5, '\0'));  // NUL-padded to 20
  CHECK(f.guest(kBuf + 20, 1)[0] == 0xcc);

  f.header(kGetId, 0);  // a short buffer gets a prefix
  std::memset(f.guest(kBuf, 32), 0xcc, 32);
  CHECK(f.submit({hdr(), {kBuf, 8, true}, status_buf()}) == 9);
  CHECK(std::string(reinterpret_cast<const char*>(f.guest(kBuf, 8)), 8) == "sandgate");
  CHECK(f.guest(kBuf + 8, 1)[0] == 0xcc);

  f.header(kGetId, 0);  // no buffer, or a device-readable one
  CHECK(f.submit({hdr(), status_buf()}) == 1);
  CHECK(f.status() == kIoErr);
  f.header(kGetId, 0);
  CHECK(f.submit({hdr(), {kBuf, 20, false}, status_buf()}) == 1);
  CHECK(f.status() == kIoErr);

  Fixture longid(false, std::string(40, 'L'));  // an id over 20 bytes is cut, not overrun
  longid.header(kGetId, 0);
  std::memset(longid.guest(kBuf, 32), 0, 32);
  CHECK(longid.submit({hdr(), {kBuf, 32, true}, status_buf()}) == 21);
  CHECK(longid.guest(kBuf + 19, 1)[0] == 'L');
  CHECK(longid.guest(kBuf + 20, 1)[0] == 0);
}

TEST_CASE("virtio-blk: FLUSH and unknown types") {
  Fixture f;
  f.header(kFlush, 0);
  CHECK(f.submit({hdr(), status_buf()}) == 1);
  CHECK(f.status() == kOk);
  f.header(0x99, 0);
  CHECK(f.submit({hdr(), status_buf()}) == 1);
  CHECK(f.status() == kUnsupp);
  f.header(11, 0);  // DISCARD: not offered
  CHECK(f.submit({hdr(), {kBuf, 16, false}, status_buf()}) == 1);
  CHECK(f.status() == kUnsupp);
  CHECK(f.blk.errors() == 2);
}

TEST_CASE("virtio-blk: a chain without a status byte is completed with length 0") {
  Fixture f;
  f.header(kIn, 0);
  std::memset(f.guest(kBuf, 512), 0x12, 512);
  CHECK(f.submit({hdr(), {kBuf, 512, false}}) == 0);  // last buffer device-readable
  CHECK(f.guest(kBuf, 1)[0] == 0x12);
  CHECK(f.submit({hdr()}) == 0);                      // a header alone
  CHECK(f.submit({hdr(), {kStatus, 0, true}}) == 0);  // a zero-length status buffer
  CHECK(f.status() == 0xee);
  CHECK(f.blk.errors() == 3);
}

TEST_CASE("virtio-blk: malformed chains are completed with length 0 and the queue goes on") {
  Fixture f;
  f.header(kIn, 0);
  Ring& r = f.drv.ring(0);
  r.put_desc(0, kHdr, 16, kDescFlagIndirect, 0);
  r.push_avail(0);
  r.put_desc(1, kHdr, 16, kDescFlagNext, 1);  // self loop
  r.push_avail(1);
  r.put_desc(2, kHdr, 16, kDescFlagNext, 3);
  r.put_desc(3, kMmioStart, 512, kDescFlagNext | kDescFlagWrite, 4);  // outside RAM
  r.put_desc(4, kStatus, 1, kDescFlagWrite, 0);
  r.push_avail(2);
  r.put_desc(5, kHdr, 16, kDescFlagNext, 6);  // a good one after them
  r.put_desc(6, kStatus, 1, kDescFlagWrite, 0);
  r.push_avail(5);
  int irqs = f.irq.count();
  f.drv.notify(0);
  REQUIRE(r.used_idx() == 4);
  for (uint16_t i = 0; i < 3; ++i) CHECK(r.used_elem(i).second == 0);
  CHECK(r.used_elem(3) == std::pair<uint32_t, uint32_t>{5, 1});
  CHECK(f.status() == kOk);
  CHECK(f.irq.count() == irqs + 1);  // one interrupt for the batch
  CHECK(f.drv.ack_interrupt() == 1);
  CHECK(f.blk.requests() == 4);
  CHECK(f.blk.errors() == 3);
}

TEST_CASE("virtio-blk: an avail idx far ahead breaks the queue and asks for a reset") {
  Fixture f;
  f.drv.ring(0).set_avail_idx(100);  // a 16-entry ring
  f.drv.notify(0);
  CHECK(f.drv.ring(0).used_idx() == 0);
  CHECK(f.t.queue(0).broken());
  CHECK((f.drv.status() & kVirtioStatusNeedsReset) != 0);
  CHECK((f.drv.r32(kRegInterruptStatus) & 2) != 0);
  CHECK(f.irq.count() >= 1);
  f.drv.bring_up(1);  // a reset recovers it
  CHECK(!f.t.queue(0).broken());
  f.header(kFlush, 0);
  CHECK(f.submit({hdr(), status_buf()}) == 1);
}
