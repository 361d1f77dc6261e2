// libFuzzer target: the virtio-mmio transport with a VirtioBlk (over a
// memfd disk), a VirtioConsole (over one end of a socketpair) and a
// VirtioNet (over one end of a datagram socketpair, a TAP's semantics),
// driven by arbitrary bytes read as a sequence of operations: register
// reads and writes through the BusDevice entry points, raw guest-memory
// writes, descriptors and avail-ring entries at the rings' addresses,
// notifications, a Linux-style bring-up with fuzzed features and queue
// sizes, host-side socket traffic, save/restore round trips and restores
// from fuzzed state. Guest RAM has PROT_NONE guard pages on both sides
// where the address space allows, so a device access outside RAM faults.
//
// Invariants (checked with abort(), not assert: fuzz builds are
// RelWithDebInfo, where NDEBUG removes asserts):
//   - FEATURES_OK is never set unless the driver's features include
//     VERSION_1 and are a subset of what the device offered;
//   - InterruptStatus only ever has bits 0 and 1;
//   - an active device's ready queues have a valid configuration;
//   - every chain the device pops is completed at once (blk requests,
//     console and net transmit chains: next_used == next_avail);
//   - the console never holds more than 2 * kOutMax bytes of output;
//   - save -> restore -> save gives the same bytes.
//
// Input: byte 0 is flags (bit 0 read-only disk, bit 1 console and net I/O threads
// running, bit 2 RAM above 4 GiB too); then operations, see run_op().
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "sandbox-runtime/vmm/devices/virtio_blk.h"
#include "sandbox-runtime/vmm/devices/virtio_console.h"
#include "sandbox-runtime/vmm/devices/virtio_mmio.h"
#include "sandbox-runtime/vmm/devices/virtio_net.h"
#include "base/fd.h"
#include "sandbox-runtime/vmm/kvm/memory.h"

using namespace sg;
using namespace sg::vmm;

