// Channel frame codec (docs/channel.md). Pure byte-string code: the header is
// validated field by field before the payload length is trusted, so a hostile
// peer can make the decoder reject the stream but never make it buffer more
// than one maximal frame.
#include "sandbox-runtime/channel/frame.h"

#include <cassert>
#include <cstring>

namespace sg::channel {

namespace {

void put_u32(std::string& out, uint32_t v) {
  char b[4] = {static_cast<char>(v & 0xff), static_cast<char>((v >> 8) & 0xff), static_cast<char>((v >> 16) & 0xff),
               static_cast<char>((v >> 24) & 0xff)};
  out.append(b, 4);
}

uint32_t get_u32(const unsigned char* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) | (static_cast<uint32_t>(p[2]) << 16) |
         (static_cast<uint32_t>(p[3]) << 24);
}

}  // namespace

void encode(const Frame& f, std::string& out) {
  assert(f.payload.size() <= kMaxPayload);
  assert(static_cast<uint8_t>(f.type) <= kMaxFrameType);
  out.reserve(out.size() + kHeaderSize + f.payload.size());
  put_u32(out, f.stream);
  out.push_back(static_cast<char>(f.type));
  out.push_back('\0');  // flags
  out.push_back('\0');  // reserved, 2 bytes
  out.push_back('\0');
  put_u32(out, static_cast<uint32_t>(f.payload.size()));
  out.append(f.payload);
}

std::string encode(const Frame& f) {
  std::string out;
  encode(f, out);
  return out;
}

DecodeResult decode(std::string_view in) {
  DecodeResult r;
  // The header is checked as soon as it is complete, before any payload is
  // waited for: an invalid length must fail now, not after buffering it.
  if (in.size() < kHeaderSize) return r;
  const auto* p = reinterpret_cast<const unsigned char*>(in.data());
  uint32_t stream = get_u32(p);
  uint8_t type = p[4];
  uint8_t flags = p[5];
  uint16_t reserved = static_cast<uint16_t>(p[6] | (p[7] << 8));
  uint32_t length = get_u32(p + 8);
  if (type > kMaxFrameType) {
    r.status = DecodeStatus::kInvalid;
    r.error = "unknown frame type " + std::to_string(type);
    return r;
  }
  if (flags != 0) {
    r.status = DecodeStatus::kInvalid;
    r.error = "nonzero flags " + std::to_string(flags);
    return r;
  }
  if (reserved != 0) {
    r.status = DecodeStatus::kInvalid;
    r.error = "nonzero reserved field " + std::to_string(reserved);
    return r;
  }
  if (length > kMaxPayload) {
    r.status = DecodeStatus::kInvalid;
    r.error = "payload length " + std::to_string(length) + " exceeds maximum " + std::to_string(kMaxPayload);
    return r;
  }
  if (in.size() - kHeaderSize < length) return r;
  r.status = DecodeStatus::kOk;
  r.consumed = kHeaderSize + length;
  r.frame.stream = stream;
  r.frame.type = static_cast<FrameType>(type);
  r.frame.payload.assign(in.data() + kHeaderSize, length);
  return r;
}

bool Decoder::feed(std::string_view bytes) {
  if (broken_) return false;
  buf_.append(bytes.data(), bytes.size());
  // Every header is validated as soon as its 12 bytes are in, so a bad
  // length is rejected before any of its payload is buffered. checked_ is the
  // offset of the first frame whose header has not been validated yet.
  if (checked_ < pos_) checked_ = pos_;
  while (buf_.size() - checked_ >= kHeaderSize) {
    std::string_view head(buf_.data() + checked_, kHeaderSize);
    DecodeResult r = decode(head);
    if (r.status == DecodeStatus::kInvalid) {
      broken_ = true;
      error_ = r.error;
      buf_.clear();
      pos_ = checked_ = 0;
      return false;
    }
    size_t len = get_u32(reinterpret_cast<const unsigned char*>(head.data()) + 8);
    if (buf_.size() - checked_ < kHeaderSize + len) break;
    checked_ += kHeaderSize + len;
  }
  return true;
}

std::optional<Frame> Decoder::next() {
  if (broken_) return std::nullopt;
  DecodeResult r = decode(std::string_view(buf_.data() + pos_, buf_.size() - pos_));
  if (r.status == DecodeStatus::kInvalid) {
    // feed() validated every header already; kept for safety.
    broken_ = true;
    error_ = r.error;
    return std::nullopt;
  }
  if (r.status == DecodeStatus::kNeedMore) {
    // Compact so the buffer holds only the partial frame.
    if (pos_ > 0) {
      buf_.erase(0, pos_);
      checked_ -= pos_;
      pos_ = 0;
    }
    return std::nullopt;
  }
  pos_ += r.consumed;
  if (pos_ == buf_.size()) {
    buf_.clear();
    pos_ = checked_ = 0;
  }
  return std::move(r.frame);
}

}  // namespace sg::channel
