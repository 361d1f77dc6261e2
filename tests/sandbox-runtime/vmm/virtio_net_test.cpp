// VirtioNet with its I/O thread running against one end of a datagram
// socketpair (one datagram is one frame, as one read or write of a TAP
// is), and once against a real TAP device in a network namespace of its
// own: frames both ways with the 12-byte header, config space, bounds on
// both sides, malformed chains, pause, and the device without a host end.
// Synchronisation is by waiting on the fake interrupt line or polling
// the host fd with a timeout; the only timed waits check that something
// does not happen.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <linux/if_packet.h>
#include <linux/if_tun.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "base/fd.h"
#include "sandbox-runtime/vmm/devices/virtio_net.h"
#include "tests/sandbox-runtime/vmm/vmm_harness.h"

using namespace sg;
using namespace sg::vmm;
using namespace sg::vmm::test;
using namespace std::chrono_literals;

// (Guest RAM shared with the device thread: the TSan suppressions are
// virtio_console_test.cpp's, one per binary.)

namespace {

constexpr size_t kRx = 0, kTx = 1;
constexpr size_t kHdr = VirtioNet::kHdrLen;
const VirtioNet::Mac kMac = {0x02, 0x53, 0x47, 0x0a, 0x0b, 0x0c};

// An Ethernet frame of n bytes: broadcast destination, the guest's MAC
// as source, then a counting pattern.
std::string frame(size_t n, uint8_t seed = 0) {
  std::string f(n, '\0');
  for (size_t i = 0; i < 6 && i < n; ++i) f[i] = '\xff';
  for (size_t i = 0; i < 6 && 6 + i < n; ++i) f[6 + i] = static_cast<char>(kMac[i]);
  for (size_t i = 12; i < n; ++i) f[i] = static_cast<char>(seed + i);
  return f;
}

bool readable(int fd, std::chrono::milliseconds timeout) {
  struct pollfd p = {fd, POLLIN, 0};
  return ::poll(&p, 1, static_cast<int>(timeout.count())) == 1;
}

struct Fixture {
  GuestMemory mem = make_ram(32ull << 20);
  FakeIrq irq;
  UniqueFd host, dev;
  VirtioNet net;
  VirtioMmio t;
  Driver drv{t, mem};
  uint64_t next_buf = kDataBase;

  explicit Fixture(bool with_host = true) : dev(with_host ? pair() : UniqueFd()), net(dev ? dev.get() : -1, kMac), t(mem, irq, net) {
    REQUIRE(drv.negotiate(kVirtioFVersion1 | VirtioNet::kFeatureMac | VirtioNet::kFeatureMtu));
    for (size_t q = 0; q < 2; ++q) REQUIRE(drv.setup_queue(static_cast<uint32_t>(q), 64, desc_gpa(q), avail_gpa(q), used_gpa(q)));
    drv.driver_ok();
    REQUIRE(t.active());
    REQUIRE(net.start(t).ok());
  }
  ~Fixture() { net.stop(); }

  UniqueFd pair() {
    int sv[2];
    REQUIRE(::socketpair(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0, sv) == 0);
    host.reset(sv[0]);
    return UniqueFd(sv[1]);
  }
  uint64_t alloc(uint32_t n) {
    uint64_t a = next_buf;
    next_buf += (n + 4095) & ~4095ull;
    return a;
  }
  // The guest sends bytes (header included) in one descriptor per piece.
  void send(const std::vector<std::string>& pieces) {
    std::vector<Buf> bufs;
    for (const auto& p : pieces) {
      uint64_t a = alloc(static_cast<uint32_t>(p.size()));
      REQUIRE(mem.write(a, p.data(), p.size()));
      bufs.push_back({a, static_cast<uint32_t>(p.size()), false});
    }
    drv.add_chain(kTx, bufs);
    drv.notify(kTx);
  }
  // Posts a receive buffer of n bytes (as lens.size() descriptors).
  std::vector<uint64_t> post(const std::vector<uint32_t>& lens) {
    std::vector<Buf> bufs;
    std::vector<uint64_t> addrs;
    for (uint32_t n : lens) {
      addrs.push_back(alloc(n));
      bufs.push_back({addrs.back(), n, true});
    }
    drv.add_chain(kRx, bufs);
    drv.notify(kRx);
    return addrs;
  }
  bool wait_used(size_t q, uint16_t n) {
    return irq.wait_until([&] { return drv.ring(q).used_idx() >= n; });
  }
  std::string host_recv() {
    REQUIRE(readable(host.get(), 5s));
    std::string b(70000, '\0');
    ssize_t n = ::recv(host.get(), b.data(), b.size(), 0);
    REQUIRE(n >= 0);
    b.resize(static_cast<size_t>(n));
    return b;
  }
  void host_send(const std::string& f) { REQUIRE(::send(host.get(), f.data(), f.size(), 0) == static_cast<ssize_t>(f.size())); }
  std::string guest_bytes(uint64_t addr, size_t n) {
    std::string b(n, '\0');
    REQUIRE(mem.read(addr, b.data(), n));
    return b;
  }
};

std::string hdr() { return std::string(kHdr, '\0'); }

}  // namespace

