// Streaming handlers of HttpServer (stream_handler.h) and adopted channel
// connections, in process: a real listener on port 0 whose StreamHooks
// serve() coroutine writes chunked pieces, a Content-Length body or a
// whole HttpResponse, refuses bodies over the limit, and waits on a timer
// that watch_closed's on_gone cancels. The client side is plain blocking
// sockets with poll() deadlines and its own HTTP/1.1 parsing, so the wire
// bytes are checked independently of Beast.
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "gateway/http/server.h"

using namespace sg;
using namespace sg::http;
using namespace std::chrono_literals;
namespace asio = boost::asio;

namespace {

constexpr size_t kBodyLimit = 64;

// A blocking HTTP/1.1 client on one connected socket (TCP or a socketpair
// end); every read waits at most until the deadline.
class RawClient {
 public:
  explicit RawClient(int fd) : fd_(fd) {}
  static RawClient tcp(uint16_t port) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    return RawClient(fd);
  }
  RawClient(RawClient&& o) noexcept : fd_(std::exchange(o.fd_, -1)), buf_(std::move(o.buf_)) {}
  ~RawClient() { close(); }
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  // Closes with an RST (SO_LINGER 0) instead of a FIN.
  void reset() {
    linger l{1, 0};
    REQUIRE(::setsockopt(fd_, SOL_SOCKET, SO_LINGER, &l, sizeof l) == 0);
    close();
  }
  void shutdown_write() { REQUIRE(::shutdown(fd_, SHUT_WR) == 0); }

  bool send(const std::string& s) {
    size_t off = 0;
    while (off < s.size()) {
      ssize_t n = ::send(fd_, s.data() + off, s.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return false;
      off += static_cast<size_t>(n);
    }
    return true;
  }

  struct Head {
    std::string status_line;
    int status = 0;
    std::map<std::string, std::string> headers;  // lowercase names
    std::string header(const std::string& n) const {
      auto it = headers.find(n);
      return it == headers.end() ? "" : it->second;
    }
  };

  // The status line and headers; nullopt on EOF or timeout first.
  std::optional<Head> read_head() {
    std::optional<std::string> raw = read_through("\r\n\r\n");
    if (!raw) return std::nullopt;
    Head h;
    size_t eol = raw->find("\r\n");
    h.status_line = raw->substr(0, eol);
    if (h.status_line.rfind("HTTP/1.", 0) != 0 || h.status_line.size() < 12) return std::nullopt;
    h.status = std::stoi(h.status_line.substr(9, 3));
    size_t pos = eol + 2;
    while (pos < raw->size() - 2) {
      size_t e = raw->find("\r\n", pos);
      std::string line = raw->substr(pos, e - pos);
      pos = e + 2;
      size_t colon = line.find(':');
      if (colon == std::string::npos) return std::nullopt;
      std::string name = line.substr(0, colon);
      for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      size_t v = line.find_first_not_of(' ', colon + 1);
      CHECK_MESSAGE(h.headers.count(name) == 0, "repeated header ", name);
      h.headers[name] = v == std::string::npos ? "" : line.substr(v);
    }
    return h;
  }

  std::optional<std::string> read_exact(size_t n) {
    while (buf_.size() < n)
      if (!fill()) return std::nullopt;
    std::string out = buf_.substr(0, n);
    buf_.erase(0, n);
    return out;
  }

  // A chunked body: the chunks as framed on the wire (the last, empty one
  // not included); nullopt when the framing is broken or the peer stops.
  std::optional<std::vector<std::string>> read_chunks() {
    std::vector<std::string> chunks;
    for (;;) {
      std::optional<std::string> size_line = read_through("\r\n");
      if (!size_line) return std::nullopt;
      size_t n = 0;
      try {
        n = std::stoul(*size_line, nullptr, 16);
      } catch (...) {
        return std::nullopt;
      }
      if (n == 0) {
        // No trailers: the body ends with an empty line.
        std::optional<std::string> end = read_through("\r\n");
        if (!end || *end != "\r\n") return std::nullopt;
        return chunks;
      }
      std::optional<std::string> data = read_exact(n + 2);
      if (!data || data->substr(n) != "\r\n") return std::nullopt;
      chunks.push_back(data->substr(0, n));
    }
  }

  // Reads until the peer closes; true if it did before the deadline
  // (bytes read meanwhile are kept).
  bool wait_eof(std::chrono::milliseconds limit = 5000ms) {
    auto end = std::chrono::steady_clock::now() + limit;
    for (;;) {
      int r = poll_in(end);
      if (r <= 0) return false;
      char b[4096];
      ssize_t n = ::recv(fd_, b, sizeof b, 0);
      if (n == 0 || (n < 0 && errno == ECONNRESET)) return true;
      if (n < 0) return false;
      buf_.append(b, static_cast<size_t>(n));
    }
  }
  const std::string& buffered() const { return buf_; }

 private:
  int poll_in(std::chrono::steady_clock::time_point end) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - std::chrono::steady_clock::now());
    if (left.count() <= 0) return 0;
    pollfd p{fd_, POLLIN, 0};
    return ::poll(&p, 1, static_cast<int>(left.count()));
  }
  bool fill(std::chrono::milliseconds limit = 5000ms) {
    if (poll_in(std::chrono::steady_clock::now() + limit) <= 0) return false;
    char b[4096];
    ssize_t n = ::recv(fd_, b, sizeof b, 0);
    if (n <= 0) return false;
    buf_.append(b, static_cast<size_t>(n));
    return true;
  }
  // Everything up to and including `delim`.
  std::optional<std::string> read_through(const std::string& delim) {
    size_t p;
    while ((p = buf_.find(delim)) == std::string::npos)
      if (!fill()) return std::nullopt;
    std::string out = buf_.substr(0, p + delim.size());
    buf_.erase(0, p + delim.size());
    return out;
  }

  int fd_;
  std::string buf_;
};

