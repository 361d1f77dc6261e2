// llm_proxy_bench: what the model API proxy adds, and how fast a wait-paused
// sandbox gets its answer (issue 5's benchmark).
//
// In one process: an upstream model server (OpenAI chat completions shape,
// JSON or SSE, answering after a fixed latency and stamping each response
// with the monotonic time it was sent), a client, and the real sandgate
// binary (process backend) started with that upstream. Every request is made
// twice over the same kind of keep-alive connection: straight to the
// upstream, and through sandgate with a virtual key; the difference is the
// proxy's added latency.
//   1. non-streaming: send to whole body received, at 1 and 200 concurrent
//      clients;
//   2. streaming: send to the first event received (time to first byte);
//   3. resume to delivery: requests bound to idle sandboxes (X-Sandgate-
//      Sandbox) whose model takes long enough for the coordinator to pause
//      them; the delay from the upstream sending the response to the client
//      receiving it includes resuming the sandbox first. Compared with the
//      same requests unbound.
// Writes a JSON report to argv[1]. Needs root (sandboxes) and the test
// template (SANDGATE_TEST_ROOTFS, as the integration tests).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/sandgate_process.h"
#include "tests/bench/bench_util.h"
#include "base/sys.h"

using namespace sg;
using json = nlohmann::json;
using bench::cpu_model;
using bench::percentile;

namespace {

uint64_t now_ns() { return sys::monotonic_ns(); }

bool write_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    ssize_t n = ::send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return false;
    off += static_cast<size_t>(n);
  }
  return true;
}

// Buffered reads with a deadline.
struct Conn {
  int fd = -1;
  std::string buf;
  ~Conn() {
    if (fd >= 0) ::close(fd);
  }
  bool fill(int timeout_ms = 30000) {
    struct pollfd p = {fd, POLLIN, 0};
    if (::poll(&p, 1, timeout_ms) <= 0) return false;
    char tmp[65536];
    ssize_t n = ::recv(fd, tmp, sizeof tmp, 0);
    if (n <= 0) return false;
    buf.append(tmp, static_cast<size_t>(n));
    return true;
  }
  bool line(std::string& out) {
    for (;;) {
      size_t e = buf.find("\r\n");
      if (e != std::string::npos) {
        out = buf.substr(0, e);
        buf.erase(0, e + 2);
        return true;
      }
      if (buf.size() > 1 << 20 || !fill()) return false;
    }
  }
  bool take(size_t n, std::string* out) {
    while (buf.size() < n)
      if (!fill()) return false;
    if (out) out->append(buf, 0, n);
    buf.erase(0, n);
    return true;
  }
};

int connect_to(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

// ---- the upstream -------------------------------------------------------

// Answers POST /v1/chat/completions after x-bench-latency-us; SSE with
// x-bench-chunks events when the body says "stream":true. Each response
// carries x-bench-sent-ns: the monotonic time its head went out.
class Upstream {
 public:
  Upstream() {
    lfd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    ::setsockopt(lfd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(lfd_, reinterpret_cast<sockaddr*>(&a), sizeof a);
    ::listen(lfd_, 1024);
    socklen_t l = sizeof a;
    ::getsockname(lfd_, reinterpret_cast<sockaddr*>(&a), &l);
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] {
      for (;;) {
        int fd = ::accept4(lfd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd < 0) return;
        int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        std::thread([fd] { serve(fd); }).detach();
      }
    });
  }
  ~Upstream() {
    ::shutdown(lfd_, SHUT_RDWR);
    ::close(lfd_);
    thread_.join();
  }
  int port() const { return port_; }

 private:
  static void serve(int fd) {
    Conn c;
    c.fd = fd;
    for (;;) {
      std::string l;
      if (!c.line(l)) return;
      size_t len = 0;
      long lat_us = 0, chunks = 5;
      for (;;) {
        std::string h;
        if (!c.line(h)) return;
        if (h.empty()) break;
        std::string lower = h;
        for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
        if (lower.rfind("content-length:", 0) == 0) len = std::stoul(h.substr(15));
        if (lower.rfind("x-bench-latency-us:", 0) == 0) lat_us = std::stol(h.substr(19));
        if (lower.rfind("x-bench-chunks:", 0) == 0) chunks = std::stol(h.substr(15));
      }
      std::string body;
      if (!c.take(len, &body)) return;
      bool stream = body.find("\"stream\":true") != std::string::npos;
      if (lat_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(lat_us));
      std::string sent = std::to_string(now_ns());
      if (!stream) {
        std::string b =
            R"({"id":"chatcmpl-bench","object":"chat.completion","created":1700000000,"model":"bench","choices":[{"index":0,"message":{"role":"assistant","content":"bench reply"},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":2,"total_tokens":14}})";
        std::string r = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-bench-sent-ns: " + sent +
                        "\r\ncontent-length: " + std::to_string(b.size()) + "\r\n\r\n" + b;
        if (!write_all(fd, r)) return;
        continue;
      }
      std::string head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-bench-sent-ns: " + sent +
                         "\r\ntransfer-encoding: chunked\r\n\r\n";
      auto chunk = [](const std::string& d) {
        char n[32];
        std::snprintf(n, sizeof n, "%zx\r\n", d.size());
        return std::string(n) + d + "\r\n";
      };
      std::string first = chunk(
          R"(data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"w"}}]})"
          "\n\n");
      if (!write_all(fd, head + first)) return;
      std::string rest;
      for (long i = 1; i < chunks; ++i)
        rest += chunk(R"(data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" w"}}]})"
                      "\n\n");
      rest += chunk(R"(data: {"id":"c","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":5}})"
                    "\n\n");
      rest += chunk("data: [DONE]\n\n") + "0\r\n\r\n";
      if (!write_all(fd, rest)) return;
    }
  }

  int lfd_ = -1;
  int port_ = 0;
  std::thread thread_;
};