TEST_CASE("virtio-net: identity, features and config space") {
  Fixture f;
  CHECK(f.drv.r32(kRegDeviceId) == VirtioNet::kDeviceId);
  uint64_t feat = f.drv.device_features();
  CHECK(feat == (kVirtioFVersion1 | VirtioNet::kFeatureMac | VirtioNet::kFeatureMtu));
  uint8_t cfg[12];
  f.t.read(kRegConfig, cfg, 4);
  f.t.read(kRegConfig + 4, cfg + 4, 4);
  f.t.read(kRegConfig + 8, cfg + 8, 4);
  CHECK(std::memcmp(cfg, kMac.data(), 6) == 0);
  CHECK(cfg[8] == 1);                                       // one queue pair
  CHECK((cfg[10] | cfg[11] << 8) == 1500);                  // mtu
  uint8_t past[4] = {1, 1, 1, 1};
  f.t.read(kRegConfig + 12, past, 4);
  CHECK(past[0] == 0);
  CHECK(past[3] == 0);
}

TEST_CASE("virtio-net: guest frames reach the host without the header, split or whole") {
  Fixture f;
  std::string a = frame(60), b = frame(1514, 7);
  f.send({hdr() + a});
  CHECK(f.host_recv() == a);
  // Header in its own descriptor and the frame in three (as Linux's sg lists).
  f.send({hdr(), b.substr(0, 100), b.substr(100, 900), b.substr(1000)});
  CHECK(f.host_recv() == b);
  REQUIRE(f.wait_used(kTx, 2));
  CHECK(f.drv.ring(kTx).used_elem(0).second == 0);
  auto c = f.net.counters();
  CHECK(c.tx_frames == 2);
  CHECK(c.tx_bytes == 60 + 1514);
  CHECK(c.tx_dropped == 0);
}

TEST_CASE("virtio-net: host frames reach the guest after a zeroed header with num_buffers 1") {
  Fixture f;
  auto one = f.post({2048});
  auto split = f.post({kHdr, 40, 2000});  // header alone, the frame across two
  std::string a = frame(98, 1), b = frame(1000, 2);
  f.host_send(a);
  f.host_send(b);
  REQUIRE(f.wait_used(kRx, 2));
  auto [id0, len0] = f.drv.ring(kRx).used_elem(0);
  CHECK(len0 == kHdr + a.size());
  std::string h = f.guest_bytes(one[0], kHdr);
  CHECK(h.substr(0, 10) == std::string(10, '\0'));
  CHECK(h[10] == 1);
  CHECK(h[11] == 0);
  CHECK(f.guest_bytes(one[0] + kHdr, a.size()) == a);
  CHECK(f.drv.ring(kRx).used_elem(1).second == kHdr + b.size());
  CHECK(f.guest_bytes(split[1], 40) + f.guest_bytes(split[2], b.size() - 40) == b);
  CHECK(f.net.counters().rx_frames == 2);
}

TEST_CASE("virtio-net: frames wait in the host queue until the guest posts buffers") {
  Fixture f;
  std::string a = frame(64, 3);
  f.host_send(a);
  // No buffers: nothing is taken (the datagram stays readable on the device end).
  CHECK_FALSE(f.irq.wait_until([&] { return f.drv.ring(kRx).used_idx() > 0; }, 100ms));
  auto b = f.post({256});
  REQUIRE(f.wait_used(kRx, 1));
  CHECK(f.guest_bytes(b[0] + kHdr, a.size()) == a);
}

