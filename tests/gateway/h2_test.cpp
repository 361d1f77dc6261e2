// HTTP/2 sessions of HttpServer, in process: an nghttp2 client over OpenSSL
// against the real listener, with a fake sandbox behind ProxyHooks (one end
// of a socketpair, served by a test thread). Checks what the e2e test cannot
// see: RST_STREAM closes the upstream stream, and a client that opens no
// window stops the gateway reading the upstream.
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <nghttp2/nghttp2.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <list>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gateway/http/server.h"

using namespace sg;
using namespace sg::http;

namespace {

const std::string kTls = SANDGATE_TESTS_TLS_DIR;

struct Reply {
  int status = 0;
  std::string body;
  bool closed = false;
  uint32_t error = 0;
};

// A blocking-ish h2 client: every step pumps the socket with a deadline.
class H2Client {
 public:
  explicit H2Client(uint16_t port, bool auto_window = true) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    ctx_ = SSL_CTX_new(TLS_client_method());
    static const unsigned char alpn[] = {2, 'h', '2', 8, 'h', 't', 't', 'p', '/', '1', '.', '1'};
    SSL_CTX_set_alpn_protos(ctx_, alpn, sizeof alpn);
    ssl_ = SSL_new(ctx_);
    SSL_set_fd(ssl_, fd_);
    REQUIRE(SSL_connect(ssl_) == 1);
    const unsigned char* p = nullptr;
    unsigned n = 0;
    SSL_get0_alpn_selected(ssl_, &p, &n);
    alpn_.assign(reinterpret_cast<const char*>(p), n);
    nghttp2_session_callbacks* cbs;
    nghttp2_session_callbacks_new(&cbs);
    nghttp2_session_callbacks_set_on_header_callback(
        cbs, [](nghttp2_session*, const nghttp2_frame* f, const uint8_t* name, size_t nl, const uint8_t* value,
                size_t vl, uint8_t, void* u) {
          if (std::string(reinterpret_cast<const char*>(name), nl) == ":status")
            static_cast<H2Client*>(u)->replies_[f->hd.stream_id].status =
                std::stoi(std::string(reinterpret_cast<const char*>(value), vl));
          return 0;
        });
    nghttp2_session_callbacks_set_on_data_chunk_recv_callback(
        cbs, [](nghttp2_session*, uint8_t, int32_t id, const uint8_t* d, size_t len, void* u) {
          static_cast<H2Client*>(u)->replies_[id].body.append(reinterpret_cast<const char*>(d), len);
          return 0;
        });
    nghttp2_session_callbacks_set_on_stream_close_callback(cbs, [](nghttp2_session*, int32_t id, uint32_t ec, void* u) {
      auto& r = static_cast<H2Client*>(u)->replies_[id];
      r.closed = true;
      r.error = ec;
      return 0;
    });
    nghttp2_option* opt;
    nghttp2_option_new(&opt);
    if (!auto_window) nghttp2_option_set_no_auto_window_update(opt, 1);
    nghttp2_session_client_new2(&s_, cbs, this, opt);
    nghttp2_option_del(opt);
    nghttp2_session_callbacks_del(cbs);
    nghttp2_submit_settings(s_, NGHTTP2_FLAG_NONE, nullptr, 0);
  }
  ~H2Client() {
    nghttp2_session_del(s_);
    SSL_free(ssl_);
    SSL_CTX_free(ctx_);
    ::close(fd_);
  }

  const std::string& alpn() const { return alpn_; }

  int32_t submit(const std::string& method, const std::string& path,
                 std::vector<std::pair<std::string, std::string>> hdrs, const std::string* body) {
    hdrs.insert(hdrs.begin(), {{":method", method}, {":path", path}, {":scheme", "https"}, {":authority", "t"}});
    std::vector<nghttp2_nv> nv;
    for (auto& [k, v] : hdrs)
      nv.push_back({reinterpret_cast<uint8_t*>(k.data()), reinterpret_cast<uint8_t*>(v.data()), k.size(), v.size(),
                    NGHTTP2_NV_FLAG_NONE});
    nghttp2_data_provider prd{};
    if (body) {
      uploads_.push_back({*body, 0});
      prd.source.ptr = &uploads_.back();
      prd.read_callback = [](nghttp2_session*, int32_t, uint8_t* buf, size_t len, uint32_t* flags,
                             nghttp2_data_source* src, void*) -> ssize_t {
        auto* u = static_cast<Upload*>(src->ptr);
        size_t n = std::min(len, u->data.size() - u->off);
        std::memcpy(buf, u->data.data() + u->off, n);
        u->off += n;
        if (u->off == u->data.size()) *flags |= NGHTTP2_DATA_FLAG_EOF;
        return static_cast<ssize_t>(n);
      };
    }
    return nghttp2_submit_request(s_, nullptr, nv.data(), nv.size(), body ? &prd : nullptr, nullptr);
  }
  void rst(int32_t id) { nghttp2_submit_rst_stream(s_, NGHTTP2_FLAG_NONE, id, NGHTTP2_CANCEL); }