// What the server side saw; guarded by mu, cv notified on changes.
struct Seen {
  std::mutex mu;
  std::condition_variable cv;
  int served = 0, errors = 0, handled = 0, routed = 0;
  int last_error_status = 0;
  std::string last_body, last_bound, last_path;
  bool bound_set_on_tcp = false;
  bool waiting = false;    // serve() is in its timer wait, the watch installed
  bool gone = false;       // on_gone fired
  bool wait_cancelled = false;
  int wait_done = 0;
  int write_failures = 0;  // a ResponseWriter call returned false

  template <class Pred>
  bool until(Pred p, std::chrono::milliseconds limit = 5000ms) {
    std::unique_lock<std::mutex> l(mu);
    return cv.wait_for(l, limit, p);
  }
  template <class F>
  void update(F f) {
    {
      std::lock_guard<std::mutex> l(mu);
      f();
    }
    cv.notify_all();
  }
};

asio::awaitable<void> serve(std::shared_ptr<Seen> seen, HttpRequest req, ResponseWriter& out) {
  seen->update([&] {
    ++seen->served;
    seen->last_body = req.body;
    seen->last_bound = req.bound_sandbox;
    seen->last_path = req.path;
  });
  // (No string literals or doctest macros inside co_await expressions:
  // GCC 12 miscompiles array temporaries in coroutine frames.)
  std::vector<std::pair<std::string, std::string>> headers{{std::string("x-test"), req.path.substr(8)}};
  bool ok = true;
  if (req.path == "/stream/chunked") {
    ok = co_await out.write_head(200, headers, std::nullopt);
    ok = ok && co_await out.write_body("hello ");
    ok = ok && co_await out.write_body("");  // nothing: must not end the body
    ok = ok && co_await out.write_body("world");
    ok = ok && co_await out.finish();
  } else if (req.path == "/stream/length") {
    ok = co_await out.write_head(201, headers, uint64_t{11});
    ok = ok && co_await out.write_body("hello");
    ok = ok && co_await out.write_body(" world");
    ok = ok && co_await out.finish();
  } else if (req.path == "/stream/respond") {
    HttpResponse r;
    r.status = 202;
    r.body = "whole";
    r.content_type = "text/plain";
    r.headers = headers;
    ok = co_await out.respond(std::move(r));
  } else if (req.path == "/stream/echo") {
    HttpResponse r;
    r.body = req.body + "|" + req.bound_sandbox;
    r.content_type = "text/plain";
    ok = co_await out.respond(std::move(r));
  } else if (req.path == "/stream/slow") {
    // Answers 300 ms late (a request in progress when a drain starts).
    seen->update([&] { seen->waiting = true; });
    asio::steady_timer timer(co_await asio::this_coro::executor, 300ms);
    boost::system::error_code ec;
    co_await timer.async_wait(asio::redirect_error(asio::use_awaitable, ec));
    ok = co_await out.write_head(200, headers, std::nullopt);
    ok = ok && co_await out.write_body("late");
    ok = ok && co_await out.finish();
  } else if (req.path == "/stream/wait") {
    // Waits for a response that never comes, until the client goes away.
    asio::steady_timer timer(co_await asio::this_coro::executor, 60s);
    out.watch_closed([seen, &timer] {
      seen->update([&] { seen->gone = true; });
      timer.cancel();
    });
    seen->update([&] { seen->waiting = true; });
    boost::system::error_code ec;
    co_await timer.async_wait(asio::redirect_error(asio::use_awaitable, ec));
    seen->update([&] {
      seen->wait_cancelled = ec == asio::error::operation_aborted;
      ++seen->wait_done;
    });
  }
  if (!ok) seen->update([&] { ++seen->write_failures; });
}

