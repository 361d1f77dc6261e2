// Mux against a hostile or broken peer: the test plays the host by writing
// hand-crafted frames on one end of the channel and reading the agent-side
// Mux's answers on it.
#include <doctest/doctest.h>

#include "tests/sandbox-runtime/mux_harness.h"

using namespace sg;
using namespace sg::muxtest;
using channel::Frame;
using channel::FrameType;

namespace {

// The agent-side Mux on its own thread; the test holds the raw host end.
struct RawPeer {
  std::pair<UniqueFd, UniqueFd> chan = socket_pair();
  std::unique_ptr<channel::Mux> mux;
  std::thread t;
  Status result;
  bool joined = false;
  channel::Decoder dec;
  std::mutex mu;
  std::vector<UniqueFd> locals;  // far ends of the streams the Mux accepted, never read

  explicit RawPeer(size_t max_streams = 1024, bool start = true) {
    channel::MuxConfig c;
    c.channel_fd = chan.second.get();
    c.odd_ids = false;
    c.max_streams = max_streams;
    c.max_control_out = 1000;
    mux = std::make_unique<channel::Mux>(
        c,
        [this](std::string_view) -> Result<UniqueFd> {
          auto [a, b] = socket_pair();
          // Small buffers, so the window, not the kernel, decides what fits.
          int sz = 4096;
          ::setsockopt(a.get(), SOL_SOCKET, SO_RCVBUF, &sz, sizeof sz);
          ::setsockopt(b.get(), SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz);
          std::lock_guard<std::mutex> l(mu);
          locals.push_back(std::move(a));
          return std::move(b);
        },
        nullptr);
    if (start) run();
  }
  void run() {
    t = std::thread([this] { result = mux->run(); });
  }
  void join() {
    if (joined) return;
    mux->stop();
    if (t.joinable()) t.join();
    joined = true;
  }
  ~RawPeer() { join(); }

