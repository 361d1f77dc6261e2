// HostChannel's side of agent-opened streams: a sandbox connection to the
// model API proxy port travels agent Mux -> channel -> HostChannel -> the
// ServiceOpener's socketpair and back; payloads that are not
// {"service":"name"}, services the opener refuses, and a host without an
// opener are RESET with the reason. The agent end is either the real
// agent-side Mux with a ServiceForwarder or raw frames written by the test.
#include "sandbox-runtime/host/host_channel.h"

#include <doctest/doctest.h>

#include <optional>

#include "sandbox-runtime/channel/frame.h"
#include "tests/sandbox-runtime/service_harness.h"

using namespace sg;
using namespace sg::muxtest;
using namespace sg::servicetest;
using channel::Frame;
using channel::FrameType;

namespace {

// The agent end of a HostChannel's channel, driven frame by frame.
struct RawAgent {
  std::pair<UniqueFd, UniqueFd> chan = socket_pair();  // first: the host's, second: ours
  channel::Decoder dec;

  int host_fd() const { return chan.first.get(); }
  void send(uint32_t stream, FrameType type, std::string payload) {
    REQUIRE(write_all(chan.second.get(), channel::encode(Frame{stream, type, std::move(payload)})));
  }
  // The next frame from the host that is not a credit top-up (a CREDIT
  // other than the acceptance's 0); nullopt on EOF or timeout.
  std::optional<Frame> next() {
    for (;;) {
      while (auto f = dec.next()) {
        if (f->type == FrameType::kCredit && f->payload != std::string(4, '\0')) continue;
        return f;
      }
      char buf[65536];
      ssize_t n = ::recv(chan.second.get(), buf, sizeof buf, 0);
      if (n <= 0) return std::nullopt;
      REQUIRE(dec.feed(std::string_view(buf, static_cast<size_t>(n))));
    }
  }
  void expect_reset(uint32_t stream, const std::string& reason) {
    auto f = next();
    REQUIRE(f);
    CHECK(f->stream == stream);
    CHECK(f->type == FrameType::kReset);
    CHECK(f->payload == reason);
  }
};

}  // namespace

TEST_CASE("host channel: a sandbox connection to the model proxy reaches the opener's socketpair and back") {
  FakeGateway gw;
  auto [host_end, agent_end] = socket_pair();
  process::HostChannel hc("sbtest01", host_end.get(), gw.opener());
  AgentSide agent(agent_end.get(), 768);

  UniqueFd client = agent.connect();
  std::string request = "GET /v1/models HTTP/1.1\r\nHost: llm\r\n\r\n";
  REQUIRE(write_all(client.get(), request));
  UniqueFd g = gw.next();
  REQUIRE_MESSAGE(g, "the opener was not called");
  std::string got;
  REQUIRE(read_exact(g.get(), got, request.size()));
  CHECK(got == request);
  std::string response = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok";
  REQUIRE(write_all(g.get(), response));
  REQUIRE(::shutdown(g.get(), SHUT_WR) == 0);
  std::string back;
  REQUIRE(read_to_eof(client.get(), back));
  CHECK(back == response);
  // And the client's half-close reaches the gateway as EOF.
  REQUIRE(::shutdown(client.get(), SHUT_WR) == 0);
  std::string rest;
  REQUIRE(read_to_eof(g.get(), rest));
  CHECK(rest.empty());

  CHECK(gw.seen() == std::vector<std::pair<std::string, std::string>>{{"sbtest01", "llm"}});
  CHECK(agent.fwd->stats().forwarded == 1);
  CHECK(agent.fwd->stats().refused == 0);
  auto hs = hc.stats();
  CHECK(hs.streams_opened == 1);
  CHECK(hs.streams_refused == 0);
  CHECK(hs.protocol_errors == 0);
  CHECK(hs.bytes_in == request.size());
  CHECK(hs.bytes_out == response.size());
  agent.stop();
  CHECK_MESSAGE(agent.result.ok(), (agent.result.ok() ? "" : agent.result.error().message()));
  hc.stop();
}

TEST_CASE("host channel: malformed service OPENs and services the opener refuses are RESET with the reason") {
  FakeGateway gw;
  RawAgent a;
  process::HostChannel hc("sbtest02", a.host_fd(), gw.opener());
  a.send(2, FrameType::kOpen, "not json");
  a.expect_reset(2, "OPEN payload is not a JSON object");
  a.send(4, FrameType::kOpen, R"({"port":80})");
  a.expect_reset(4, "OPEN payload must be exactly {\"service\":\"name\"}");
  a.send(6, FrameType::kOpen, R"({"service":"LLM"})");
  a.expect_reset(6, "OPEN \"service\" must be 1..32 characters of [a-z0-9-]");
  a.send(8, FrameType::kOpen, R"({"service":"llm","model":"x"})");
  a.expect_reset(8, "OPEN payload must be exactly {\"service\":\"name\"}");
  a.send(10, FrameType::kOpen, R"({"service":"nope"})");
  a.expect_reset(10, "no service nope on this host");
  // Malformed payloads never reach the opener.
  CHECK(gw.seen() == std::vector<std::pair<std::string, std::string>>{{"sbtest02", "nope"}});

  // The channel carries on: a good OPEN is accepted (CREDIT 0) and bridged.
  a.send(12, FrameType::kOpen, R"({"service":"llm"})");
  auto acc = a.next();
  REQUIRE(acc);
  CHECK(acc->stream == 12);
  CHECK(acc->type == FrameType::kCredit);
  UniqueFd g = gw.next();
  REQUIRE(g);
  a.send(12, FrameType::kData, "hi");
  std::string got;
  REQUIRE(read_exact(g.get(), got, 2));
  CHECK(got == "hi");
  REQUIRE(write_all(g.get(), "yo"));
  auto d = a.next();
  REQUIRE(d);
  CHECK(d->stream == 12);
  CHECK(d->type == FrameType::kData);
  CHECK(d->payload == "yo");
  auto hs = hc.stats();
  CHECK(hs.streams_refused == 5);
  CHECK(hs.streams_opened == 1);
  CHECK(hs.protocol_errors == 0);
  CHECK(hc.running());
  hc.stop();
}

TEST_CASE("host channel: without an opener every agent OPEN is refused as before") {
  RawAgent a;
  process::HostChannel hc("sbtest03", a.host_fd());
  a.send(2, FrameType::kOpen, R"({"service":"llm"})");
  a.expect_reset(2, "no gateway services on this host");
  a.send(4, FrameType::kOpen, "garbage");
  a.expect_reset(4, "no gateway services on this host");
  CHECK(hc.stats().streams_refused == 2);
  CHECK(hc.running());
  hc.stop();
}

TEST_CASE("host channel: a new host's RELEASE reset goes out first, then control requests") {
  RawAgent a;
  process::HostChannel h("snapshotclone", a.host_fd());
  h.release(/*reset=*/true);
  std::thread t([&] {
    auto r = h.control(R"({"type":"ping","id":1})", std::chrono::milliseconds(10000));
    CHECK_MESSAGE(r, (r ? "" : r.error().message()));
  });
  auto f = a.next();
  REQUIRE(f);
  CHECK(f->stream == 0);
  CHECK(f->type == FrameType::kRelease);
  CHECK(f->payload == "reset");
  auto c = a.next();
  REQUIRE(c);
  CHECK(c->type == FrameType::kData);
  CHECK(c->payload.find("ping") != std::string::npos);
  a.send(0, FrameType::kData, R"({"type":"pong","id":1})");
  t.join();
  h.stop();
}
