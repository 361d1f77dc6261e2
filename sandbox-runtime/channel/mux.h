// Mux: the stream multiplexer on one channel byte stream (docs/channel.md,
// "Data streams"), used on both ends: the host side (one Mux per sandbox,
// in sandgate) and the sandbox side (in sandgate-agent).
//
// Every data stream is bridged to a local file descriptor (a socketpair end
// on the host, a TCP connection to 127.0.0.1:PORT in the sandbox): bytes
// read from the local fd go out as DATA within the peer's credit; DATA from
// the peer is written to the local fd, and credit is returned as it drains.
// So memory per stream is bounded by the window (256 KiB) plus the kernel's
// socket buffers, and a consumer that stops reading stops its producer.
//
// Threads: run() is the Mux's own loop (epoll over the channel fd, every
// stream fd, an eventfd and any fds added with watch_fd()); it owns all
// stream state. open_stream(), send_control(), stop(), fail() and stats()
// may be called from any thread, including from the handlers.
//
// Acceptance rule: a stream is accepted by the first CREDIT its opener
// receives on it; this Mux accepts with CREDIT 0 (the window stays at
// kInitialWindow) and refuses with RESET "<reason>".
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "base/fd.h"
#include "base/status.h"

namespace sg::channel {

inline constexpr uint32_t kInitialWindow = 256 * 1024;
// Local fds are read (new DATA produced) only while the channel's unsent
// output is below this; control frames and credits may go past it.
inline constexpr size_t kChannelOutHighWater = 1 << 20;

struct MuxConfig {
  int channel_fd = -1;         // borrowed; set non-blocking by the Mux
  bool odd_ids = true;         // host opens odd ids, agent even ids
  size_t max_streams = 1024;   // concurrent streams; more OPENs are RESET
  size_t max_control_out = 1 << 20;  // unsent bytes past which the channel is closed
};

class Mux {
 public:
  // A peer OPEN: return the local fd to bridge the stream to, or an Error
  // whose message becomes the RESET reason. Called on the Mux thread; must
  // not block for long (a connect to loopback is fine).
  using OpenHandler = std::function<Result<UniqueFd>(std::string_view open_payload)>;
  // A control message (stream 0 DATA payload). Called on the Mux thread.
  using ControlHandler = std::function<void(std::string_view payload)>;

  Mux(MuxConfig cfg, OpenHandler on_open, ControlHandler on_control);
  ~Mux();
  Mux(const Mux&) = delete;
  Mux& operator=(const Mux&) = delete;

  // Runs until stop(), channel EOF or a channel-level protocol error.
  // Returns Ok on stop() or clean EOF, the error otherwise: kUnavailable
  // when the peer went away (EOF in the middle of a frame, a reset or
  // broken channel), another kind for what the peer sent wrong. All stream fds
  // are closed when it returns. Call it once; stop() before run() makes it
  // return at once.
  Status run();

  // Opens a stream to the peer, bridged to local_fd (owned by the Mux from
  // now on). Returns the stream id. If the peer refuses (RESET), local_fd
  // is closed, which its other end sees as EOF / connection reset. May be
  // called before run() (the OPEN goes out when it starts). Errors:
  // kUnavailable once run() has returned, kQuota at max_streams.
  Result<uint32_t> open_stream(UniqueFd local_fd, std::string open_payload);
  // Queues a control message on stream 0 (payload <= kMaxPayload). Past
  // max_control_out unsent control bytes it fails, and run() then returns
  // an error (the peer is not reading). kUnavailable once run() returned.
  Status send_control(std::string payload);
  // A cut of the channel at a frame boundary in both directions
  // (docs/channel.md, "Hold"), for a microVM snapshot: HOLD goes out and
  // nothing after it; the peer answers HELD as its last frame. Returns once
  // HELD arrived (nothing is then in flight either way), kTimeout
  // after timeout (the hold is released), kUnavailable once run() returned,
  // kConflict while another hold is on. The host side only.
  Status hold(std::chrono::milliseconds timeout);
  // A new host's barrier, after release(true) (a restart of the host with
  // the peer running on: docs/channel.md, "Hold"): HOLD goes out and
  // nothing after it; until HELD is back, what the peer sends on stream 0
  // or on this side's streams was sent to the previous host and is
  // dropped; when HELD arrives, RELEASE goes out by itself, then what was
  // queued meanwhile. Ok if that happened within wait; kTimeout if not,
  // and then the hold stays on until HELD arrives: a slow peer delays this
  // host's frames and loses none. kUnavailable once run() returned,
  // kConflict while another hold is on. The host side only.
  Status settle(std::chrono::milliseconds wait);
  // Ends a hold (if any): RELEASE goes out, then what was queued meanwhile.
  // reset: this is a new host for the peer (a clone or a resumed snapshot):
  // it drops every stream and whatever it queued since HELD. The host side only.
  void release(bool reset);
  // Makes run() return soon (Ok). Queued output is flushed best effort.
  void stop();
  // Makes run() return soon with an internal error carrying reason (e.g.
  // a malformed control message: the channel is then closed by the owner).
  void fail(std::string reason);
  // Calls on_readable on the Mux thread whenever fd (borrowed, must stay
  // open while run() runs) is readable; level-triggered, so the handler
  // must drain it. Only before run().
  void watch_fd(int fd, std::function<void()> on_readable);

  struct Stats {
    uint64_t streams_opened = 0;
    uint64_t streams_refused = 0;
    uint64_t bytes_in = 0;   // DATA payload bytes from the peer
    uint64_t bytes_out = 0;  // DATA payload bytes to the peer
    uint64_t protocol_errors = 0;   // per-stream violations answered with RESET
    uint64_t streams_reset_in = 0;  // RESETs received for live streams
    uint64_t stale_dropped = 0;     // frames for the previous host, dropped while settling
    size_t open_streams = 0;
    // Memory held by the Mux: DATA received but not yet written to local fds
    // (each stream's share is bounded by kInitialWindow), unsent channel
    // output, and the highest values either ever reached.
    size_t stream_buffered = 0;
    size_t channel_out_buffered = 0;
    size_t peak_stream_buffered = 0;
    size_t peak_channel_out_buffered = 0;
  };
  Stats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace sg::channel