struct Fixture {
  std::shared_ptr<Seen> seen = std::make_shared<Seen>();
  std::unique_ptr<HttpServer> server;
  explicit Fixture(size_t body_budget = 256 << 20, size_t share_budget = 256 << 20) {
    ::signal(SIGPIPE, SIG_IGN);
    ServerConfig cfg;
    cfg.io_threads = 2;
    cfg.worker_threads = 2;
    cfg.read_timeout = 10s;
    StreamHooks st;
    st.owns = [](const HttpRequest& h) { return h.path.rfind("/stream/", 0) == 0; };
    st.body_limit = kBodyLimit;
    st.body_budget = body_budget;
    st.share_budget = share_budget;
    // x-stranger: refused before the body; x-who: the share it is charged to.
    st.authorize = [](const HttpRequest& head) {
      Authorized a;
      if (!head.header("x-stranger").empty()) a.refusal = json_error(401, "unknown caller");
      a.share = head.header("x-who");
      return a;
    };
    st.precheck = [](const HttpRequest& head) -> std::optional<HttpResponse> {
      if (head.header("x-deny").empty()) return std::nullopt;
      return json_error(401, "denied before the body");
    };
    st.error = [s = seen](const HttpRequest& head, int status, const std::string& msg) {
      s->update([&] {
        ++s->errors;
        s->last_error_status = status;
        s->last_path = head.path;
      });
      HttpResponse r;
      r.status = status;
      r.content_type = "text/plain";
      r.body = "refused " + std::to_string(status) + " " + head.path + ": " + msg;
      return r;
    };
    st.serve = [s = seen](HttpRequest req, ResponseWriter& out) { return serve(s, std::move(req), out); };
    ProxyHooks proxy;
    proxy.route = [s = seen](const HttpRequest& h) -> Result<std::optional<ProxyTarget>> {
      s->update([&] { ++s->routed; });
      if (h.path.rfind("/sandbox/", 0) == 0) return std::optional<ProxyTarget>(ProxyTarget{"sbx-1", 8080});
      return std::optional<ProxyTarget>();
    };
    proxy.connect = [](const ProxyTarget&, const HttpRequest&) -> Result<UniqueFd> { return not_found_error("no sandbox here"); };
    Handler handler = [s = seen](HttpRequest& r) {
      s->update([&] {
        ++s->handled;
        if (!r.bound_sandbox.empty()) s->bound_set_on_tcp = true;
      });
      return json_body(200, "{\"handled\":\"" + r.path + "\"}");
    };
    server = std::make_unique<HttpServer>(cfg, handler, proxy, st);
    REQUIRE(server->start().ok());
  }
  ~Fixture() {
    server->stop();
    std::lock_guard<std::mutex> l(seen->mu);
    CHECK(seen->write_failures == 0);
  }
  RawClient client() { return RawClient::tcp(server->port()); }
};