// ---- the client ---------------------------------------------------------

struct Sample {
  double total_ms = 0;   // send to body complete
  double first_ms = 0;   // send to first body byte
  double delivery_ms = 0;  // upstream sent head to first body byte here
  bool ok = false;
};

// One request on a keep-alive connection (reconnects if needed).
Sample request(Conn& c, int port, const std::map<std::string, std::string>& headers, bool stream) {
  Sample s;
  if (c.fd < 0) {
    c.fd = connect_to(port);
    c.buf.clear();
    if (c.fd < 0) return s;
  }
  std::string body = stream ? R"({"model":"bench","stream":true,"messages":[{"role":"user","content":"hello bench"}]})"
                            : R"({"model":"bench","messages":[{"role":"user","content":"hello bench"}]})";
  std::string req = "POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n";
  for (const auto& [k, v] : headers) req += k + ": " + v + "\r\n";
  req += "content-length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  uint64_t t0 = now_ns();
  if (!write_all(c.fd, req)) {
    ::close(c.fd);
    c.fd = -1;
    return s;
  }
  std::string l;
  if (!c.line(l) || l.rfind("HTTP/1.1 200", 0) != 0) {
    std::fprintf(stderr, "bad response: %s\n", l.c_str());
    ::close(c.fd);
    c.fd = -1;
    return s;
  }
  size_t len = 0;
  bool chunked = false;
  uint64_t sent = 0;
  for (;;) {
    if (!c.line(l)) return s;
    if (l.empty()) break;
    std::string lower = l;
    for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    if (lower.rfind("content-length:", 0) == 0) len = std::stoul(l.substr(15));
    if (lower.rfind("transfer-encoding:", 0) == 0 && lower.find("chunked") != std::string::npos) chunked = true;
    if (lower.rfind("x-bench-sent-ns:", 0) == 0) sent = std::stoull(l.substr(16));
  }
  auto first = [&] {
    uint64_t t = now_ns();
    s.first_ms = static_cast<double>(t - t0) / 1e6;
    if (sent) s.delivery_ms = static_cast<double>(t - sent) / 1e6;
  };
  if (!chunked) {
    // The first byte arrives with (or right after) the head.
    if (c.buf.empty() && !c.fill()) return s;
    first();
    if (!c.take(len, nullptr)) return s;
  } else {
    bool got_first = false;
    for (;;) {
      if (!c.line(l)) return s;
      size_t n = std::stoul(l, nullptr, 16);
      if (!got_first) {
        first();
        got_first = true;
      }
      if (!c.take(n, nullptr) || !c.line(l)) return s;
      if (n == 0) break;
    }
  }
  s.total_ms = static_cast<double>(now_ns() - t0) / 1e6;
  s.ok = true;
  return s;
}

struct Run {
  std::vector<Sample> samples;
  int failures = 0;
};

