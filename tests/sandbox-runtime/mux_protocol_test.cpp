// Mux against a hostile or broken peer: the test plays the host by writing
// hand-crafted frames on one end of the channel and reading the agent-side
// Mux's answers on it.
#include <doctest/doctest.h>

#include "tests/sandbox-runtime/mux_harness.h"
#include <condition_variable>
#include <set>
#include <tuple>

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

// ---- Hold (docs/channel.md, "Hold") ----

namespace {

// True when nothing arrives on fd within ms: the check that a held side
// sends nothing (a bound on a negative, not a synchronisation).
bool quiet_for(int fd, int ms) {
  struct pollfd p = {fd, POLLIN, 0};
  return ::poll(&p, 1, ms) == 0;
}

}  // namespace

TEST_CASE("mux hold: the agent answers HELD last, holds its output, RELEASE lets it go in order") {
  RawPeer p;
  p.send(1, FrameType::kOpen, "{}");
  auto acc = p.next(false);
  REQUIRE(acc);
  REQUIRE(p.locals.size() == 1);
  REQUIRE(write_all(p.locals[0].get(), "before"));
  auto d1 = p.next();
  REQUIRE(d1);
  CHECK(d1->type == FrameType::kData);
  CHECK(d1->payload == "before");
  p.send(0, FrameType::kHold, "");
  auto held = p.next();
  REQUIRE(held);
  CHECK(held->stream == 0);
  CHECK(held->type == FrameType::kHeld);
  // Output produced during the hold waits behind the cut.
  REQUIRE(write_all(p.locals[0].get(), "during"));
  CHECK(quiet_for(p.chan.first.get(), 300));
  CHECK(p.dec.buffered() == 0);
  // Input still flows to the stream while held.
  p.send(1, FrameType::kData, "in");
  std::string got;
  REQUIRE(read_exact(p.locals[0].get(), got, 2));
  CHECK(got == "in");
  p.send(0, FrameType::kRelease, "");
  std::string data;
  while (data.size() < 6) {
    auto f = p.next();
    REQUIRE(f);
    if (f->type == FrameType::kData) data += f->payload;
  }
  CHECK(data == "during");
  CHECK(p.mux->stats().open_streams == 1);
}

TEST_CASE("mux hold: RELEASE reset drops every stream and what was queued after HELD") {
  RawPeer p;
  p.send(1, FrameType::kOpen, "{}");
  REQUIRE(p.next(false));
  REQUIRE(p.locals.size() == 1);
  p.send(0, FrameType::kHold, "");
  auto held = p.next();
  REQUIRE(held);
  REQUIRE(held->type == FrameType::kHeld);
  REQUIRE(write_all(p.locals[0].get(), "stale"));
  CHECK(quiet_for(p.chan.first.get(), 300));
  p.send(0, FrameType::kRelease, "reset");
  // A new host reuses stream id 1: the first thing back is its acceptance,
  // not the old stream's bytes.
  p.send(1, FrameType::kOpen, "{}");
  auto f = p.next(false);
  REQUIRE(f);
  CHECK(f->stream == 1);
  CHECK(f->type == FrameType::kCredit);
  CHECK(f->payload == u32le(0));
  // The old stream's local end saw its stream go.
  std::string rest;
  CHECK(read_to_eof(p.locals[0].get(), rest));
  CHECK(p.mux->stats().open_streams == 1);
}

TEST_CASE("mux hold: RELEASE reset without a hold drops the streams (a clone of a quiet snapshot)") {
  RawPeer p;
  p.send(1, FrameType::kOpen, "{}");
  REQUIRE(p.next(false));
  p.send(0, FrameType::kRelease, "reset");
  std::string rest;
  REQUIRE(p.locals.size() == 1);
  CHECK(read_to_eof(p.locals[0].get(), rest));
  CHECK(p.mux->stats().open_streams == 0);
}

TEST_CASE("mux hold: HOLD on a data stream, HELD to the agent and a bad RELEASE are channel errors") {
  for (auto [stream, type, payload] : {std::tuple<uint32_t, FrameType, const char*>{3, FrameType::kHold, ""},
                                       {0, FrameType::kHeld, ""},
                                       {0, FrameType::kRelease, "later"},
                                       {0, FrameType::kHold, "x"}}) {
    RawPeer p;
    p.send(stream, type, payload);
    p.t.join();
    p.joined = true;
    REQUIRE_FALSE(p.result.ok());
    CHECK(p.result.error().message().find("unexpected") != std::string::npos);
  }
}

