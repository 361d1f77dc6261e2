// VirtioConsole: a virtio console (VIRTIO 1.2, section 5.3) with one port
// and no multiport, so the guest sees it as /dev/hvc0: sandgate's channel
// to the agent (docs/channel.md) runs over it. The host end is a stream
// socket fd (non-blocking) that the device's own I/O thread polls.
//
// Queues: 0 receiveq (host -> guest), 1 transmitq (guest -> host).
// Config space: cols u16, rows u16, max_nr_ports u32, emerg_wr u32 (all 0:
// no feature that gives them meaning is offered). Features: VERSION_1.
//
// Data path and bounds:
//   guest -> host: on a transmitq notify (vCPU thread) chains are copied
//   into an output buffer of at most kOutMax bytes and completed at once;
//   the buffer is written to the socket without blocking, the I/O thread
//   finishes what the socket would not take. While the buffer is full no
//   more chains are taken, so a host that stops reading stops the guest.
//   host -> guest: the I/O thread reads the socket into a buffer of at
//   most kInMax bytes and copies whole channel frames (docs/channel.md:
//   a 12-byte header with the payload length at offset 8) from it into the
//   guest's posted receive buffers; it stops reading while the buffer is
//   full.
// EOF or an error on the socket: on_disconnect runs once (the VMM stops,
// or with re-attach waits for the next host, docs/vmm.md "Restarts").
// Frames are tracked both ways so that a host that dies mid-frame leaves
// the guest a whole stream: the partial frame it was sending is dropped
// (the guest never saw any of it), and what the guest was sending when it
// died is dropped up to the next frame boundary before a new host, given
// with reattach(), gets anything.
// While paused (snapshots, pause) the I/O thread moves no data.
//
// Thread safety: state is guarded by the transport's lock; start()/stop()
// from the owner thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>

#include "sandbox-runtime/vmm/devices/virtio_mmio.h"
#include "base/fd.h"

namespace sg::vmm {

class VirtioConsole final : public VirtioDevice {
 public:
  static constexpr uint32_t kDeviceId = 3;
  static constexpr size_t kOutMax = 256 * 1024;
  static constexpr size_t kInMax = 2 * (12 + 64 * 1024);  // two whole frames

  // fd is borrowed (set non-blocking here) and must outlive stop().
  VirtioConsole(int fd, std::function<void(const std::string& why)> on_disconnect);
  ~VirtioConsole() override;

  // The transport must exist before the I/O thread runs.
  Status start(VirtioMmio& transport);
  void stop();
  // Called with no lock held.
  void set_paused(bool paused);
  // A new host end after on_disconnect (owned from now on; set
  // non-blocking here): data moves again, from frame boundaries.
  Status reattach(UniqueFd fd);

  // Where a byte stream of channel frames stands: inside a header, inside
  // a payload, or at a boundary. Bounds nothing (the length is the peer's
  // word); it only counts.
  struct FrameCursor {
    uint8_t hdr[12] = {};
    size_t hdr_have = 0;
    uint64_t payload_left = 0;
    bool at_boundary() const { return hdr_have == 0 && payload_left == 0; }
    // Steps over up to n bytes; with stop_at_boundary, returns as soon as
    // a frame ends. Returns the bytes stepped over.
    size_t advance(const uint8_t* p, size_t n, bool stop_at_boundary);
  };

  uint32_t device_id() const override { return kDeviceId; }
  uint64_t device_features() const override { return kVirtioFVersion1; }
  size_t num_queues() const override { return 2; }
  void read_config(uint64_t offset, uint8_t* data, size_t len) override;
  void activate(VirtioMmio&) override { wake(); }
  void queue_notify(VirtioMmio& t, size_t queue) override;
  void reset() override;
  void save(StateWriter& w) const override;
  bool restore(StateReader& r) override;

  uint64_t bytes_to_host() const { return to_host_.load(); }
  uint64_t bytes_to_guest() const { return to_guest_.load(); }

 private:
  void wake();
  void loop();
  void take_tx(VirtioMmio& t);     // lock held
  void flush_out();                // lock held
  void fill_rx(VirtioMmio& t);     // lock held
  void disconnect(const std::string& why);  // lock held

  void deliver(VirtioMmio& t);  // lock held: whole frames from in_ into the guest

  int fd_;
  UniqueFd owned_fd_;  // after reattach(): fd_ is this
  std::function<void(const std::string&)> on_disconnect_;
  UniqueFd wake_fd_;
  VirtioMmio* transport_ = nullptr;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  std::string out_;              // GUARDED_BY(transport lock)
  FrameCursor out_cursor_;       // GUARDED_BY(transport lock): over the bytes written to the host
  bool resync_ = false;          // GUARDED_BY(transport lock): drop guest bytes up to a boundary first
  std::string in_;               // GUARDED_BY(transport lock): read from the host, not yet in the guest
  size_t in_whole_ = 0;          // GUARDED_BY(transport lock): in_'s prefix of whole frames
  FrameCursor in_cursor_;        // GUARDED_BY(transport lock): over the bytes read from the host
  bool paused_ = false;          // GUARDED_BY(transport lock)
  bool disconnected_ = false;    // GUARDED_BY(transport lock)
  uint64_t dropped_chains_ = 0;  // GUARDED_BY(transport lock): chains larger than 2 * kOutMax
  std::atomic<uint64_t> to_host_{0}, to_guest_{0};
};

}  // namespace sg::vmm