// `clients` threads, each `per_client` requests back to back on its own
// keep-alive connection; `headers_for(i)` gives each client's extra
// headers. Client i starts i * stagger_us / clients later, so concurrent
// requests are spread over the model latency as independent agents' are
// (all starting at once would make every response of a round arrive in
// the same instant: a burst, not steady concurrency).
Run run(int port, int clients, int per_client, bool stream,
        const std::function<std::map<std::string, std::string>(int)>& headers_for, int stagger_us = 0) {
  Run r;
  std::mutex mu;
  std::vector<std::thread> ts;
  for (int i = 0; i < clients; ++i)
    ts.emplace_back([&, i] {
      if (stagger_us > 0)
        std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int64_t>(stagger_us) * i / clients));
      Conn c;
      std::map<std::string, std::string> h = headers_for(i);
      std::vector<Sample> mine;
      int fails = 0;
      for (int k = 0; k < per_client; ++k) {
        Sample s = request(c, port, h, stream);
        if (s.ok)
          mine.push_back(s);
        else
          ++fails;
      }
      std::lock_guard<std::mutex> g(mu);
      r.samples.insert(r.samples.end(), mine.begin(), mine.end());
      r.failures += fails;
    });
  for (auto& t : ts) t.join();
  return r;
}

json summary(const Run& r, bool first) {
  std::vector<double> v;
  for (const Sample& s : r.samples) v.push_back(first ? s.first_ms : s.total_ms);
  return {{"n", v.size()}, {"failures", r.failures}, {"p50_ms", percentile(v, 50)}, {"p90_ms", percentile(v, 90)},
          {"p99_ms", percentile(v, 99)}, {"max_ms", percentile(v, 100)}};
}

json delivery_summary(const Run& r) {
  std::vector<double> v;
  for (const Sample& s : r.samples) v.push_back(s.delivery_ms);
  return {{"n", v.size()}, {"failures", r.failures}, {"p50_ms", percentile(v, 50)}, {"p90_ms", percentile(v, 90)},
          {"p99_ms", percentile(v, 99)}, {"max_ms", percentile(v, 100)}};
}

double metric(const test::SandgateProcess& s, const std::string& name) {
  test::Response m = s.client().request("GET", "/metrics");
  size_t at = m.body.find("\n" + name + " ");
  if (at == std::string::npos) return -1;
  return std::atof(m.body.c_str() + at + name.size() + 2);
}

}  // namespace