  void send(uint32_t stream, FrameType type, std::string payload) {
    REQUIRE(write_all(chan.first.get(), channel::encode(Frame{stream, type, std::move(payload)})));
  }
  // Next frame from the Mux that is not a CREDIT top-up (CREDIT with a
  // non-zero value), or nullopt on EOF/timeout.
  std::optional<Frame> next(bool skip_credit = true) {
    for (;;) {
      while (auto f = dec.next()) {
        if (skip_credit && f->type == FrameType::kCredit && f->payload != std::string(4, '\0')) continue;
        return f;
      }
      char buf[65536];
      ssize_t n = ::recv(chan.first.get(), buf, sizeof buf, 0);
      if (n <= 0) return std::nullopt;
      REQUIRE(dec.feed(std::string_view(buf, static_cast<size_t>(n))));
    }
  }
};

std::string u32le(uint32_t v) {
  std::string s(4, '\0');
  for (int i = 0; i < 4; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

}  // namespace

TEST_CASE("mux protocol: OPEN is accepted with CREDIT 0") {
  RawPeer p;
  p.send(1, FrameType::kOpen, "{}");
  auto f = p.next(false);
  REQUIRE(f);
  CHECK(f->stream == 1);
  CHECK(f->type == FrameType::kCredit);
  CHECK(f->payload == u32le(0));
  CHECK(p.mux->stats().open_streams == 1);
}

TEST_CASE("mux protocol: DATA beyond the window resets the stream and is counted") {
  RawPeer p;
  p.send(1, FrameType::kOpen, "{}");
  auto f = p.next(false);
  REQUIRE(f);
  REQUIRE(f->type == FrameType::kCredit);
  // 5 x 64 KiB = 320 KiB > 256 KiB, while the local consumer reads nothing
  // (only the small socket buffers drain, earning a few KiB of credit).
  for (int i = 0; i < 5; ++i) p.send(1, FrameType::kData, std::string(channel::kMaxPayload, 'd'));
  f = p.next();
  REQUIRE(f);
  CHECK(f->stream == 1);
  CHECK(f->type == FrameType::kReset);
  CHECK(f->payload == "DATA beyond the window");
  // The channel stays usable and the stream is gone.
  p.send(3, FrameType::kOpen, "{}");
  f = p.next(false);
  REQUIRE(f);
  CHECK(f->stream == 3);
  CHECK(f->type == FrameType::kCredit);
  auto st = p.mux->stats();
  CHECK(st.protocol_errors == 1);
  CHECK(st.open_streams == 1);
  CHECK(st.peak_stream_buffered <= channel::kInitialWindow);
}

TEST_CASE("mux protocol: unknown stream, wrong parity, credit overflow, bad CREDIT, double OPEN") {
  RawPeer p;
  // DATA on a stream nobody opened.
  p.send(7, FrameType::kData, "x");
  auto f = p.next();
  REQUIRE(f);
  CHECK((f->stream == 7 && f->type == FrameType::kReset && f->payload == "unknown stream"));
  // The peer opening an id of the agent's parity.
  p.send(2, FrameType::kOpen, "{}");
  f = p.next();
  REQUIRE(f);
  CHECK((f->stream == 2 && f->type == FrameType::kReset));
  // Credit overflow.
  p.send(9, FrameType::kOpen, "{}");
  f = p.next(false);
  REQUIRE((f && f->type == FrameType::kCredit));
  p.send(9, FrameType::kCredit, u32le(0x7fffffff));
  f = p.next();
  REQUIRE(f);
  CHECK((f->stream == 9 && f->type == FrameType::kReset && f->payload == "credit overflow"));
  // A CREDIT that is not 4 bytes.
  p.send(11, FrameType::kOpen, "{}");
  f = p.next(false);
  REQUIRE((f && f->type == FrameType::kCredit));
  p.send(11, FrameType::kCredit, "abc");
  f = p.next();
  REQUIRE(f);
  CHECK((f->stream == 11 && f->type == FrameType::kReset));
  // OPEN on an open stream.
  p.send(13, FrameType::kOpen, "{}");
  f = p.next(false);
  REQUIRE((f && f->type == FrameType::kCredit));
  p.send(13, FrameType::kOpen, "{}");
  f = p.next();
  REQUIRE(f);
  CHECK((f->stream == 13 && f->type == FrameType::kReset));
  // Frames for a stream that was reset are dropped silently; a RESET for an
  // unknown stream is ignored.
  p.send(9, FrameType::kData, "late");
  p.send(99, FrameType::kReset, "");
  p.send(15, FrameType::kOpen, "{}");
  f = p.next(false);
  REQUIRE(f);
  CHECK((f->stream == 15 && f->type == FrameType::kCredit));
  CHECK(p.mux->stats().protocol_errors == 5);
}

TEST_CASE("mux protocol: max_streams refuses further OPENs") {
  RawPeer p(2);
  for (uint32_t id : {1u, 3u}) {
    p.send(id, FrameType::kOpen, "{}");
    auto f = p.next(false);
    REQUIRE(f);
    CHECK(f->type == FrameType::kCredit);
  }
  p.send(5, FrameType::kOpen, "{}");
  auto f = p.next();
  REQUIRE(f);
  CHECK((f->stream == 5 && f->type == FrameType::kReset));
  CHECK(f->payload.find("stream limit") != std::string::npos);
  CHECK(p.mux->stats().streams_refused == 1);
  // A local open beyond the limit fails at once.
  auto [a, b] = socket_pair();
  auto id = p.mux->open_stream(std::move(b), "{}");
  CHECK_FALSE(id);
}

TEST_CASE("mux protocol: a malformed frame makes run() fail and closes every stream") {
  RawPeer p;
  p.send(1, FrameType::kOpen, "{}");
  REQUIRE(p.next(false));
  std::string bad("\1\0\0\0\x09\0\0\0\0\0\0\0", 12);  // type 9
  REQUIRE(write_all(p.chan.first.get(), bad));
  p.t.join();
  p.joined = true;
  REQUIRE_FALSE(p.result.ok());
  CHECK(p.result.error().message().find("malformed frame") != std::string::npos);
  std::lock_guard<std::mutex> l(p.mu);
  REQUIRE(p.locals.size() == 1);
  std::string rest;
  CHECK(read_to_eof(p.locals[0].get(), rest));
}

TEST_CASE("mux protocol: a non-DATA frame on stream 0 is a channel error") {
  RawPeer p;
  p.send(0, FrameType::kClose, "");
  p.t.join();
  p.joined = true;
  REQUIRE_FALSE(p.result.ok());
  CHECK(p.result.error().message().find("control stream frame") != std::string::npos);
}

TEST_CASE("mux protocol: control output past max_control_out closes the channel") {
  RawPeer p(1024, /*start=*/false);
  // Before run() nothing drains: 200-byte messages against a 1000-byte bound.
  int accepted = 0;
  for (int i = 0; i < 10; ++i)
    if (p.mux->send_control(std::string(200, 'c'))) ++accepted;
  CHECK(accepted == 4);
  p.run();
  p.t.join();
  p.joined = true;
  REQUIRE_FALSE(p.result.ok());
  CHECK(p.result.error().message().find("not reading") != std::string::npos);
}

TEST_CASE("mux protocol: channel EOF ends run() cleanly; then open_stream fails") {
  RawPeer p;
  p.chan.first.reset();
  p.t.join();
  p.joined = true;
  CHECK(p.result.ok());
  auto [a, b] = socket_pair();
  auto id = p.mux->open_stream(std::move(b), "{}");
  REQUIRE_FALSE(id);
  CHECK(id.error().kind() == ErrorKind::kUnavailable);
}

TEST_CASE("mux protocol: frames split into single bytes are reassembled") {
  RawPeer p;
  std::string bytes = channel::encode(Frame{1, FrameType::kOpen, "{}"}) +
                      channel::encode(Frame{1, FrameType::kData, "abc"}) +
                      channel::encode(Frame{0, FrameType::kData, "{}"});
  for (char c : bytes) REQUIRE(write_all(p.chan.first.get(), &c, 1));
  auto f = p.next(false);
  REQUIRE(f);
  CHECK((f->stream == 1 && f->type == FrameType::kCredit && f->payload == u32le(0)));
  std::lock_guard<std::mutex> l(p.mu);
  REQUIRE(p.locals.size() == 1);
  std::string got;
  REQUIRE(read_exact(p.locals[0].get(), got, 3));
  CHECK(got == "abc");
  CHECK(p.mux->stats().protocol_errors == 0);
}