TEST_CASE("mux hold: host hold() returns once HELD arrived; streams work again after release()") {
  Server srv(echo);
  MuxPair mp(connect_port);
  UniqueFd s = mp.open(port_payload(srv.port()));
  REQUIRE(write_all(s.get(), "ping"));
  std::string got;
  REQUIRE(read_exact(s.get(), got, 4));
  REQUIRE(mp.host->hold(std::chrono::milliseconds(10000)));
  CHECK(mp.host->hold(std::chrono::milliseconds(10)).error().kind() == ErrorKind::kConflict);
  // Written during the hold: it goes out after the release.
  REQUIRE(write_all(s.get(), "pong"));
  UniqueFd s2 = mp.open(port_payload(srv.port()));
  CHECK(quiet_for(s.get(), 300));
  mp.host->release(false);
  got.clear();
  REQUIRE(read_exact(s.get(), got, 4));
  CHECK(got == "pong");
  REQUIRE(write_all(s2.get(), "two"));
  got.clear();
  REQUIRE(read_exact(s2.get(), got, 3));
  CHECK(got == "two");
  mp.join();
}

TEST_CASE("mux hold: a peer that never answers HELD times the hold out, and RELEASE follows HOLD") {
  auto [host_end, raw] = socket_pair();
  channel::MuxConfig c;
  c.channel_fd = host_end.get();
  c.odd_ids = true;
  channel::Mux host(c, nullptr, nullptr);
  Status result;
  std::thread t([&] { result = host.run(); });
  Status h = host.hold(std::chrono::milliseconds(200));
  REQUIRE_FALSE(h.ok());
  CHECK(h.error().kind() == ErrorKind::kTimeout);
  channel::Decoder dec;
  std::vector<Frame> frames;
  char buf[4096];
  while (frames.size() < 2) {
    ssize_t n = ::recv(raw.get(), buf, sizeof buf, 0);
    REQUIRE(n > 0);
    REQUIRE(dec.feed(std::string_view(buf, static_cast<size_t>(n))));
    while (auto f = dec.next()) frames.push_back(*f);
  }
  CHECK(frames[0].type == FrameType::kHold);
  CHECK(frames[1].type == FrameType::kRelease);
  CHECK(frames[1].payload.empty());
  // A HELD that comes late is dropped, and another hold can start.
  REQUIRE(write_all(raw.get(), channel::encode(Frame{0, FrameType::kHeld, ""})));
  host.stop();
  t.join();
  CHECK(result.ok());
}

TEST_CASE("mux hold: RELEASE reset keeps its place among control messages; busy streams go, the next message is answered") {
  // Servers that write without end, as a process's output stream does.
  Server firehose([](int fd) {
    std::string chunk(16384, 'f');
    while (write_all(fd, chunk)) {
    }
  });
  std::mutex mu;
  std::condition_variable cv;
  int pongs = 0;
  channel::Mux* agent_mux = nullptr;
  MuxPair mp(
      connect_port,
      [&](std::string_view p) {
        if (p.find("ping") != std::string_view::npos) (void)agent_mux->send_control(R"({"type":"pong"})");
      },
      [&](std::string_view p) {
        if (p.find("pong") == std::string_view::npos) return;
        std::lock_guard<std::mutex> l(mu);
        ++pongs;
        cv.notify_all();
      });
  agent_mux = mp.agent.get();
  std::vector<UniqueFd> ends;
  for (int i = 0; i < 4; ++i) ends.push_back(mp.open(port_payload(firehose.port())));
  std::string got;
  REQUIRE(read_exact(ends[0].get(), got, 100000));
  mp.host->release(/*reset=*/true);
  REQUIRE(mp.host->send_control(R"({"type":"ping"})"));
  std::unique_lock<std::mutex> l(mu);
  CHECK(cv.wait_for(l, std::chrono::seconds(10), [&] { return pongs > 0; }));
  l.unlock();
  CHECK(mp.agent->stats().open_streams == 0);
  ends.clear();
  mp.join();
}