std::string get(const std::string& path) { return "GET " + path + " HTTP/1.1\r\nHost: t\r\n\r\n"; }
std::string post(const std::string& path, const std::string& body) {
  return "POST " + path + " HTTP/1.1\r\nHost: t\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

}  // namespace

TEST_CASE("stream: chunked pieces, then the same connection carries the next request") {
  Fixture f;
  RawClient c = f.client();
  REQUIRE(c.send(post("/stream/chunked", "abc")));
  auto h = c.read_head();
  REQUIRE(h);
  CHECK(h->status_line == "HTTP/1.1 200 OK");
  CHECK(h->header("transfer-encoding") == "chunked");
  CHECK(h->header("content-length") == "");
  CHECK(h->header("x-test") == "chunked");
  CHECK(h->header("connection") != "close");
  auto chunks = c.read_chunks();
  REQUIRE(chunks);
  CHECK(*chunks == std::vector<std::string>{"hello ", "world"});
  CHECK(c.buffered().empty());  // nothing after the last chunk
  {
    std::lock_guard<std::mutex> l(f.seen->mu);
    CHECK(f.seen->served == 1);
    CHECK(f.seen->last_body == "abc");
    CHECK(f.seen->last_bound == "");
  }

  REQUIRE(c.send(get("/stream/length")));
  auto h2 = c.read_head();
  REQUIRE(h2);
  CHECK(h2->status == 201);
  CHECK(h2->header("content-length") == "11");
  CHECK(h2->header("transfer-encoding") == "");
  CHECK(c.read_exact(11) == "hello world");

  // And a third one, after a Content-Length response.
  REQUIRE(c.send(get("/stream/respond")));
  auto h3 = c.read_head();
  REQUIRE(h3);
  CHECK(h3->status == 202);
  CHECK(h3->header("content-type") == "text/plain");
  CHECK(h3->header("x-test") == "respond");
  CHECK(h3->header("content-length") == "5");
  CHECK(c.read_exact(5) == "whole");
  CHECK(f.seen->until([&] { return f.seen->served == 3; }));
}

TEST_CASE("stream: Connection: close is honoured after a streamed response") {
  Fixture f;
  RawClient c = f.client();
  REQUIRE(c.send("GET /stream/chunked HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"));
  auto h = c.read_head();
  REQUIRE(h);
  CHECK(h->status == 200);
  CHECK(h->header("connection") == "close");
  auto chunks = c.read_chunks();
  REQUIRE(chunks);
  CHECK(*chunks == std::vector<std::string>{"hello ", "world"});
  CHECK(c.wait_eof());
}

TEST_CASE("stream: an HTTP/1.0 client gets no chunked framing") {
  // RFC 9112 6.1: Transfer-Encoding only in answer to HTTP/1.1 requests. A
  // body of unannounced length to a 1.0 client ends at the close.
  Fixture f;
  RawClient c = f.client();
  REQUIRE(c.send("GET /stream/chunked HTTP/1.0\r\nHost: t\r\n\r\n"));
  auto h = c.read_head();
  REQUIRE(h);
  CHECK(h->status == 200);
  CHECK(h->header("transfer-encoding") == "");
  CHECK(c.wait_eof());
  CHECK(c.buffered() == "hello world");
}

TEST_CASE("stream: respond() sends a whole HttpResponse") {
  Fixture f;
  RawClient c = f.client();
  REQUIRE(c.send(post("/stream/echo", "ping")));
  auto h = c.read_head();
  REQUIRE(h);
  CHECK(h->status == 200);
  CHECK(h->header("content-length") == "5");
  CHECK(c.read_exact(5) == "ping|");
  // Keep-alive after respond() too.
  REQUIRE(c.send(post("/stream/echo", "")));
  auto h2 = c.read_head();
  REQUIRE(h2);
  CHECK(c.read_exact(1) == "|");
}

