// Channel frames: the wire unit of the host <-> sandbox multiplexed channel.
//
// One byte stream per sandbox (a unix socket pair in the process backend,
// virtio-console in a microVM) carries frames; docs/channel.md is the format's
// specification. The codec is pure (no I/O) so it can be fuzzed and tested on
// byte strings. Every length read from the wire is bounded before use: the
// peer is hostile.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace sg::channel {

// Header layout (little-endian), 12 bytes:
//   u32 stream   stream id; 0 is the control stream
//   u8  type     FrameType
//   u8  flags    reserved, must be 0
//   u16 reserved must be 0
//   u32 length   payload bytes that follow, at most kMaxPayload
inline constexpr size_t kHeaderSize = 12;
inline constexpr uint32_t kMaxPayload = 64 * 1024;
inline constexpr uint32_t kControlStream = 0;

enum class FrameType : uint8_t {
  kData = 0,    // payload bytes for the stream
  kOpen = 1,    // open a stream; payload: JSON {"port":N} (inbound) or {"service":"..."} (outbound)
  kClose = 2,   // half-close: the sender will send no more data on the stream
  kReset = 3,   // abort the stream in both directions; payload: optional UTF-8 reason
  kCredit = 4,  // flow control: payload is u32 LE, bytes the sender may additionally send
  // A cut of the channel (docs/channel.md, "Hold"), stream 0 only:
  kHold = 5,     // host: answer HELD, then send nothing until RELEASE
  kHeld = 6,     // agent: the last frame before its output stops
  kRelease = 7,  // host: carry on; payload "reset": a new host, drop every stream and what was queued
};
inline constexpr uint8_t kMaxFrameType = 7;

struct Frame {
  uint32_t stream = 0;
  FrameType type = FrameType::kData;
  std::string payload;
};

// Appends the encoded frame to out. Payload must be <= kMaxPayload (asserted).
void encode(const Frame& f, std::string& out);
std::string encode(const Frame& f);

enum class DecodeStatus { kOk, kNeedMore, kInvalid };

struct DecodeResult {
  DecodeStatus status = DecodeStatus::kNeedMore;
  size_t consumed = 0;  // bytes used from the input when kOk
  Frame frame;
  std::string error;  // why, when kInvalid
};

// Decodes one frame from the front of in. kNeedMore: not a whole frame yet.
// kInvalid: the peer broke the format (bad type, flags, reserved or length);
// the channel must then be closed, since framing is lost.
DecodeResult decode(std::string_view in);

// Incremental decoder for a byte stream: feed bytes, pop frames. Buffers at
// most one partial frame (kHeaderSize + kMaxPayload bytes) beyond the whole
// frames fed but not yet popped; callers drain next() after every feed.
// Headers are validated in feed(), so an invalid length fails at once.
class Decoder {
 public:
  // Appends bytes; returns false (and stays broken) once the stream is invalid.
  bool feed(std::string_view bytes);
  // Next complete frame, if any.
  std::optional<Frame> next();
  bool broken() const { return broken_; }
  const std::string& error() const { return error_; }
  size_t buffered() const { return buf_.size() - pos_; }

 private:
  std::string buf_;
  size_t pos_ = 0;      // start of the first undelivered frame in buf_
  size_t checked_ = 0;  // start of the first frame whose header is not yet validated
  bool broken_ = false;
  std::string error_;
};

// Control messages on stream 0 are DATA frames whose payload is one JSON
// object with a "type" field: see docs/channel.md for the message set.

}  // namespace sg::channel