TEST_CASE("virtio-net: bounds on both sides") {
  Fixture f;
  SUBCASE("a transmit chain shorter than header and Ethernet header is dropped and completed") {
    f.send({hdr() + std::string(13, 'x')});
    f.send({std::string(5, 'x')});
    REQUIRE(f.wait_used(kTx, 2));
    CHECK(f.net.counters().tx_dropped == 2);
    CHECK_FALSE(readable(f.host.get(), 50ms));
  }
  SUBCASE("a transmit chain over the frame bound is dropped") {
    f.send({hdr(), std::string(VirtioNet::kMaxFrame, 'a'), std::string(1, 'b')});
    REQUIRE(f.wait_used(kTx, 1));
    CHECK(f.net.counters().tx_dropped == 1);
    CHECK_FALSE(readable(f.host.get(), 50ms));
    // The largest allowed one goes through.
    std::string big = frame(VirtioNet::kMaxFrame);
    f.send({hdr() + big});
    CHECK(f.host_recv().size() == VirtioNet::kMaxFrame);
  }
  SUBCASE("a host frame larger than the posted chain is dropped and the chain serves the next") {
    auto b = f.post({kHdr + 100});
    f.host_send(frame(500));
    std::string small = frame(80, 9);
    f.host_send(small);
    REQUIRE(f.wait_used(kRx, 1));
    CHECK(f.drv.ring(kRx).used_elem(0).second == kHdr + small.size());
    CHECK(f.guest_bytes(b[0] + kHdr, small.size()) == small);
    CHECK(f.net.counters().rx_dropped == 1);
  }
  SUBCASE("a receive chain with a readable descriptor only takes nothing past its writable space") {
    uint64_t ro = f.alloc(64), rw = f.alloc(kHdr + 64);
    REQUIRE(f.mem.write(ro, std::string(64, 'k').data(), 64));
    f.drv.add_chain(kRx, {{ro, 64, false}, {rw, static_cast<uint32_t>(kHdr + 64), true}});
    f.drv.notify(kRx);
    std::string a = frame(64, 4);
    f.host_send(a);
    REQUIRE(f.wait_used(kRx, 1));
    CHECK(f.guest_bytes(ro, 64) == std::string(64, 'k'));
    CHECK(f.guest_bytes(rw + kHdr, 64) == a);
  }
  SUBCASE("a chain pointing outside RAM is completed with length 0 and nothing is written") {
    uint64_t outside = f.mem.size() - 16;
    f.drv.add_chain(kRx, {{outside, 4096, true}});
    f.drv.notify(kRx);
    auto good = f.post({2048});
    std::string a = frame(60, 5);
    f.host_send(a);
    f.host_send(a);
    REQUIRE(f.wait_used(kRx, 2));
    CHECK(f.drv.ring(kRx).used_elem(0).second == 0);
    CHECK(f.drv.ring(kRx).used_elem(1).second == kHdr + a.size());
    CHECK(f.guest_bytes(good[0] + kHdr, a.size()) == a);
  }
}

TEST_CASE("virtio-net: a driver claiming more buffers than the ring holds gets NEEDS_RESET") {
  Fixture f;
  f.drv.ring(kTx).set_avail_idx(1000);
  f.drv.notify(kTx);
  CHECK((f.drv.status() & kVirtioStatusNeedsReset) != 0);
}

TEST_CASE("virtio-net: paused, no frame moves; resumed, it does") {
  Fixture f;
  f.net.set_paused(true);
  auto b = f.post({2048});
  std::string a = frame(70, 6);
  f.host_send(a);
  CHECK_FALSE(f.irq.wait_until([&] { return f.drv.ring(kRx).used_idx() > 0; }, 100ms));
  f.net.set_paused(false);
  REQUIRE(f.wait_used(kRx, 1));
  CHECK(f.guest_bytes(b[0] + kHdr, a.size()) == a);
}

TEST_CASE("virtio-net: without a host end the link is there and frames are dropped") {
  Fixture f(false);
  f.send({hdr() + frame(60)});
  REQUIRE(f.wait_used(kTx, 1));
  CHECK(f.net.counters().tx_dropped == 1);
  f.post({2048});
  CHECK_FALSE(f.irq.wait_until([&] { return f.drv.ring(kRx).used_idx() > 0; }, 50ms));
}

TEST_CASE("virtio-net: MAC parsing and state round trip") {
  VirtioNet::Mac m{};
  CHECK(VirtioNet::parse_mac("02:53:47:0A:0b:0c", &m));
  CHECK(m == kMac);
  CHECK_FALSE(VirtioNet::parse_mac("03:53:47:0a:0b:0c", &m));  // multicast
  CHECK_FALSE(VirtioNet::parse_mac("02:53:47:0a:0b", &m));
  CHECK_FALSE(VirtioNet::parse_mac("02-53-47-0a-0b-0c", &m));
  CHECK_FALSE(VirtioNet::parse_mac("02:53:47:0a:0b:0g", &m));

  VirtioNet a(-1, kMac, 9000), b(-1, {0x02, 0, 0, 0, 0, 1});
  StateWriter w;
  a.save(w);
  StateReader r(w.bytes().data(), w.bytes().size());
  REQUIRE(b.restore(r));
  CHECK(r.done());
  CHECK(b.mac() == kMac);
  // A saved multicast MAC or an impossible MTU is refused.
  std::vector<uint8_t> bad = w.bytes();
  bad[0] |= 1;
  StateReader r2(bad.data(), bad.size());
  CHECK_FALSE(b.restore(r2));
  bad = w.bytes();
  bad[6] = 10, bad[7] = 0;
  StateReader r3(bad.data(), bad.size());
  CHECK_FALSE(b.restore(r3));
}

