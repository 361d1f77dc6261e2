// Mux data streams end to end: two Muxes on a socketpair, streams bridged
// to TCP servers on 127.0.0.1 (the agent side) and to socketpairs held by
// the test (the host side). No sleeps: every wait is a blocking read with a
// timeout or a join.
#include <doctest/doctest.h>

#include <fcntl.h>

#include <atomic>
#include <condition_variable>

#include "tests/sandbox-runtime/mux_harness.h"
#include "base/log.h"

using namespace sg;
using namespace sg::muxtest;

TEST_CASE("mux: echo round trip, then EOF after half-close") {
  Server srv(echo);
  MuxPair mp(connect_port);
  UniqueFd s = mp.open(port_payload(srv.port()));
  REQUIRE(write_all(s.get(), "hello over the channel"));
  std::string got;
  REQUIRE(read_exact(s.get(), got, 22));
  CHECK(got == "hello over the channel");
  REQUIRE(::shutdown(s.get(), SHUT_WR) == 0);
  std::string rest;
  REQUIRE(read_to_eof(s.get(), rest));
  CHECK(rest.empty());
  auto hs = mp.host->stats();
  CHECK(hs.bytes_out == 22);
  CHECK(hs.bytes_in == 22);
  CHECK(hs.streams_opened == 1);
  CHECK(hs.protocol_errors == 0);
}

TEST_CASE("mux: 50 concurrent streams of random sizes arrive intact") {
  Server srv(echo);
  MuxPair mp(connect_port);
  constexpr int kStreams = 50;
  std::vector<std::thread> clients;
  std::atomic<int> ok{0};
  for (int i = 0; i < kStreams; ++i) {
    UniqueFd s = mp.open(port_payload(srv.port()));
    size_t size = (static_cast<size_t>(i) * 7919u * 131u) % (3u << 20);  // 0 .. 3 MiB, spread
    clients.emplace_back([fd = s.release(), size, i, &ok] {
      UniqueFd s(fd);
      std::string data = random_bytes(size, static_cast<uint32_t>(i));
      std::thread writer([&] {
        bool w = write_all(s.get(), data);
        int e = errno;
        CHECK_MESSAGE(w, "write: " << e);
        ::shutdown(s.get(), SHUT_WR);
      });
      std::string back;
      bool eof = read_to_eof(s.get(), back);
      writer.join();
      if (eof && back.size() == data.size() && fnv1a(back) == fnv1a(data)) ++ok;
    });
  }
  for (auto& t : clients) t.join();
  CHECK(ok == kStreams);
  auto hs = mp.host->stats();
  CHECK(hs.streams_opened == kStreams);
  CHECK(hs.bytes_out == hs.bytes_in);
  CHECK(hs.protocol_errors == 0);
  CHECK(mp.agent->stats().protocol_errors == 0);
  // Never more than one window buffered per stream.
  CHECK(mp.host->stats().peak_stream_buffered <= kStreams * size_t{channel::kInitialWindow});
}

TEST_CASE("mux: half-close: the server answers after the client's EOF, both ways close, streams are gone") {
  // Reads everything, then answers with its length and closes.
  Server srv([](int fd) {
    std::string all;
    if (!read_to_eof(fd, all)) return;
    write_all(fd, "got " + std::to_string(all.size()));
  });
  std::mutex mu;
  std::condition_variable cv;
  size_t agent_open = 99, host_open = 99;
  bool answered = false;
  channel::Mux* agent_ptr = nullptr;
  channel::Mux* host_ptr = nullptr;
  MuxPair mp(
      connect_port,
      [&](std::string_view) {
        // Runs on the agent's Mux thread after every earlier frame was handled.
        agent_open = agent_ptr->stats().open_streams;
        CHECK(agent_ptr->send_control("pong"));
      },
      [&](std::string_view) {
        std::lock_guard<std::mutex> l(mu);
        host_open = host_ptr->stats().open_streams;
        answered = true;
        cv.notify_all();
      });
  agent_ptr = mp.agent.get();
  host_ptr = mp.host.get();
  UniqueFd s = mp.open(port_payload(srv.port()));
  std::string data = random_bytes(700000, 3);
  REQUIRE(write_all(s.get(), data));
  REQUIRE(::shutdown(s.get(), SHUT_WR) == 0);
  std::string answer;
  REQUIRE(read_to_eof(s.get(), answer));
  CHECK(answer == "got 700000");
  // A control round trip orders us after both sides handled the closes:
  // the stream is gone on both.
  REQUIRE(mp.host->send_control("ping"));
  std::unique_lock<std::mutex> l(mu);
  REQUIRE(cv.wait_for(l, std::chrono::seconds(10), [&] { return answered; }));
  CHECK(agent_open == 0);
  CHECK(host_open == 0);
  CHECK(mp.host->stats().protocol_errors == 0);
  CHECK(mp.agent->stats().protocol_errors == 0);
  CHECK(mp.host->stats().streams_reset_in == 0);
}

TEST_CASE("mux: a refused OPEN resets the stream and the local fd sees EOF") {
  MuxPair mp([](std::string_view) -> Result<UniqueFd> { return not_found_error("connection refused on port 1"); });
  UniqueFd s = mp.open(port_payload(1));
  // Bytes sent before the refusal arrives are allowed (initial window) and
  // dropped. The write may also lose the race with the refusal (EPIPE).
  (void)write_all(s.get(), "early bytes");
  std::string got;
  CHECK(read_to_eof(s.get(), got));
  CHECK(got.empty());
  mp.join();
  CHECK(mp.host->stats().streams_refused == 1);
  CHECK(mp.agent->stats().streams_refused == 1);
  CHECK(mp.host->stats().open_streams == 0);
  CHECK(mp.agent->stats().protocol_errors == 0);  // the early DATA is dropped silently
}