#define FUZZ_CHECK(cond)                                                       \
  do {                                                                         \
    if (!(cond)) {                                                             \
      std::fprintf(stderr, "virtio_fuzz: invariant failed: %s (%s:%d)\n", #cond, __FILE__, __LINE__); \
      std::abort();                                                            \
    }                                                                          \
  } while (0)

namespace {

constexpr uint64_t kRam = 2ull << 20;
constexpr uint64_t kDiskBytes = 64 * 512;
constexpr uint64_t kDataBase = 0x100000;  // 1 MiB of buffers from here
constexpr size_t kMaxOps = 2048;
constexpr uint64_t kRegQueueNotify = 0x050, kRegInterruptStatus = 0x060, kRegInterruptAck = 0x064, kRegStatus = 0x070;

// Queue q of device d (0 blk, 1 console, 2 net) lives at ring_base(d, q).
uint64_t ring_base(int d, size_t q) { return 0x10000 + (d * 2 + q) * 0x10000ull; }
uint64_t desc_at(int d, size_t q) { return ring_base(d, q); }
uint64_t avail_at(int d, size_t q) { return ring_base(d, q) + 0x4000; }
uint64_t used_at(int d, size_t q) { return ring_base(d, q) + 0x8000; }

class Input {
 public:
  Input(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  bool empty() const { return n_ == 0; }
  uint64_t take(size_t bytes) {
    uint64_t v = 0;
    for (size_t i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(byte()) << (8 * i);
    return v;
  }
  uint8_t u8() { return static_cast<uint8_t>(take(1)); }
  uint16_t u16() { return static_cast<uint16_t>(take(2)); }
  uint32_t u32() { return static_cast<uint32_t>(take(4)); }
  uint64_t u64() { return take(8); }
  // Up to n bytes of the input (fewer at its end).
  std::vector<uint8_t> bytes(size_t n) {
    n = n < n_ ? n : n_;
    std::vector<uint8_t> v(p_, p_ + n);
    p_ += n, n_ -= n;
    return v;
  }

 private:
  uint8_t byte() {
    if (!n_) return 0;
    --n_;
    return *p_++;
  }
  const uint8_t* p_;
  size_t n_;
};

struct CountingIrq final : IrqLine {
  void trigger() override { ++count; }
  std::atomic<uint64_t> count{0};
};

// Guest RAM with PROT_NONE pages right before and after it, when those
// addresses are free (MAP_FIXED_NOREPLACE never replaces a mapping).
struct GuardedRam {
  GuestMemory mem;
  void* guards[2] = {nullptr, nullptr};
  explicit GuardedRam(uint64_t size) {
    auto m = GuestMemory::create_anonymous(size);
    FUZZ_CHECK(m.ok());
    mem = std::move(m.value());
    uint8_t* at[2] = {mem.host_base() - 4096, mem.host_base() + mem.size()};
    for (int i = 0; i < 2; ++i) {
      // SAFETY: MAP_FIXED_NOREPLACE fails instead of clobbering an existing mapping.
      void* g = ::mmap(at[i], 4096, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
      if (g == MAP_FAILED) continue;
      if (g != at[i]) {
        ::munmap(g, 4096);  // a kernel without MAP_FIXED_NOREPLACE took it as a hint
        continue;
      }
      guards[i] = g;
    }
  }
  ~GuardedRam() {
    for (void* g : guards)
      if (g) ::munmap(g, 4096);
  }
};

// The guest driver's view of one queue: where it put the rings and the
// avail idx it last published.
struct DriverQueue {
  uint16_t size = 16;
  uint16_t avail_idx = 0;
};

struct Rig {
  explicit Rig(const GuestMemory& m) : mem(m) {}
  const GuestMemory& mem;
  CountingIrq irq;
  UniqueFd disk;
  UniqueFd host, guest_end;
  std::unique_ptr<VirtioBlk> blk;
  std::unique_ptr<VirtioMmio> blk_t;
  std::unique_ptr<VirtioConsole> con;
  std::unique_ptr<VirtioMmio> con_t;
  UniqueFd net_host, net_guest_end;  // a datagram pair: one send is one frame
  std::unique_ptr<VirtioNet> net;
  std::unique_ptr<VirtioMmio> net_t;
  bool threaded = false;
  bool paused = false;
  bool read_only = false;
  std::atomic<int> disconnects{0};
  DriverQueue dq[3][2];

  VirtioMmio& transport(int d) { return d == 2 ? *net_t : d ? *con_t : *blk_t; }
  size_t queues(int d) const { return d ? 2 : 1; }
  uint64_t offered(int d) const { return d == 2 ? net->device_features() : d ? con->device_features() : blk->device_features(); }
};

uint32_t reg_read(VirtioMmio& t, uint64_t off) {
  uint8_t b[4];
  t.read(off, b, 4);
  return static_cast<uint32_t>(le_load(b, 4));
}
void reg_write(VirtioMmio& t, uint64_t off, uint32_t v) {
  uint8_t b[4];
  le_store(b, 4, v);
  t.write(off, b, 4);
}

// The sequence of Linux's virtio_mmio probe and vm_setup_vq.
void bring_up(Rig& r, int d, uint64_t features, uint16_t size) {
  VirtioMmio& t = r.transport(d);
  reg_write(t, kRegStatus, 0);
  reg_write(t, kRegStatus, kVirtioStatusAcknowledge);
  reg_write(t, kRegStatus, kVirtioStatusAcknowledge | kVirtioStatusDriver);
  reg_write(t, 0x024, 1);
  reg_write(t, 0x020, static_cast<uint32_t>(features >> 32));
  reg_write(t, 0x024, 0);
  reg_write(t, 0x020, static_cast<uint32_t>(features));
  reg_write(t, kRegStatus, kVirtioStatusAcknowledge | kVirtioStatusDriver | kVirtioStatusFeaturesOk);
  for (size_t q = 0; q < r.queues(d); ++q) {
    reg_write(t, 0x030, static_cast<uint32_t>(q));
    reg_write(t, 0x038, size);
    reg_write(t, 0x080, static_cast<uint32_t>(desc_at(d, q)));
    reg_write(t, 0x084, 0);
    reg_write(t, 0x090, static_cast<uint32_t>(avail_at(d, q)));
    reg_write(t, 0x094, 0);
    reg_write(t, 0x0a0, static_cast<uint32_t>(used_at(d, q)));
    reg_write(t, 0x0a4, 0);
    reg_write(t, 0x044, 1);
    r.dq[d][q] = DriverQueue{size ? size : uint16_t{1}, 0};
    // A fresh ring, as the driver allocates zeroed rings.
    std::memset(r.mem.span(avail_at(d, q), 0x4000), 0, 0x4000);
    std::memset(r.mem.span(used_at(d, q), 0x4000), 0, 0x4000);
  }
  reg_write(t, kRegStatus, reg_read(t, kRegStatus) | kVirtioStatusDriverOk);
}

void check_invariants(Rig& r) {
  for (int d = 0; d < 3; ++d) {
    VirtioMmio& t = r.transport(d);
    uint32_t status = reg_read(t, kRegStatus);
    uint32_t isr = reg_read(t, kRegInterruptStatus);
    FUZZ_CHECK((isr & ~3u) == 0);
    uint64_t offered = r.offered(d);
    auto lock = t.lock();
    if (status & kVirtioStatusFeaturesOk) {
      FUZZ_CHECK((t.acked_features() & kVirtioFVersion1) != 0);
      FUZZ_CHECK((t.acked_features() & ~offered) == 0);
    }
    if (t.active())
      for (size_t q = 0; q < r.queues(d); ++q)
        if (t.queue(q).ready) FUZZ_CHECK(t.queue(q).valid_config(r.mem));
    // blk completes every request it pops; the console and net every
    // transmit chain.
    size_t q = d ? 1 : 0;
    FUZZ_CHECK(t.queue(q).next_used == t.queue(q).next_avail);
    if (d == 1) {
      StateWriter w;
      r.con->save(w);  // the pending output, length-prefixed
      uint32_t held = 0;
      std::memcpy(&held, w.bytes().data(), 4);
      FUZZ_CHECK(held <= 2 * VirtioConsole::kOutMax);
    }
  }
}

// save -> restore into a fresh device -> save: the same bytes.
void round_trip(Rig& r, int d) {
  StateWriter w;
  r.transport(d).save(w);
  CountingIrq irq;
  StateWriter w2;
  if (d == 0) {
    VirtioBlk blk(r.disk.get(), kDiskBytes, r.read_only, "fuzz-disk");
    VirtioMmio t(r.mem, irq, blk);
    StateReader rd(w.bytes().data(), w.bytes().size());
    FUZZ_CHECK(t.restore(rd));
    FUZZ_CHECK(rd.done());
    t.save(w2);
  } else if (d == 1) {
    VirtioConsole con(r.guest_end.get(), nullptr);  // never started: no thread
    VirtioMmio t(r.mem, irq, con);
    StateReader rd(w.bytes().data(), w.bytes().size());
    FUZZ_CHECK(t.restore(rd));
    FUZZ_CHECK(rd.done());
    t.save(w2);
  } else {
    VirtioNet net(-1, {0x02, 0, 0, 0, 0, 9});  // another MAC: the saved one comes back
    VirtioMmio t(r.mem, irq, net);
    StateReader rd(w.bytes().data(), w.bytes().size());
    FUZZ_CHECK(t.restore(rd));
    FUZZ_CHECK(rd.done());
    t.save(w2);
  }
  FUZZ_CHECK(w2.bytes() == w.bytes());
}

// Restores fuzzed bytes into a fresh device; if they are accepted, the
// restored device must survive notifications and save again.
void restore_fuzzed(Rig& r, int d, const std::vector<uint8_t>& state) {
  CountingIrq irq;
  auto poke = [&](VirtioMmio& t, size_t queues) {
    StateReader rd(state.data(), state.size());
    if (!t.restore(rd)) return;  // a failed restore leaves the device unusable by contract
    for (uint32_t q = 0; q < queues; ++q) reg_write(t, kRegQueueNotify, q);
    StateWriter w;
    t.save(w);
  };
  if (d == 0) {
    VirtioBlk blk(r.disk.get(), kDiskBytes, r.read_only, "fuzz-disk");
    VirtioMmio t(r.mem, irq, blk);
    poke(t, 1);
  } else if (d == 2) {
    VirtioNet net(-1, {0x02, 0, 0, 0, 0, 9});  // no host end: transmit only drops
    VirtioMmio t(r.mem, irq, net);
    poke(t, 2);
  } else if (!r.threaded) {  // the guest end is the running console's otherwise
    VirtioConsole con(r.guest_end.get(), nullptr);
    VirtioMmio t(r.mem, irq, con);
    poke(t, 2);
  }
}

void run_op(Rig& r, Input& in) {
  uint8_t op = in.u8();
  // Bit 0 picks blk or console, bit 5 the net device instead (the corpus
  // from before it had no op with bit 5 set); bits 1-4 the operation.
  int d = (op & 0x20) ? 2 : op & 1;
  VirtioMmio& t = r.transport(d);
  switch ((op >> 1) % 16) {
    case 0: {  // register or config read, any width
      uint64_t off = in.u16() & 0xfff;
      size_t len = size_t{1} << (in.u8() & 3);
      if (off + len > kVirtioMmioWindow) off = kVirtioMmioWindow - len;
      uint8_t b[8];
      t.read(off, b, len);
      break;
    }
    case 1: {  // 32-bit register write
      uint64_t off = (in.u8() & 0x3fu) * 4;
      reg_write(t, off, in.u32());
      break;
    }
    case 2: {  // any write, any width
      uint64_t off = in.u16() & 0xfff;
      size_t len = size_t{1} << (in.u8() & 3);
      if (off + len > kVirtioMmioWindow) off = kVirtioMmioWindow - len;
      uint8_t b[8];
      le_store(b, len, in.u64());
      t.write(off, b, len);
      break;
    }
    case 3: {  // raw guest memory
      uint64_t gpa = in.u32() % kRam;
      std::vector<uint8_t> b = in.bytes(in.u8());
      uint64_t n = b.size() < kRam - gpa ? b.size() : kRam - gpa;
      if (n) r.mem.write(gpa, b.data(), n);
      break;
    }
    case 4: {  // a descriptor in the queue's table
      size_t q = in.u8() % r.queues(d);
      uint16_t i = in.u8();
      uint8_t sel = in.u8();
      // Mostly buffers in the data area; some large ones; some anywhere.
      uint64_t addr = sel < 0xf0 ? kDataBase + uint64_t{in.u16()} * 16 : in.u64();
      uint32_t len = sel < 0xe0 ? in.u16() : sel < 0xf0 ? in.u32() % kRam : sel < 0xf8 ? in.u16() : in.u32();
      uint16_t flags = in.u8();
      uint16_t next = in.u16();
      uint8_t desc[16];
      std::memcpy(desc, &addr, 8);
      std::memcpy(desc + 8, &len, 4);
      std::memcpy(desc + 12, &flags, 2);
      std::memcpy(desc + 14, &next, 2);
      r.mem.write(desc_at(d, q) + 16ull * i, desc, 16);
      break;
    }
    case 5: {  // publish a head
      size_t q = in.u8() % r.queues(d);
      uint16_t head = in.u16();
      DriverQueue& dq = r.dq[d][q];
      r.mem.write_obj(avail_at(d, q) + 4 + 2ull * (dq.avail_idx % dq.size), head);
      ++dq.avail_idx;
      std::atomic_thread_fence(std::memory_order_release);
      r.mem.write_obj(avail_at(d, q) + 2, dq.avail_idx);
      break;
    }
    case 6: {  // avail flags and idx, raw
      size_t q = in.u8() % r.queues(d);
      r.mem.write_obj(avail_at(d, q), in.u16());
      r.dq[d][q].avail_idx = in.u16();
      r.mem.write_obj(avail_at(d, q) + 2, r.dq[d][q].avail_idx);
      break;
    }
    case 7: {  // notify
      uint8_t v = in.u8();
      reg_write(t, kRegQueueNotify, v < 0xf0 ? v % 2 : v);
      break;
    }
    case 8: {  // Linux bring-up
      uint8_t fsel = in.u8();
      uint64_t offered = r.offered(d);
      uint64_t features = fsel % 4 == 0 ? kVirtioFVersion1 : fsel % 4 == 1 ? offered : fsel % 4 == 2 ? 0 : in.u64();
      bring_up(r, d, features, static_cast<uint16_t>(1u << (in.u8() % 10)));
      break;
    }
    case 9: {  // the host sends bytes (net: one frame, sometimes a large one)
      std::vector<uint8_t> b = in.bytes(in.u8());
      if (d == 2 && !b.empty() && (b[0] & 0x80)) b.resize(1500 + b[0] * 256u);
      UniqueFd& host = d == 2 ? r.net_host : r.host;
      if (host && !b.empty()) (void)!::send(host.get(), b.data(), b.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
      break;
    }
    case 10: {  // the host reads what there is
      if (r.threaded) std::this_thread::yield();  // let the I/O thread move some data first
      static char buf[70000];
      UniqueFd& host = d == 2 ? r.net_host : r.host;
      while (host && ::recv(host.get(), buf, sizeof buf, MSG_DONTWAIT) > 0) {
      }
      break;
    }
    case 11:  // the host goes away
      (d == 2 ? r.net_host : r.host).reset();
      break;
    case 12:
      round_trip(r, d);
      break;
    case 13:
      restore_fuzzed(r, d, in.bytes(in.u16() & 0x3ff));
      break;
    case 14:  // pause or resume the I/O threads
      if (r.threaded) {
        r.paused = !r.paused;
        r.con->set_paused(r.paused);
        r.net->set_paused(r.paused);
      }
      break;
    case 15: {  // the interrupt handler
      uint32_t isr = reg_read(t, kRegInterruptStatus);
      reg_write(t, kRegInterruptAck, isr);
      break;
    }
  }
}

}  // namespace

// UBSan reports are recoverable in these builds (-fsanitize=undefined):
// without this a report would scroll by and the run still pass.
extern "C" const char* __ubsan_default_options() { return "halt_on_error=1:print_stacktrace=1"; }

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  std::signal(SIGPIPE, SIG_IGN);  // as the VMM's main() does
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  Input in(data, size);
  uint8_t flags = in.u8();
  GuardedRam ram((flags & 4) ? kMmioStart + kRam : kRam);
  Rig r(ram.mem);
  r.read_only = flags & 1;
  r.threaded = flags & 2;

  r.disk.reset(::memfd_create("virtio-fuzz-disk", MFD_CLOEXEC));
  FUZZ_CHECK(r.disk && ::ftruncate(r.disk.get(), kDiskBytes) == 0);
  int sv[2];
  FUZZ_CHECK(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sv) == 0);
  r.host.reset(sv[0]);
  r.guest_end.reset(sv[1]);

  r.blk = std::make_unique<VirtioBlk>(r.disk.get(), kDiskBytes, r.read_only, "fuzz-disk");
  r.blk_t = std::make_unique<VirtioMmio>(r.mem, r.irq, *r.blk);
  r.con = std::make_unique<VirtioConsole>(r.guest_end.get(), [&r](const std::string&) { ++r.disconnects; });
  r.con_t = std::make_unique<VirtioMmio>(r.mem, r.irq, *r.con);
  FUZZ_CHECK(::socketpair(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sv) == 0);
  r.net_host.reset(sv[0]);
  r.net_guest_end.reset(sv[1]);
  r.net = std::make_unique<VirtioNet>(r.net_guest_end.get(), VirtioNet::Mac{0x02, 0x53, 0x47, 0, 0, 1});
  r.net_t = std::make_unique<VirtioMmio>(r.mem, r.irq, *r.net);
  if (r.threaded) {
    FUZZ_CHECK(r.con->start(*r.con_t).ok());
    FUZZ_CHECK(r.net->start(*r.net_t).ok());
  }

  for (size_t n = 0; n < kMaxOps && !in.empty(); ++n) {
    run_op(r, in);
    check_invariants(r);
  }
  r.con->stop();
  r.net->stop();
  FUZZ_CHECK(r.disconnects.load() <= 1);
  if (std::getenv("VIRTIO_FUZZ_VERBOSE"))  // to see what a corpus entry does
    std::fprintf(stderr,
                 "virtio_fuzz: blk %llu requests %llu errors, console %llu to host %llu to guest, net %llu frames out "
                 "%llu in %llu dropped, %llu irqs\n",
                 static_cast<unsigned long long>(r.blk->requests()), static_cast<unsigned long long>(r.blk->errors()),
                 static_cast<unsigned long long>(r.con->bytes_to_host()),
                 static_cast<unsigned long long>(r.con->bytes_to_guest()),
                 static_cast<unsigned long long>(r.net->counters().tx_frames),
                 static_cast<unsigned long long>(r.net->counters().rx_frames),
                 static_cast<unsigned long long>(r.net->counters().tx_dropped + r.net->counters().rx_dropped),
                 static_cast<unsigned long long>(r.irq.count.load()));
  return 0;
}