int main(int argc, char** argv) {
  std::string out_path = argc > 1 ? argv[1] : "llm-proxy.json";
  int scale = argc > 2 ? std::max(1, std::atoi(argv[2])) : 1;
  Upstream up;
  test::TempDir dir;
  std::string keyfile = dir.path() + "/upstream.key";
  if (!sys::write_file_atomic(keyfile, "sk-bench-upstream-key\n")) return 1;
  // Limits off: the benchmark measures the proxy, not the limiters.
  test::SandgateProcess s(dir.sub("data"),
                          {"--log-level", "warn", "--rate", "0", "--create-rate", "0", "--llm-rate", "0",
                           "--llm-tokens-per-min", "0", "--openai-base-url",
                           "http://127.0.0.1:" + std::to_string(up.port()), "--openai-key-file", keyfile});
  if (!s.started()) {
    std::fprintf(stderr, "sandgate did not start\n%s\n", s.log().c_str());
    return 1;
  }
  test::CliResult k = test::run_sandgate({"llm", "key", "create", "local", "--data-dir", s.data_dir()});
  if (k.exit_code != 0) {
    std::fprintf(stderr, "llm key create: %s\n", k.err.c_str());
    return 1;
  }
  std::string vkey = k.out.substr(0, k.out.find('\n'));
  auto direct_h = [](int) { return std::map<std::string, std::string>{{"authorization", "Bearer sk-bench-upstream-key"}}; };
  auto proxy_h = [&](int) { return std::map<std::string, std::string>{{"authorization", "Bearer " + vkey}}; };
  // The model's latency: 20 ms for one client; 500 ms for 200 concurrent
  // ones (400 requests/s through the proxy, as 200 agents whose model calls
  // take half a second; shorter calls would make it a throughput test of
  // the 2-core host, where the client and the upstream compete too).
  auto with_latency = [&](auto h, int latency_us) {
    return [h, latency_us](int i) {
      auto m = h(i);
      m["x-bench-latency-us"] = std::to_string(latency_us);
      return m;
    };
  };

  json report;
  report["machine"] = {{"cpu", cpu_model()}, {"cores", std::thread::hardware_concurrency()},
                       {"note", "one host: client, upstream and sandgate share its cores"}};
  // Warm-up: connections, pools, caches.
  (void)run(up.port(), 4, 20, false, direct_h);
  (void)run(s.port(), 4, 20, false, proxy_h);

  for (int clients : {1, 200}) {
    int per = (clients == 1 ? 400 : 10) * scale;
    int latency_us = clients == 1 ? 20000 : 500000;
    for (bool stream : {false, true}) {
      std::fprintf(stderr, "%d client(s), %s: direct...\n", clients, stream ? "streaming" : "non-streaming");
      int stagger = clients > 1 ? latency_us : 0;
      Run d = run(up.port(), clients, per, stream, with_latency(direct_h, latency_us), stagger);
      std::fprintf(stderr, "%d client(s), %s: proxied...\n", clients, stream ? "streaming" : "non-streaming");
      Run p = run(s.port(), clients, per, stream, with_latency(proxy_h, latency_us), stagger);
      json dj = summary(d, stream), pj = summary(p, stream);
      json row = {{"upstream_latency_ms", latency_us / 1000.0},
                  {"clients_staggered_over_ms", stagger / 1000.0},
                  {"direct", dj},
                  {"proxied", pj},
                  {"added_p50_ms", pj["p50_ms"].get<double>() - dj["p50_ms"].get<double>()},
                  {"added_p99_ms", pj["p99_ms"].get<double>() - dj["p99_ms"].get<double>()}};
      report[std::string(stream ? "stream_ttfb" : "nonstream") + "_c" + std::to_string(clients)] = row;
    }
  }

  // Resume to delivery: requests bound to idle sandboxes, long enough for
  // the coordinator (grace 30 ms) to pause them.
  const int sandboxes = 8, per_sb = 25 * scale;
  std::vector<std::string> ids;
  for (int i = 0; i < sandboxes; ++i) {
    test::Response r = s.post("/v2/sandboxes", R"({"templateID":"base"})", s.key());
    if (r.status != 201) {
      std::fprintf(stderr, "create sandbox: %d %s\n", r.status, r.body.c_str());
      return 1;
    }
    ids.push_back(json::parse(r.body)["sandboxID"]);
  }
  const int wait_us = 300000;
  for (bool stream : {false, true}) {
    auto bound = [&](int i) {
      auto m = proxy_h(i);
      m["x-sandgate-sandbox"] = ids[static_cast<size_t>(i)];
      m["x-bench-latency-us"] = std::to_string(wait_us);
      return m;
    };
    auto unbound = [&](int i) {
      auto m = proxy_h(i);
      m["x-bench-latency-us"] = std::to_string(wait_us);
      return m;
    };
    std::fprintf(stderr, "resume to delivery (%s): unbound...\n", stream ? "streaming" : "non-streaming");
    Run u = run(s.port(), sandboxes, per_sb, stream, unbound);
    double pauses0 = metric(s, "sandgate_wait_pauses_total");
    std::fprintf(stderr, "resume to delivery (%s): bound to paused sandboxes...\n", stream ? "streaming" : "non-streaming");
    Run b = run(s.port(), sandboxes, per_sb, stream, bound);
    double pauses = metric(s, "sandgate_wait_pauses_total") - pauses0;
    json bj = delivery_summary(b), uj = delivery_summary(u);
    report[std::string("resume_to_delivery_") + (stream ? "stream" : "nonstream")] = {
        {"model_wait_ms", wait_us / 1000.0},
        {"requests", b.samples.size()},
        {"pauses", pauses},
        {"bound_paused", bj},
        {"unbound", uj},
        {"added_p50_ms", bj["p50_ms"].get<double>() - uj["p50_ms"].get<double>()},
        {"added_p99_ms", bj["p99_ms"].get<double>() - uj["p99_ms"].get<double>()}};
  }
  for (const std::string& id : ids) s.del("/sandboxes/" + id, s.key());
  report["metrics_resume_latency_count"] = metric(s, "sandgate_wait_resume_latency_seconds_count");
  report["metrics_resume_latency_sum_s"] = metric(s, "sandgate_wait_resume_latency_seconds_sum");

  std::ofstream(out_path) << report.dump(2) << "\n";
  std::printf("%s\n", report.dump(2).c_str());
  return 0;
}