TEST_CASE("mux: a real connect to a closed port is refused") {
  uint16_t closed;
  {
    Server srv(echo);
    closed = srv.port();
  }
  MuxPair mp(connect_port);
  UniqueFd s = mp.open(port_payload(closed));
  std::string got;
  CHECK(read_to_eof(s.get(), got));
  CHECK(got.empty());
}

TEST_CASE("mux: a consumer that stops reading stops the producer; memory stays bounded") {
  // The agent side bridges to a socketpair whose far end the test holds and
  // does not read until the producer is blocked.
  std::mutex mu;
  UniqueFd consumer;
  Server srv(echo);
  MuxPair mp([&](std::string_view payload) -> Result<UniqueFd> {
    if (payload != "{}") return connect_port(payload);
    auto [a, b] = socket_pair();
    std::lock_guard<std::mutex> l(mu);
    consumer = std::move(a);
    return std::move(b);
  });
  UniqueFd producer = mp.open("{}");
  int fl = ::fcntl(producer.get(), F_GETFL);
  REQUIRE(::fcntl(producer.get(), F_SETFL, fl | O_NONBLOCK) == 0);
  std::string chunk(65536, 'y');
  size_t written = 0;
  // Write like `yes` until the write side stays full: EAGAIN, and no
  // POLLOUT for 300 ms (a bound for the check, not a synchronisation).
  for (;;) {
    ssize_t n = ::send(producer.get(), chunk.data(), chunk.size(), MSG_NOSIGNAL);
    if (n > 0) {
      written += static_cast<size_t>(n);
      REQUIRE(written < (64u << 20));  // it must block long before this
      continue;
    }
    REQUIRE(n < 0);
    REQUIRE((errno == EAGAIN || errno == EWOULDBLOCK));
    struct pollfd p = {producer.get(), POLLOUT, 0};
    if (::poll(&p, 1, 300) == 0) break;
  }
  MESSAGE("producer blocked after " << written << " bytes");
  auto as = mp.agent->stats();
  auto hs = mp.host->stats();
  CHECK(as.peak_stream_buffered <= channel::kInitialWindow);
  CHECK(hs.peak_channel_out_buffered <= channel::kInitialWindow + channel::kHeaderSize + channel::kMaxPayload);
  CHECK(as.stream_buffered > 0);  // the window is full, waiting on the consumer
  CHECK(as.bytes_in <= hs.bytes_out);

  // No head-of-line blocking: another stream still gets through.
  {
    UniqueFd e = mp.open(port_payload(srv.port()));
    REQUIRE(write_all(e.get(), "still moving"));
    std::string got;
    REQUIRE(read_exact(e.get(), got, 12));
    CHECK(got == "still moving");
  }

  // The consumer resumes: everything written arrives, in order.
  ::shutdown(producer.get(), SHUT_WR);
  std::string got;
  {
    std::lock_guard<std::mutex> l(mu);
    REQUIRE(consumer);
  }
  REQUIRE(read_exact(consumer.get(), got, written));
  CHECK(got == std::string(written, 'y'));
  std::string rest;
  CHECK(read_to_eof(consumer.get(), rest));
  CHECK(rest.empty());
  // A full window, plus at most the echo stream's 12 bytes beside it.
  CHECK(mp.agent->stats().peak_stream_buffered <= channel::kInitialWindow + 12);
}

TEST_CASE("mux: stop() from another thread ends run(), closing stream fds") {
  Server srv(echo);
  MuxPair mp(connect_port);
  UniqueFd s = mp.open(port_payload(srv.port()));
  REQUIRE(write_all(s.get(), "x"));
  std::string got;
  REQUIRE(read_exact(s.get(), got, 1));
  std::thread stopper([&] { mp.host->stop(); });
  stopper.join();
  mp.th.join();
  CHECK(mp.host_result.ok());
  // The stream's host fd was closed by the Mux: EOF here.
  std::string rest;
  CHECK(read_to_eof(s.get(), rest));
  // The Mux no longer takes streams.
  auto [a, b] = socket_pair();
  auto id = mp.host->open_stream(std::move(b), port_payload(srv.port()));
  CHECK_FALSE(id);
  // The agent sees channel EOF once the host's end closes.
  mp.chan.first.reset();
  mp.ta.join();
  CHECK(mp.agent_result.ok());
  mp.joined = true;
}

TEST_CASE("mux: control messages go both ways, in order") {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::string> at_agent, at_host;
  channel::Mux* agent_ptr = nullptr;
  MuxPair mp(
      connect_port,
      [&](std::string_view p) {
        std::lock_guard<std::mutex> l(mu);
        at_agent.emplace_back(p);
        CHECK(agent_ptr->send_control("re:" + std::string(p)));
      },
      [&](std::string_view p) {
        std::lock_guard<std::mutex> l(mu);
        at_host.emplace_back(p);
        cv.notify_all();
      });
  agent_ptr = mp.agent.get();
  for (int i = 0; i < 100; ++i) REQUIRE(mp.host->send_control("m" + std::to_string(i)));
  std::unique_lock<std::mutex> l(mu);
  REQUIRE(cv.wait_for(l, std::chrono::seconds(10), [&] { return at_host.size() == 100; }));
  for (int i = 0; i < 100; ++i) {
    CHECK(at_agent[i] == "m" + std::to_string(i));
    CHECK(at_host[i] == "re:m" + std::to_string(i));
  }
}
