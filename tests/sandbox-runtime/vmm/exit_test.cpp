// handle_exit with made-up kvm_run blocks (Firecracker tests its
// handle_kvm_exit the same way): port I/O in and out, string I/O, the
// data_offset bounds, MMIO with unclaimed reads, malformed lengths, and
// every exit reason that stops the VM.
#include <doctest/doctest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "sandbox-runtime/vmm/devices/bus.h"
#include "sandbox-runtime/vmm/vm/exit.h"

using namespace sg::vmm;

namespace {

struct Access {
  bool write;
  uint64_t offset;
  std::vector<uint8_t> bytes;
};

// Reads answer 0xa0 + offset + i; writes are logged.
struct FakeDevice final : BusDevice {
  std::vector<Access> log;
  void read(uint64_t offset, uint8_t* data, size_t len) override {
    for (size_t i = 0; i < len; ++i) data[i] = static_cast<uint8_t>(0xa0 + offset + i);
    log.push_back({false, offset, std::vector<uint8_t>(data, data + len)});
  }
  void write(uint64_t offset, const uint8_t* data, size_t len) override {
    log.push_back({true, offset, std::vector<uint8_t>(data, data + len)});
  }
};

// A kvm_run block in a buffer the size of the real mapping's first page
// pair, with port-I/O data at kData as KVM puts it.
constexpr size_t kRunSize = 8192;
constexpr uint64_t kData = 4096;

struct Fixture {
  std::unique_ptr<uint8_t[]> buf{new uint8_t[kRunSize]()};
  kvm_run& run = *reinterpret_cast<kvm_run*>(buf.get());  // SAFETY: kvm_run is a C struct; the buffer is larger and zeroed
  FakeDevice serial, mmio_dev;
  Bus pio, mmio;
  std::string why;
  Fixture() {
    REQUIRE(pio.add(0x3f8, 8, &serial).ok());
    REQUIRE(mmio.add(0xd0000000, 0x1000, &mmio_dev).ok());
  }
  void io(uint8_t dir, uint16_t port, uint8_t size, uint32_t count, uint64_t data_offset = kData) {
    run.exit_reason = KVM_EXIT_IO;
    run.io.direction = dir;
    run.io.port = port;
    run.io.size = size;
    run.io.count = count;
    run.io.data_offset = data_offset;
  }
  void mmio_exit(uint64_t addr, uint32_t len, bool write) {
    run.exit_reason = KVM_EXIT_MMIO;
    run.mmio.phys_addr = addr;
    run.mmio.len = len;
    run.mmio.is_write = write;
  }
  ExitAction handle() { return handle_exit(run, kRunSize, pio, mmio, &why); }
};

static_assert(sizeof(kvm_run) <= kData);

}  // namespace

TEST_CASE("exit: port output goes to the device at its offset") {
  Fixture f;
  f.io(KVM_EXIT_IO_OUT, 0x3f8 + 3, 1, 1);
  f.buf[kData] = 0x83;
  CHECK(f.handle() == ExitAction::kContinue);
  REQUIRE(f.serial.log.size() == 1);
  CHECK(f.serial.log[0].write);
  CHECK(f.serial.log[0].offset == 3);
  CHECK(f.serial.log[0].bytes == std::vector<uint8_t>{0x83});
}

TEST_CASE("exit: string port output (rep outsb) writes each element to the same port") {
  Fixture f;
  f.io(KVM_EXIT_IO_OUT, 0x3f8, 1, 4);
  std::memcpy(&f.buf[kData], "boot", 4);
  CHECK(f.handle() == ExitAction::kContinue);
  REQUIRE(f.serial.log.size() == 4);
  for (size_t i = 0; i < 4; ++i) {
    CHECK(f.serial.log[i].offset == 0);
    CHECK(f.serial.log[i].bytes == std::vector<uint8_t>{static_cast<uint8_t>("boot"[i])});
  }
}

TEST_CASE("exit: port input fills the data area, element by element") {
  Fixture f;
  f.io(KVM_EXIT_IO_IN, 0x3f8 + 5, 2, 3);
  CHECK(f.handle() == ExitAction::kContinue);
  REQUIRE(f.serial.log.size() == 3);
  for (size_t i = 0; i < 3; ++i) {
    CHECK(f.buf[kData + 2 * i] == 0xa5);
    CHECK(f.buf[kData + 2 * i + 1] == 0xa6);
  }
  CHECK(f.buf[kData + 6] == 0);
}

TEST_CASE("exit: unclaimed ports read as all ones and drop writes") {
  Fixture f;
  f.io(KVM_EXIT_IO_IN, 0x80, 4, 1);
  CHECK(f.handle() == ExitAction::kContinue);
  CHECK(f.buf[kData] == 0xff);
  CHECK(f.buf[kData + 3] == 0xff);
  f.io(KVM_EXIT_IO_OUT, 0x80, 1, 1);
  CHECK(f.handle() == ExitAction::kContinue);
  f.io(KVM_EXIT_IO_IN, 0x3ff, 2, 1);  // half in the serial window
  CHECK(f.handle() == ExitAction::kContinue);
  CHECK(f.serial.log.empty());
}

