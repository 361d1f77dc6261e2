// VirtioNet: a virtio network device (VIRTIO 1.2, section 5.1) with one
// queue pair and no offloads, so the guest sees eth0 and every frame is a
// plain Ethernet frame. The host end is a TAP device (IFF_TAP|IFF_NO_PI,
// no vnet header) that sandgate opened: one read() is one frame, one
// write() sends one. Without a TAP (fd -1) the device is still there,
// link up, and drops what the guest sends: a snapshot then has the same
// devices whether or not the sandbox it came from had a network.
//
// Queues: 0 receiveq (host -> guest), 1 transmitq (guest -> host).
// Features: VERSION_1, MAC, MTU. Config space: mac[6], status u16 (0: no
// STATUS feature), max_virtqueue_pairs u16 (1), mtu u16.
// Every buffer starts with the 12-byte virtio_net_hdr_v1 (no MRG_RXBUF:
// num_buffers is 1 on receive and ignored on transmit).
//
// Data path and bounds:
//   guest -> host: on a transmitq notify (vCPU thread) each chain is
//   gathered into one frame buffer and written to the TAP at once, then
//   completed. A chain shorter than header + Ethernet header or longer
//   than kHdrLen + kMaxFrame is dropped (counted); so is a frame the TAP
//   refuses (its queue full: the kernel's own drop, as a NIC would).
//   host -> guest: the I/O thread reads the TAP only while the guest has
//   receive buffers posted, one frame at a time into a kMaxFrame buffer,
//   and copies it after a zeroed header into the next chain; a frame
//   larger than that chain is dropped (counted) and the chain kept. While
//   the guest posts nothing the frames wait in the TAP's queue, which the
//   kernel bounds (txqueuelen) and drops from.
// While paused (snapshots, pause) the I/O thread moves no data.
//
// Thread safety: state is guarded by the transport's lock; start()/stop()
// from the owner thread; counters are atomics.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "base/fd.h"
#include "base/status.h"
#include "sandbox-runtime/vmm/devices/virtio_mmio.h"

namespace sg::vmm {

class VirtioNet final : public VirtioDevice {
 public:
  static constexpr uint32_t kDeviceId = 1;
  static constexpr size_t kHdrLen = 12;
  static constexpr size_t kEthHdrLen = 14;
  static constexpr size_t kMaxFrame = 65535;
  static constexpr uint64_t kFeatureMtu = 1ull << 3, kFeatureMac = 1ull << 5;
  static constexpr size_t kRxBatch = 64;  // frames per lock hold on the I/O thread

  using Mac = std::array<uint8_t, 6>;

  // tap_fd is borrowed (set non-blocking here) and must outlive stop();
  // -1: no host end. mtu is what the guest is told (68..65521).
  VirtioNet(int tap_fd, const Mac& mac, uint16_t mtu = 1500);
  ~VirtioNet() override;

  // The transport must exist before the I/O thread runs.
  Status start(VirtioMmio& transport);
  void stop();
  // Called with no lock held.
  void set_paused(bool paused);

  uint32_t device_id() const override { return kDeviceId; }
  uint64_t device_features() const override { return kVirtioFVersion1 | kFeatureMac | kFeatureMtu; }
  size_t num_queues() const override { return 2; }
  void read_config(uint64_t offset, uint8_t* data, size_t len) override;
  void activate(VirtioMmio&) override { wake(); }
  void queue_notify(VirtioMmio& t, size_t queue) override;
  void reset() override {}
  // The MAC and MTU the guest read are part of its state: a restored
  // machine keeps them whatever it was created with.
  void save(StateWriter& w) const override;
  bool restore(StateReader& r) override;

  const Mac& mac() const { return mac_; }
  struct Counters {
    uint64_t tx_frames, tx_bytes, tx_dropped, rx_frames, rx_bytes, rx_dropped;
  };
  Counters counters() const;

  // Parses "aa:bb:cc:dd:ee:ff"; a multicast address is refused.
  static bool parse_mac(const std::string& s, Mac* out);

 private:
  void wake();
  void loop();
  void take_tx(VirtioMmio& t);  // lock held
  // Moves up to kRxBatch frames from the TAP into the guest; returns
  // whether the TAP may have more (lock held).
  bool fill_rx(VirtioMmio& t);

  int fd_;
  Mac mac_;
  uint16_t mtu_;
  UniqueFd wake_fd_;
  VirtioMmio* transport_ = nullptr;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  bool paused_ = false;             // GUARDED_BY(transport lock)
  std::vector<uint8_t> tx_buf_;     // GUARDED_BY(transport lock)
  std::vector<uint8_t> rx_buf_;     // I/O thread only
  std::atomic<uint64_t> tx_frames_{0}, tx_bytes_{0}, tx_dropped_{0};
  std::atomic<uint64_t> rx_frames_{0}, rx_bytes_{0}, rx_dropped_{0};
};

}  // namespace sg::vmm