TEST_CASE("stream: a body over the limit gets the error hook's 413 and never reaches serve()") {
  Fixture f;
  SUBCASE("announced with Content-Length") {
    RawClient c = f.client();
    REQUIRE(c.send(post("/stream/echo", std::string(kBodyLimit + 1, 'x'))));
    auto h = c.read_head();
    REQUIRE(h);
    CHECK(h->status == 413);
    CHECK(h->header("connection") == "close");
    size_t n = std::stoul(h->header("content-length"));
    auto body = c.read_exact(n);
    REQUIRE(body);
    CHECK(body->rfind("refused 413 /stream/echo: ", 0) == 0);
    CHECK(c.wait_eof());
  }
  SUBCASE("chunked, found out while reading") {
    RawClient c = f.client();
    std::string piece(40, 'y');
    REQUIRE(c.send("POST /stream/echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n28\r\n" + piece +
                   "\r\n28\r\n" + piece + "\r\n0\r\n\r\n"));
    auto h = c.read_head();
    REQUIRE(h);
    CHECK(h->status == 413);
    auto body = c.read_exact(std::stoul(h->header("content-length")));
    REQUIRE(body);
    CHECK(body->rfind("refused 413 /stream/echo: ", 0) == 0);
    CHECK(c.wait_eof());
  }
  std::lock_guard<std::mutex> l(f.seen->mu);
  CHECK(f.seen->errors == 1);
  CHECK(f.seen->last_error_status == 413);
  CHECK(f.seen->served == 0);
}

TEST_CASE("stream: a body of exactly the limit is served") {
  Fixture f;
  RawClient c = f.client();
  std::string body(kBodyLimit, 'z');
  REQUIRE(c.send(post("/stream/echo", body)));
  auto h = c.read_head();
  REQUIRE(h);
  CHECK(h->status == 200);
  CHECK(c.read_exact(body.size() + 1) == body + "|");
  std::lock_guard<std::mutex> l(f.seen->mu);
  CHECK(f.seen->errors == 0);
}

TEST_CASE("stream: watch_closed calls on_gone when the client goes away while serve() waits") {
  Fixture f;
  RawClient c = f.client();
  REQUIRE(c.send(get("/stream/wait")));
  REQUIRE(f.seen->until([&] { return f.seen->waiting; }));
  {
    std::lock_guard<std::mutex> l(f.seen->mu);
    CHECK_FALSE(f.seen->gone);
  }
  SUBCASE("close") { c.close(); }
  SUBCASE("reset") { c.reset(); }
  SUBCASE("half-close: the client will send nothing more") { c.shutdown_write(); }
  REQUIRE(f.seen->until([&] { return f.seen->wait_done == 1; }));
  std::lock_guard<std::mutex> l(f.seen->mu);
  CHECK(f.seen->gone);
  CHECK(f.seen->wait_cancelled);
}

TEST_CASE("stream: the connection is not reused after serve() wrote nothing") {
  Fixture f;
  RawClient c = f.client();
  REQUIRE(c.send(get("/stream/nothing")));
  CHECK(c.wait_eof());
  CHECK(c.buffered().empty());
}