TEST_CASE("exit: malformed port I/O exits fail the VM") {
  struct Case {
    uint8_t size;
    uint32_t count;
    uint64_t offset;
  } cases[] = {
      {1, 1, kRunSize + 1},           // data_offset past the mapping
      {4, 1, kRunSize - 3},           // data runs past the end
      {1, 2, kRunSize - 1},           // the second element does
      {4, 0xffffffff, kData},         // a huge count
      {3, 1, kData},                  // no 3-byte port access
      {8, 1, kData},
      {0, 1, kData},
      {1, 0, kData},                  // nothing to do is not a real exit either
      {1, 1, UINT64_MAX},
  };
  for (const Case& c : cases) {
    Fixture f;
    CAPTURE(c.offset);
    f.io(KVM_EXIT_IO_IN, 0x3f8, c.size, c.count, c.offset);
    CHECK(f.handle() == ExitAction::kFailed);
    CHECK(!f.why.empty());
    CHECK(f.serial.log.empty());
  }
  Fixture f;  // the last bytes of the mapping are fine
  f.io(KVM_EXIT_IO_IN, 0x3f8, 4, 1, kRunSize - 4);
  CHECK(f.handle() == ExitAction::kContinue);
  f.io(KVM_EXIT_IO_OUT, 0x3f8, 1, 1, kRunSize);  // zero bytes left: refused
  CHECK(f.handle() == ExitAction::kFailed);
}

TEST_CASE("exit: MMIO reads and writes reach the device") {
  Fixture f;
  f.mmio_exit(0xd0000070, 4, true);
  std::memcpy(f.run.mmio.data, "\x0f\0\0\0", 4);
  CHECK(f.handle() == ExitAction::kContinue);
  REQUIRE(f.mmio_dev.log.size() == 1);
  CHECK(f.mmio_dev.log[0].offset == 0x70);
  CHECK(f.mmio_dev.log[0].bytes == std::vector<uint8_t>{0x0f, 0, 0, 0});
  f.mmio_exit(0xd0000100, 8, false);
  CHECK(f.handle() == ExitAction::kContinue);
  CHECK(f.run.mmio.data[0] == 0xa0);
  CHECK(f.run.mmio.data[7] == 0xa7);
}

TEST_CASE("exit: unclaimed MMIO reads as zeros") {
  Fixture f;
  std::memset(f.run.mmio.data, 0x55, 8);
  f.mmio_exit(0xfee00000, 4, false);
  CHECK(f.handle() == ExitAction::kContinue);
  for (int i = 0; i < 4; ++i) CHECK(f.run.mmio.data[i] == 0);
  std::memset(f.run.mmio.data, 0x55, 8);
  f.mmio_exit(0xd0000ffc, 8, false);  // runs past the device's window
  CHECK(f.handle() == ExitAction::kContinue);
  for (int i = 0; i < 8; ++i) CHECK(f.run.mmio.data[i] == 0);
  f.mmio_exit(0xfee00000, 4, true);
  CHECK(f.handle() == ExitAction::kContinue);
  CHECK(f.mmio_dev.log.empty());
}

TEST_CASE("exit: MMIO of length 0 or over 8 fails the VM") {
  for (uint32_t len : {0u, 9u, 16u, 0xffffffffu}) {
    Fixture f;
    f.mmio_exit(0xd0000000, len, false);
    CHECK(f.handle() == ExitAction::kFailed);
    CHECK(!f.why.empty());
    CHECK(f.mmio_dev.log.empty());
  }
}

TEST_CASE("exit: shutdown, halt and system events stop the VM") {
  for (uint32_t reason : {KVM_EXIT_SHUTDOWN, KVM_EXIT_HLT, KVM_EXIT_SYSTEM_EVENT}) {
    Fixture f;
    f.run.exit_reason = reason;
    f.run.system_event.type = KVM_SYSTEM_EVENT_RESET;
    CHECK(f.handle() == ExitAction::kShutdown);
    CHECK(!f.why.empty());
  }
  Fixture f;
  f.run.exit_reason = KVM_EXIT_SYSTEM_EVENT;
  f.run.system_event.type = KVM_SYSTEM_EVENT_SHUTDOWN;
  CHECK(f.handle() == ExitAction::kShutdown);
  CHECK(f.why.find(std::to_string(KVM_SYSTEM_EVENT_SHUTDOWN)) != std::string::npos);
}

TEST_CASE("exit: a signal interrupting KVM_RUN just re-enters") {
  Fixture f;
  f.run.exit_reason = KVM_EXIT_INTR;
  CHECK(f.handle() == ExitAction::kContinue);
}

TEST_CASE("exit: entry failures, internal errors and unknown exits fail the VM") {
  Fixture f;
  f.run.exit_reason = KVM_EXIT_FAIL_ENTRY;
  f.run.fail_entry.hardware_entry_failure_reason = 7;
  CHECK(f.handle() == ExitAction::kFailed);
  CHECK(f.why.find("FAIL_ENTRY") != std::string::npos);
  f.run.exit_reason = KVM_EXIT_INTERNAL_ERROR;
  f.run.internal.suberror = KVM_INTERNAL_ERROR_EMULATION;
  CHECK(f.handle() == ExitAction::kFailed);
  CHECK(f.why.find("INTERNAL_ERROR") != std::string::npos);
  for (uint32_t reason : {uint32_t{KVM_EXIT_UNKNOWN}, uint32_t{KVM_EXIT_DEBUG}, 0xdeadu}) {
    f.why.clear();
    f.run.exit_reason = reason;
    CHECK(f.handle() == ExitAction::kFailed);
    CHECK(f.why.find(std::to_string(reason)) != std::string::npos);
  }
}