// A new host's barrier after a restart (Mux::settle): the agent's frames
// for the previous host (an answer on stream 0, output of a host-numbered
// stream) are dropped until HELD, nothing of the new host's goes out
// before RELEASE, and a peer slower than the wait only delays it.
TEST_CASE("mux settle: frames for the previous host are dropped until HELD; RELEASE then goes out by itself") {
  auto [host_end, raw] = socket_pair();
  channel::MuxConfig c;
  c.channel_fd = host_end.get();
  c.odd_ids = true;
  std::mutex mu;
  std::vector<std::string> controls;
  channel::Mux host(c, nullptr, [&](std::string_view p) {
    std::lock_guard<std::mutex> l(mu);
    controls.emplace_back(p);
  });
  Status result;
  std::thread t([&] { result = host.run(); });
  channel::Decoder dec;
  char buf[4096];
  auto next = [&]() -> Frame {
    for (;;) {
      if (auto f = dec.next()) return *f;
      ssize_t n = ::recv(raw.get(), buf, sizeof buf, 0);
      REQUIRE(n > 0);
      REQUIRE(dec.feed(std::string_view(buf, static_cast<size_t>(n))));
    }
  };
  auto send = [&](uint32_t stream, FrameType type, std::string payload) {
    REQUIRE(write_all(raw.get(), channel::encode(Frame{stream, type, std::move(payload)})));
  };

  host.release(/*reset=*/true);
  Status s = host.settle(std::chrono::milliseconds(100));
  REQUIRE_FALSE(s.ok());
  CHECK(s.error().kind() == ErrorKind::kTimeout);
  CHECK(host.hold(std::chrono::milliseconds(10)).error().kind() == ErrorKind::kConflict);
  Frame f = next();
  CHECK(f.type == FrameType::kRelease);
  CHECK(f.payload == "reset");
  CHECK(next().type == FrameType::kHold);
  // The new host asks: a stream (id 1, as the previous host's first) and
  // a control message. Both wait behind the hold.
  auto [mine, theirs] = socket_pair();
  auto id = host.open_stream(std::move(theirs), "{}");
  REQUIRE(id);
  CHECK(*id == 1);
  REQUIRE(host.send_control(R"({"type":"ping","id":1})"));
  // What the agent had sent the previous host, arriving now.
  send(0, FrameType::kData, R"({"type":"pong","id":1})");
  send(1, FrameType::kData, "stale");
  send(1, FrameType::kClose, "");
  send(0, FrameType::kHeld, "");
  // RELEASE first, then what was queued behind the hold.
  f = next();
  CHECK(f.type == FrameType::kRelease);
  CHECK(f.payload.empty());
  // (A Mux round sends queued control messages before new OPENs.)
  std::set<std::tuple<uint32_t, int, std::string>> queued;
  for (int i = 0; i < 2; ++i) {
    f = next();
    queued.emplace(f.stream, static_cast<int>(f.type), f.payload);
  }
  CHECK(queued == std::set<std::tuple<uint32_t, int, std::string>>{
                      {1, static_cast<int>(FrameType::kOpen), "{}"},
                      {0, static_cast<int>(FrameType::kData), R"({"type":"ping","id":1})"}});
  // The agent's answers after HELD are the new host's.
  send(1, FrameType::kCredit, u32le(0));
  send(1, FrameType::kData, "fresh");
  send(0, FrameType::kData, R"({"type":"pong","id":1,"new":true})");
  std::string got;
  REQUIRE(read_exact(mine.get(), got, 5));
  CHECK(got == "fresh");
  // The stream was not closed by the stale CLOSE: it still carries data.
  REQUIRE(write_all(mine.get(), "more"));
  do f = next();
  while (f.type == FrameType::kCredit);  // the window given back for "fresh"
  CHECK(f.stream == 1);
  CHECK(f.type == FrameType::kData);
  CHECK(f.payload == "more");
  CHECK(host.stats().stale_dropped == 3);
  host.stop();
  t.join();
  CHECK(result.ok());
  std::lock_guard<std::mutex> l(mu);
  REQUIRE(controls.size() == 1);
  CHECK(controls[0] == R"({"type":"pong","id":1,"new":true})");
}

TEST_CASE("mux settle: a running agent answers at once; its streams work after it") {
  Server srv(echo);
  MuxPair mp(connect_port);
  mp.host->release(/*reset=*/true);
  REQUIRE(mp.host->settle(std::chrono::milliseconds(10000)));
  UniqueFd s = mp.open(port_payload(srv.port()));
  REQUIRE(write_all(s.get(), "ping"));
  std::string got;
  REQUIRE(read_exact(s.get(), got, 4));
  CHECK(got == "ping");
  // The hold is over: another can start.
  REQUIRE(mp.host->hold(std::chrono::milliseconds(10000)));
  mp.host->release(false);
  mp.join();
}