  // Pumps until pred() or the deadline; false on timeout or connection end.
  bool pump(const std::function<bool()>& pred, std::chrono::milliseconds limit = std::chrono::seconds(10)) {
    auto end = std::chrono::steady_clock::now() + limit;
    while (!pred()) {
      const uint8_t* d;
      ssize_t n;
      while ((n = nghttp2_session_mem_send(s_, &d)) > 0)
        if (SSL_write(ssl_, d, static_cast<int>(n)) <= 0) return false;
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      if (SSL_pending(ssl_) == 0) {
        pollfd p{fd_, POLLIN, 0};
        if (::poll(&p, 1, static_cast<int>(std::min<long>(left.count(), 50))) <= 0) continue;
      }
      char buf[16384];
      int r = SSL_read(ssl_, buf, sizeof buf);
      if (r <= 0) return false;
      if (nghttp2_session_mem_recv(s_, reinterpret_cast<uint8_t*>(buf), static_cast<size_t>(r)) < 0) return false;
    }
    return true;
  }
  Reply& reply(int32_t id) { return replies_[id]; }
  bool done(int32_t id) { return replies_[id].closed; }

 private:
  int fd_ = -1;
  SSL_CTX* ctx_ = nullptr;
  SSL* ssl_ = nullptr;
  nghttp2_session* s_ = nullptr;
  std::string alpn_;
  std::map<int32_t, Reply> replies_;
  struct Upload {
    std::string data;
    size_t off;
  };
  std::list<Upload> uploads_;  // stable addresses for the data providers
};

// The fake sandbox: each connect() hands the peer end of a socketpair to
// `serve`, run on its own thread.
struct FakeSandbox {
  std::function<void(int fd)> serve;
  std::vector<std::thread> threads;
  std::mutex mu;
  ~FakeSandbox() {
    for (auto& t : threads) t.join();
  }
  Result<UniqueFd> connect() {
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return internal_error("socketpair");
    std::lock_guard<std::mutex> g(mu);
    threads.emplace_back([this, fd = sv[1]] {
      serve(fd);
      ::close(fd);
    });
    return UniqueFd(sv[0]);
  }
};

std::string read_head(int fd) {
  std::string got;
  char c;
  while (got.find("\r\n\r\n") == std::string::npos && ::read(fd, &c, 1) == 1) got += c;
  return got;
}

void write_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    ssize_t n = ::send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return;
    off += static_cast<size_t>(n);
  }
}

struct Fixture {
  FakeSandbox sandbox;
  std::unique_ptr<HttpServer> server;
  explicit Fixture(std::chrono::milliseconds read_timeout = std::chrono::seconds(30)) {
    ::signal(SIGPIPE, SIG_IGN);  // the client's SSL_write after the server closed
    ServerConfig cfg;
    cfg.tls_cert_file = kTls + "/server.pem";
    cfg.tls_key_file = kTls + "/server.key";
    cfg.body_limit = 4096;
    cfg.read_timeout = read_timeout;
    ProxyHooks hooks;
    hooks.route = [](const HttpRequest& h) -> Result<std::optional<ProxyTarget>> {
      if (h.header("x-sandbox").empty()) return std::optional<ProxyTarget>();
      return std::optional<ProxyTarget>(ProxyTarget{h.header("x-sandbox"), 1});
    };
    hooks.connect = [this](const ProxyTarget& t, const HttpRequest&) -> Result<UniqueFd> {
      if (t.sandbox_id == "gone") return not_found_error("no sandbox");
      return sandbox.connect();
    };
    server = std::make_unique<HttpServer>(
        cfg,
        [](HttpRequest& r) { return json_body(200, r.method + " " + r.path + " " + std::to_string(r.body.size())); },
        hooks);
    REQUIRE(server->start().ok());
  }
  ~Fixture() { server->stop(); }
};

}  // namespace

TEST_CASE("h2: ALPN, control plane, body limit, unknown sandbox") {
  Fixture f;
  H2Client c(f.server->port());
  CHECK(c.alpn() == "h2");
  std::string small(1000, 'x'), big(10000, 'x');
  int32_t a = c.submit("POST", "/a", {}, &small);
  int32_t b = c.submit("POST", "/b", {}, &big);
  int32_t g = c.submit("GET", "/x", {{"x-sandbox", "gone"}}, nullptr);
  REQUIRE(c.pump([&] { return c.done(a) && c.done(b) && c.done(g); }));
  CHECK(c.reply(a).status == 200);
  CHECK(c.reply(a).body == "POST /a 1000");
  CHECK(c.reply(b).status == 413);
  CHECK(c.reply(g).status == 502);
  CHECK(c.reply(g).body.find("\"sandboxId\"") != std::string::npos);
}

