// Serial (16550A): transmit to a sink fd, the output limit, the THR-empty
// interrupt and its IIR acknowledgement, LSR/MSR values, the DLAB switch,
// and save/restore.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <string>

#include "sandbox-runtime/vmm/devices/serial.h"
#include "base/fd.h"
#include "tests/sandbox-runtime/vmm/vmm_harness.h"

using namespace sg;
using namespace sg::vmm;

namespace {

constexpr uint64_t kThr = 0, kIer = 1, kIir = 2, kLcr = 3, kMcr = 4, kLsr = 5, kMsr = 6, kScr = 7;

uint8_t rd(Serial& s, uint64_t off) {
  uint8_t v = 0;
  s.read(off, &v, 1);
  return v;
}
void wr(Serial& s, uint64_t off, uint8_t v) { s.write(off, &v, 1); }

struct Pipe {
  UniqueFd r, w;
  Pipe() {
    int fds[2];
    REQUIRE(::pipe2(fds, O_CLOEXEC | O_NONBLOCK) == 0);
    r.reset(fds[0]);
    w.reset(fds[1]);
  }
  std::string drain() {
    std::string out;
    char buf[256];
    ssize_t n;
    while ((n = ::read(r.get(), buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(n));
    return out;
  }
};

}  // namespace

TEST_CASE("serial: THR bytes go to the sink fd") {
  Pipe p;
  Serial s(p.w.get(), nullptr);
  for (char c : std::string("hello\n")) wr(s, kThr, static_cast<uint8_t>(c));
  CHECK(p.drain() == "hello\n");
  CHECK(s.bytes_written() == 6);
  CHECK(s.bytes_dropped() == 0);
}

TEST_CASE("serial: output past out_limit is dropped and counted") {
  Pipe p;
  Serial s(p.w.get(), nullptr, 3);
  for (char c : std::string("abcdef")) wr(s, kThr, static_cast<uint8_t>(c));
  CHECK(p.drain() == "abc");
  CHECK(s.bytes_written() == 3);
  CHECK(s.bytes_dropped() == 3);

  Serial none(-1, nullptr);
  wr(none, kThr, 'x');
  CHECK(none.bytes_written() == 0);
  CHECK(none.bytes_dropped() == 1);
}

TEST_CASE("serial: a failed write to the sink drops the byte") {
  Pipe p;
  p.r.reset();  // write() now fails with EPIPE (SIGPIPE is ignored by the VMM and here)
  struct sigaction old {}, ign {};
  ign.sa_handler = SIG_IGN;
  ::sigaction(SIGPIPE, &ign, &old);
  Serial s(p.w.get(), nullptr);
  wr(s, kThr, 'x');
  ::sigaction(SIGPIPE, &old, nullptr);
  CHECK(s.bytes_written() == 0);
  CHECK(s.bytes_dropped() == 1);
}

TEST_CASE("serial: THR-empty interrupt, raised on enable and after each byte, cleared by reading IIR") {
  test::FakeIrq irq;
  Serial s(-1, &irq);
  CHECK(rd(s, kIir) == 0xc1);  // no interrupt pending, FIFOs enabled
  wr(s, kThr, 'a');            // IER clear: no interrupt
  CHECK(irq.count() == 0);
  CHECK(rd(s, kIir) == 0xc1);

  wr(s, kIer, 0x02);  // enabling THRE with the THR empty interrupts at once
  CHECK(irq.count() == 1);
  CHECK(rd(s, kIer) == 0x02);
  CHECK(rd(s, kIir) == 0xc2);
  CHECK(rd(s, kIir) == 0xc1);  // the read cleared it
  wr(s, kIer, 0x02);           // already enabled: no new edge
  CHECK(irq.count() == 1);

  wr(s, kThr, 'b');
  CHECK(irq.count() == 2);
  CHECK(rd(s, kIir) == 0xc2);
  CHECK(rd(s, kIir) == 0xc1);

  wr(s, kIer, 0x00);
  wr(s, kThr, 'c');
  CHECK(irq.count() == 2);
  CHECK(rd(s, kIir) == 0xc1);  // pending but masked: not reported

  wr(s, kIer, 0xff);  // only the four defined bits stick
  CHECK(rd(s, kIer) == 0x0f);
  CHECK(irq.count() == 3);
}

TEST_CASE("serial: line and modem status, scratch, and the unused registers") {
  Serial s(-1, nullptr);
  CHECK(rd(s, kLsr) == 0x60);  // THRE | TEMT, no data ready
  CHECK(rd(s, kMsr) == 0xb0);  // DCD | DSR | CTS
  CHECK(rd(s, kThr) == 0x00);  // RBR: nothing received
  wr(s, kLsr, 0x00);           // read-only
  CHECK(rd(s, kLsr) == 0x60);
  wr(s, kScr, 0x5a);
  CHECK(rd(s, kScr) == 0x5a);
  wr(s, kMcr, 0x0b);
  CHECK(rd(s, kMcr) == 0x0b);
  uint8_t wide[4] = {};
  s.read(kLsr, wide, 4);  // wider than a register: the rest reads as ones
  CHECK(wide[0] == 0x60);
  CHECK(wide[1] == 0xff);
  CHECK(wide[3] == 0xff);
  s.write(kThr, wide, 0);  // zero-length writes are ignored
  CHECK(s.bytes_dropped() == 0);
}

TEST_CASE("serial: DLAB switches offsets 0 and 1 to the divisor latch") {
  Pipe p;
  Serial s(p.w.get(), nullptr);
  wr(s, kIer, 0x01);
  wr(s, kLcr, 0x83);  // DLAB | 8N1
  CHECK(rd(s, kThr) == 0x0c);  // default divisor 12 (9600 baud)
  wr(s, kThr, 0x01);           // DLL: 115200 baud, not a byte out
  wr(s, kIer, 0x00);           // DLM
  CHECK(rd(s, kThr) == 0x01);
  CHECK(rd(s, kIer) == 0x00);
  CHECK(s.bytes_written() == 0);
  CHECK(p.drain().empty());
  wr(s, kLcr, 0x03);
  CHECK(rd(s, kIer) == 0x01);  // IER kept its value
  CHECK(rd(s, kLcr) == 0x03);
  wr(s, kThr, 'z');
  CHECK(p.drain() == "z");
}

TEST_CASE("serial: save and restore round trip") {
  test::FakeIrq irq;
  Serial a(-1, &irq);
  wr(a, kLcr, 0x80);
  wr(a, kThr, 0x03);
  wr(a, kIer, 0x00);
  wr(a, kLcr, 0x1b);
  wr(a, kIer, 0x03);  // leaves a THR-empty interrupt pending
  wr(a, kMcr, 0x08);
  wr(a, kScr, 0x77);
  StateWriter w;
  a.save(w);

  Serial b(-1, nullptr);
  StateReader r(w.bytes().data(), w.bytes().size());
  REQUIRE(b.restore(r));
  CHECK(r.done());
  CHECK(rd(b, kIer) == 0x03);
  CHECK(rd(b, kLcr) == 0x1b);
  CHECK(rd(b, kMcr) == 0x08);
  CHECK(rd(b, kScr) == 0x77);
  CHECK(rd(b, kIir) == 0xc2);  // the pending interrupt survived
  wr(b, kLcr, 0x9b);
  CHECK(rd(b, kThr) == 0x03);
  CHECK(rd(b, kIer) == 0x00);

  // Truncated state fails; a hostile IER is masked to the defined bits.
  for (size_t n = 0; n < w.bytes().size(); ++n) {
    Serial c(-1, nullptr);
    StateReader t(w.bytes().data(), n);
    CHECK(!c.restore(t));
  }
  std::vector<uint8_t> bad = w.bytes();
  bad[0] = 0xff;
  Serial d(-1, nullptr);
  StateReader t(bad.data(), bad.size());
  REQUIRE(d.restore(t));
  CHECK(rd(d, kIer) == 0x0f);
}