TEST_CASE("adopt: a channel connection is bound to its sandbox and reaches stream routes only") {
  Fixture f;
  int sv[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
  REQUIRE(f.server->adopt(UniqueFd(sv[0]), "sbx-7").ok());
  RawClient c(sv[1]);
  REQUIRE(c.send(post("/stream/echo", "hi")));
  auto h = c.read_head();
  REQUIRE(h);
  CHECK(h->status == 200);
  CHECK(c.read_exact(std::stoul(h->header("content-length"))) == "hi|sbx-7");
  {
    std::lock_guard<std::mutex> l(f.seen->mu);
    CHECK(f.seen->last_bound == "sbx-7");
  }
  // Streamed responses on the channel too, with keep-alive.
  REQUIRE(c.send(get("/stream/chunked")));
  auto hc = c.read_head();
  REQUIRE(hc);
  auto chunks = c.read_chunks();
  REQUIRE(chunks);
  CHECK(*chunks == std::vector<std::string>{"hello ", "world"});

  SUBCASE("a control-plane route is 404, and neither the handler nor the sandbox router sees it") {
    REQUIRE(c.send(get("/health")));
  }
  SUBCASE("a request routed to a sandbox elsewhere is 404 here") {
    REQUIRE(c.send("GET /sandbox/x HTTP/1.1\r\nHost: t\r\nE2b-Sandbox-Id: sbx-1\r\n\r\n"));
  }
  auto h404 = c.read_head();
  REQUIRE(h404);
  CHECK(h404->status == 404);
  CHECK(c.wait_eof());
  {
    std::lock_guard<std::mutex> l(f.seen->mu);
    CHECK(f.seen->handled == 0);
    CHECK(f.seen->routed == 0);
  }

  // The same requests over TCP do reach them (so the zeros above mean something).
  RawClient t = f.client();
  REQUIRE(t.send(get("/health")));
  auto ht = t.read_head();
  REQUIRE(ht);
  CHECK(ht->status == 200);
  REQUIRE(t.read_exact(std::stoul(ht->header("content-length"))));
  REQUIRE(t.send(post("/stream/echo", "tcp")));
  auto he = t.read_head();
  REQUIRE(he);
  CHECK(t.read_exact(std::stoul(he->header("content-length"))) == "tcp|");
  std::lock_guard<std::mutex> l(f.seen->mu);
  CHECK(f.seen->handled == 1);
  CHECK(f.seen->routed == 1);
  CHECK_FALSE(f.seen->bound_set_on_tcp);
}

TEST_CASE("adopt: refused once the server is stopping") {
  Fixture f;
  f.server->stop();
  int sv[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
  Status s = f.server->adopt(UniqueFd(sv[0]), "sbx-7");
  REQUIRE_FALSE(s.ok());
  CHECK(s.error().kind() == ErrorKind::kUnavailable);
  RawClient c(sv[1]);
  CHECK(c.wait_eof());  // the fd was closed, not leaked
}

TEST_CASE("stream: precheck refuses from the head alone, without waiting for the body") {
  Fixture f;
  RawClient c = f.client();
  // The body is announced but never sent: only a head-time refusal answers.
  REQUIRE(c.send("POST /stream/echo HTTP/1.1\r\nHost: t\r\nx-deny: 1\r\nContent-Length: 40\r\n\r\n"));
  auto h = c.read_head();
  REQUIRE(h);
  CHECK(h->status == 401);
  CHECK(c.wait_eof());
  std::lock_guard<std::mutex> l(f.seen->mu);
  CHECK(f.seen->served == 0);
}

TEST_CASE("stream: the shared body budget refuses with 503 while bodies are held, then frees") {
  Fixture f(100);
  // A holds 60 bytes of the 100 while serve() waits.
  RawClient a = f.client();
  REQUIRE(a.send(post("/stream/wait", std::string(60, 'a'))));
  REQUIRE(f.seen->until([&] { return f.seen->waiting; }));
  RawClient b = f.client();
  REQUIRE(b.send(post("/stream/echo", std::string(50, 'b'))));
  auto hb = b.read_head();
  REQUIRE(hb);
  CHECK(hb->status == 503);
  {
    std::lock_guard<std::mutex> l(f.seen->mu);
    CHECK(f.seen->last_error_status == 503);
    CHECK(f.seen->served == 1);
  }
  // A goes away: its reservation is returned once its request ends.
  a.close();
  REQUIRE(f.seen->until([&] { return f.seen->wait_done == 1; }));
  bool served = false;
  for (int i = 0; i < 100 && !served; ++i) {  // the release follows serve()'s end on the io thread
    RawClient c = f.client();
    REQUIRE(c.send(post("/stream/echo", std::string(50, 'c'))));
    auto hc = c.read_head();
    REQUIRE(hc);
    served = hc->status == 200;
    if (!served) std::this_thread::yield();
  }
  CHECK(served);
}

TEST_CASE("stream: a caller authorize() refuses holds no budget; one share cannot take another's") {
  Fixture f(120, 80);
  // A stranger announcing a body larger than the whole budget is refused
  // at once, without sending a byte of it, and holds nothing.
  RawClient x = f.client();
  REQUIRE(x.send("POST /stream/echo HTTP/1.1\r\nHost: t\r\nx-stranger: 1\r\nContent-Length: 60\r\n\r\n"));
  auto hx = x.read_head();
  REQUIRE(hx);
  CHECK(hx->status == 401);
  // Share a holds 60 of its 80 while serve() waits.
  RawClient a = f.client();
  REQUIRE(a.send("POST /stream/wait HTTP/1.1\r\nHost: t\r\nx-who: a\r\nContent-Length: 60\r\n\r\n" +
                 std::string(60, 'a')));
  REQUIRE(f.seen->until([&] { return f.seen->waiting; }));
  // Another 30 for a is past its share; 30 for b is within the total.
  RawClient a2 = f.client();
  REQUIRE(a2.send("POST /stream/echo HTTP/1.1\r\nHost: t\r\nx-who: a\r\nContent-Length: 30\r\n\r\n" +
                  std::string(30, 'c')));
  auto ha2 = a2.read_head();
  REQUIRE(ha2);
  CHECK(ha2->status == 503);
  RawClient b = f.client();
  REQUIRE(b.send("POST /stream/echo HTTP/1.1\r\nHost: t\r\nx-who: b\r\nContent-Length: 30\r\n\r\n" +
                 std::string(30, 'b')));
  auto hb = b.read_head();
  REQUIRE(hb);
  CHECK(hb->status == 200);
  a.close();
  REQUIRE(f.seen->until([&] { return f.seen->wait_done == 1; }));
}

TEST_CASE("proxy: an answer given before the body is read (no such sandbox) survives the body still coming") {
  // The gateway answers 502 from the request head and closes; closing
  // with the body unread would reset the connection and lose the answer
  // (and fail the client's writes). It drains what the client sends.
  Fixture f;
  RawClient c = f.client();
  REQUIRE(c.send(post("/sandbox/upload", std::string(4 << 20, 'b'))));
  auto h = c.read_head();
  REQUIRE(h);
  CHECK(h->status == 502);
  CHECK(h->header("connection") == "close");
  auto body = c.read_exact(std::stoul(h->header("content-length")));
  REQUIRE(body);
  CHECK(body->find("The sandbox was not found") != std::string::npos);
  CHECK(c.wait_eof());
}

namespace {
// Whether a TCP connect to port on loopback is refused.
bool connect_refused(uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bool refused = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 && errno == ECONNREFUSED;
  ::close(fd);
  return refused;
}
}  // namespace

TEST_CASE("drain: a request in progress finishes and its connection closes; no new connection is taken") {
  Fixture f;
  RawClient c = f.client();
  REQUIRE(c.send(get("/stream/slow")));
  REQUIRE(f.seen->until([&] { return f.seen->waiting; }));
  auto t0 = std::chrono::steady_clock::now();
  bool drained = f.server->drain(5000ms);
  CHECK(drained);
  CHECK(std::chrono::steady_clock::now() - t0 >= 100ms);  // it waited for the answer
  auto h = c.read_head();
  REQUIRE(h);
  CHECK(h->status == 200);
  auto chunks = c.read_chunks();
  REQUIRE(chunks);
  CHECK(*chunks == std::vector<std::string>{"late"});
  CHECK(c.wait_eof());  // closed after its response
  CHECK(connect_refused(f.server->port()));
}

TEST_CASE("drain: a request that does not finish holds it until the timeout; stop() then ends it") {
  Fixture f;
  RawClient c = f.client();
  REQUIRE(c.send(get("/stream/wait")));
  REQUIRE(f.seen->until([&] { return f.seen->waiting; }));
  // An idle keep-alive connection does not hold a drain.
  RawClient idle = f.client();
  REQUIRE(idle.send(get("/plain")));
  REQUIRE(idle.read_head());
  CHECK_FALSE(f.server->drain(200ms));
  f.server->stop();
  CHECK(c.wait_eof());
}

TEST_CASE("drain then stop at once, a client connecting meanwhile: the acceptor is closed once, safely, every time") {
  // The drain's close and the stop's both go to the acceptor; on two io
  // threads at once they crashed in the reactor (a SIGSEGV at SIGTERM).
  for (int i = 0; i < 1000; ++i) {
    Fixture f;
    RawClient c = f.client();
    CHECK(f.server->drain(0ms));
    f.server->stop();
  }
}