// A real TAP device, in a network namespace of a child process so nothing
// on the host changes: the device's frames come out of the TAP as written
// and a frame written into the TAP reaches the guest.
TEST_CASE("virtio-net: frames through a real TAP device") {
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    // Child: a fresh netns, a TAP in it, one frame each way. Exit codes
    // name the step that failed.
    if (::unshare(CLONE_NEWNET) != 0) ::_exit(10);
    int tap = ::open("/dev/net/tun", O_RDWR | O_CLOEXEC);
    if (tap < 0) ::_exit(11);
    struct ifreq ifr {};
    std::strncpy(ifr.ifr_name, "sgtest0", IFNAMSIZ - 1);
    ifr.ifr_flags = IFF_TAP | IFF_NO_PI;
    if (::ioctl(tap, TUNSETIFF, &ifr) != 0) ::_exit(12);
    int s = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    struct ifreq up {};
    std::strncpy(up.ifr_name, "sgtest0", IFNAMSIZ - 1);
    if (::ioctl(s, SIOCGIFFLAGS, &up) != 0) ::_exit(13);
    up.ifr_flags |= IFF_UP;
    if (::ioctl(s, SIOCSIFFLAGS, &up) != 0) ::_exit(14);
    GuestMemory mem = GuestMemory::create_anonymous(16ull << 20).value();
    FakeIrq irq;
    VirtioNet net(tap, kMac);
    VirtioMmio t(mem, irq, net);
    Driver drv(t, mem);
    if (!drv.negotiate(kVirtioFVersion1 | VirtioNet::kFeatureMac)) ::_exit(15);
    for (uint32_t q = 0; q < 2; ++q)
      if (!drv.setup_queue(q, 16, desc_gpa(q), avail_gpa(q), used_gpa(q))) ::_exit(16);
    drv.driver_ok();
    if (!net.start(t).ok()) ::_exit(17);
    // Guest -> TAP: an Ethernet frame the kernel reads back from the TAP
    // is not possible (the TAP's host side consumes it), so count it on
    // the interface: tx from the device is rx on the TAP interface.
    std::string f = std::string(kHdr, '\0') + frame(60);
    if (!mem.write(kDataBase, f.data(), f.size())) ::_exit(24);
    drv.add_chain(1, {{kDataBase, static_cast<uint32_t>(f.size()), false}});
    drv.notify(1);
    if (net.counters().tx_frames != 1) ::_exit(18);
    // TAP -> guest: a raw frame sent out of the interface through a
    // packet socket arrives on the TAP's file side.
    drv.add_chain(0, {{kDataBase + 0x10000, 2048, true}});
    drv.notify(0);
    int ps = ::socket(AF_PACKET, SOCK_RAW | SOCK_CLOEXEC, 0);
    if (ps < 0) ::_exit(19);
    struct sockaddr_ll to {};
    to.sll_family = AF_PACKET;
    to.sll_ifindex = static_cast<int>(::if_nametoindex("sgtest0"));
    to.sll_halen = 6;
    std::memset(to.sll_addr, 0xff, 6);
    std::string out = frame(60) + "hello-tap";
    if (::sendto(ps, out.data(), out.size(), 0, reinterpret_cast<sockaddr*>(&to), sizeof to) != static_cast<ssize_t>(out.size()))
      ::_exit(20);
    if (!irq.wait_until([&] { return drv.ring(0).used_idx() >= 1; })) ::_exit(21);
    std::string got(2048, '\0');
    mem.read(kDataBase + 0x10000, got.data(), got.size());
    uint32_t len = drv.ring(0).used_elem(0).second;
    if (len != kHdr + out.size()) ::_exit(22);
    if (got.find("hello-tap") == std::string::npos) ::_exit(23);
    net.stop();
    ::_exit(0);
  }
  int st = 0;
  REQUIRE(::waitpid(pid, &st, 0) == pid);
  REQUIRE(WIFEXITED(st));
  CHECK(WEXITSTATUS(st) == 0);
}