TEST_CASE("h2: relayed as HTTP/1.1 with Connection: close, chunked body") {
  Fixture f;
  std::string head, body;
  f.sandbox.serve = [&](int fd) {
    head = read_head(fd);
    // The body: 4 bytes with a length, else chunks up to the last one.
    bool sized = head.find("Content-Length: 4\r\n") != std::string::npos;
    char buf[4096];
    ssize_t n;
    while ((sized ? body.size() < 4 : body.find("0\r\n\r\n") == std::string::npos) &&
           (n = ::read(fd, buf, sizeof buf)) > 0)
      body.append(buf, static_cast<size_t>(n));
    write_all(fd, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Up: 1\r\n\r\n5\r\nhello\r\n0\r\n\r\n");
  };
  H2Client c(f.server->port());
  std::string up = "ping";
  int32_t id = c.submit("POST", "/p?q=1", {{"x-sandbox", "sb"}}, &up);
  REQUIRE(c.pump([&] { return c.done(id); }));
  CHECK(c.reply(id).status == 200);
  CHECK(c.reply(id).body == "hello");
  CHECK(head.rfind("POST /p?q=1 HTTP/1.1\r\n", 0) == 0);
  CHECK(head.find("Host: t\r\n") != std::string::npos);
  CHECK(head.find("Connection: close\r\n") != std::string::npos);
  bool framed = head.find("Transfer-Encoding: chunked\r\n") != std::string::npos ||
                head.find("Content-Length: 4\r\n") != std::string::npos;
  CHECK(framed);
  CHECK(body.find("ping") != std::string::npos);
}

TEST_CASE("h2: RST_STREAM closes the upstream; a shut window stops reading it") {
  Fixture f;
  std::atomic<bool> saw_eof{false};
  std::atomic<size_t> written{0};
  std::atomic<bool> stop{false};
  f.sandbox.serve = [&](int fd) {
    std::string h = read_head(fd);
    if (h.find("/rst") != std::string::npos) {
      write_all(fd, "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nabc");
      char c;
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 10000) > 0 && ::read(fd, &c, 1) == 0) saw_eof = true;
      return;
    }
    // A 64 MiB body written as fast as the gateway takes it.
    write_all(fd, "HTTP/1.1 200 OK\r\nContent-Length: 67108864\r\n\r\n");
    std::string chunk(64 * 1024, 'y');
    while (!stop && written < (64u << 20)) {
      pollfd p{fd, POLLOUT, 0};
      if (::poll(&p, 1, 100) <= 0) continue;
      ssize_t n = ::send(fd, chunk.data(), chunk.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n <= 0) break;
      written += static_cast<size_t>(n);
    }
  };
  {
    H2Client c(f.server->port());
    int32_t id = c.submit("GET", "/rst", {{"x-sandbox", "sb"}}, nullptr);
    REQUIRE(c.pump([&] { return c.reply(id).body.size() >= 3; }));
    c.rst(id);
    c.pump([&] { return saw_eof.load(); }, std::chrono::seconds(5));
    CHECK(saw_eof);
  }
  {
    H2Client c(f.server->port(), /*auto_window=*/false);
    int32_t id = c.submit("GET", "/flood", {{"x-sandbox", "sb"}}, nullptr);
    REQUIRE(c.pump([&] { return c.reply(id).status == 200; }));
    c.pump([] { return false; }, std::chrono::milliseconds(1500));
    // The client window (64 KiB), the stream buffer (256 KiB), one read
    // buffer and the socketpair's queue: far from 64 MiB.
    MESSAGE("upstream bytes taken while the window was shut: " << written.load());
    CHECK(written.load() < (2u << 20));
    CHECK(c.reply(id).body.size() <= 65535);
    stop = true;
  }
}

TEST_CASE("h2: an idle connection is closed after the read timeout, a busy one is not") {
  Fixture f(std::chrono::milliseconds(300));
  f.sandbox.serve = [](int fd) {
    read_head(fd);
    write_all(fd, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\na");
    std::this_thread::sleep_for(std::chrono::milliseconds(1200));  // a quiet stream, not an idle connection
    write_all(fd, "b");
  };
  H2Client c(f.server->port());
  int32_t id = c.submit("GET", "/slow", {{"x-sandbox", "sb"}}, nullptr);
  REQUIRE(c.pump([&] { return c.done(id); }, std::chrono::seconds(5)));
  CHECK(c.reply(id).body == "ab");
  auto t0 = std::chrono::steady_clock::now();
  CHECK_FALSE(c.pump([] { return false; }, std::chrono::seconds(5)));
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(3));
}
