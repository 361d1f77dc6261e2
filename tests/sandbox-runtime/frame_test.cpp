// Channel frame codec: round trips, every invalid header field, split feeds,
// bounds, and random input.
#include <doctest/doctest.h>

#include <random>

#include "sandbox-runtime/channel/frame.h"

using namespace sg::channel;

namespace {

std::string header(uint32_t stream, uint8_t type, uint8_t flags, uint16_t reserved, uint32_t length) {
  std::string h(kHeaderSize, '\0');
  auto put32 = [&](size_t at, uint32_t v) {
    for (int i = 0; i < 4; ++i) h[at + i] = static_cast<char>((v >> (8 * i)) & 0xff);
  };
  put32(0, stream);
  h[4] = static_cast<char>(type);
  h[5] = static_cast<char>(flags);
  h[6] = static_cast<char>(reserved & 0xff);
  h[7] = static_cast<char>(reserved >> 8);
  put32(8, length);
  return h;
}

}  // namespace

TEST_CASE("frame: encode layout is little-endian and 12 bytes of header") {
  std::string b = encode(Frame{0x01020304, FrameType::kCredit, "abc"});
  CHECK(b == header(0x01020304, 4, 0, 0, 3) + "abc");
}

TEST_CASE("frame: round trip of every type, empty and maximal payloads") {
  for (uint8_t t = 0; t <= kMaxFrameType; ++t) {
    for (size_t len : {size_t{0}, size_t{1}, size_t{1000}, size_t{kMaxPayload}}) {
      Frame f{7u + t, static_cast<FrameType>(t), std::string(len, static_cast<char>('a' + t))};
      std::string b = encode(f);
      REQUIRE(b.size() == kHeaderSize + len);
      DecodeResult r = decode(b);
      REQUIRE(r.status == DecodeStatus::kOk);
      CHECK(r.consumed == b.size());
      CHECK(r.frame.stream == f.stream);
      CHECK(r.frame.type == f.type);
      CHECK(r.frame.payload == f.payload);
    }
  }
}

TEST_CASE("frame: decode needs the whole frame") {
  std::string b = encode(Frame{1, FrameType::kData, "hello"});
  for (size_t i = 0; i < b.size(); ++i) CHECK(decode(std::string_view(b).substr(0, i)).status == DecodeStatus::kNeedMore);
  CHECK(decode(b).status == DecodeStatus::kOk);
}

TEST_CASE("frame: each invalid header field is rejected from the header alone") {
  SUBCASE("unknown type") {
    for (int t : {8, 9, 0x7f, 0xff}) {
      DecodeResult r = decode(header(0, static_cast<uint8_t>(t), 0, 0, 0));
      CHECK(r.status == DecodeStatus::kInvalid);
      CHECK(r.error.find("type") != std::string::npos);
    }
  }
  SUBCASE("nonzero flags") {
    for (int f : {1, 0x80, 0xff}) CHECK(decode(header(0, 0, static_cast<uint8_t>(f), 0, 0)).status == DecodeStatus::kInvalid);
  }
  SUBCASE("nonzero reserved") {
    for (int r : {1, 0x100, 0xffff}) CHECK(decode(header(0, 0, 0, static_cast<uint16_t>(r), 0)).status == DecodeStatus::kInvalid);
  }
  SUBCASE("length over the maximum, without its payload present") {
    DecodeResult r = decode(header(0, 0, 0, 0, kMaxPayload + 1));
    CHECK(r.status == DecodeStatus::kInvalid);
    CHECK(r.error.find("exceeds") != std::string::npos);
    CHECK(decode(header(0, 0, 0, 0, 0xffffffffu)).status == DecodeStatus::kInvalid);
    // Exactly the maximum is fine, and waits for its payload.
    CHECK(decode(header(0, 0, 0, 0, kMaxPayload)).status == DecodeStatus::kNeedMore);
  }
}

TEST_CASE("decoder: byte-by-byte and split feeds yield the same frames") {
  std::string stream;
  std::vector<Frame> sent;
  for (int i = 0; i < 20; ++i) {
    Frame f{static_cast<uint32_t>(i % 3), static_cast<FrameType>(i % 5), std::string(static_cast<size_t>(i * 37), 'x')};
    encode(f, stream);
    sent.push_back(f);
  }
  for (size_t chunk : {size_t{1}, size_t{5}, size_t{12}, size_t{13}, size_t{4096}, stream.size()}) {
    Decoder d;
    std::vector<Frame> got;
    for (size_t i = 0; i < stream.size(); i += chunk) {
      REQUIRE(d.feed(std::string_view(stream).substr(i, chunk)));
      while (auto f = d.next()) got.push_back(*f);
      CHECK(d.buffered() < kHeaderSize + kMaxPayload);
    }
    REQUIRE(got.size() == sent.size());
    for (size_t i = 0; i < got.size(); ++i) {
      CHECK(got[i].stream == sent[i].stream);
      CHECK(got[i].type == sent[i].type);
      CHECK(got[i].payload == sent[i].payload);
    }
    CHECK(d.buffered() == 0);
  }
}

TEST_CASE("decoder: maximal payload split across feeds") {
  Frame f{9, FrameType::kData, std::string(kMaxPayload, 'm')};
  std::string b = encode(f);
  Decoder d;
  REQUIRE(d.feed(std::string_view(b).substr(0, 100)));
  CHECK(!d.next());
  REQUIRE(d.feed(std::string_view(b).substr(100)));
  auto got = d.next();
  REQUIRE(got);
  CHECK(got->payload == f.payload);
}

TEST_CASE("decoder: oversized length is rejected at the header, nothing buffered") {
  Decoder d;
  CHECK(d.feed(encode(Frame{0, FrameType::kData, "ok"})));
  std::string bad = header(0, 0, 0, 0, kMaxPayload + 1);
  // Feeding the first 11 bytes is not yet an error; the 12th makes it one.
  CHECK(d.feed(bad.substr(0, 11)));
  CHECK_FALSE(d.feed(bad.substr(11)));
  CHECK(d.broken());
  CHECK(d.error().find("exceeds") != std::string::npos);
  CHECK(d.buffered() == 0);
  CHECK_FALSE(d.next());
  CHECK_FALSE(d.feed(std::string(1000, 'x')));
  CHECK(d.buffered() == 0);
}

TEST_CASE("decoder: an invalid header after valid frames breaks the stream") {
  Decoder d;
  std::string b = encode(Frame{1, FrameType::kData, "a"}) + header(1, 9, 0, 0, 0);
  CHECK_FALSE(d.feed(b));
  CHECK(d.broken());
  CHECK(d.error().find("type 9") != std::string::npos);
}

TEST_CASE("decoder: random bytes never crash and stay bounded") {
  std::mt19937 rng(12345);
  for (int iter = 0; iter < 2000; ++iter) {
    Decoder d;
    size_t frames = 0;
    for (int feeds = 0; feeds < 20 && !d.broken(); ++feeds) {
      std::string bytes(rng() % 200, '\0');
      for (char& c : bytes) c = static_cast<char>(rng());
      // Mostly-valid headers now and then, so the payload paths run too.
      if (rng() % 3 == 0) bytes = header(rng(), static_cast<uint8_t>(rng() % 6), 0, 0, rng() % 300) + bytes;
      d.feed(bytes);
      while (auto f = d.next()) {
        CHECK(f->payload.size() <= kMaxPayload);
        ++frames;
      }
      CHECK(d.buffered() <= kHeaderSize + kMaxPayload);
    }
    (void)frames;
  }
}
