// HTTP/2 session: nghttp2 (callback API, memory I/O) driven by coroutines on
// the connection's strand.
//
// Shape: a reader coroutine feeds socket bytes to nghttp2_session_mem_recv;
// a writer coroutine drains nghttp2_session_mem_send to the socket whenever
// it is woken (kick()); a watchdog enforces the idle and stalled-write
// timeouts by closing the socket. Each proxied stream has two coroutines:
// one writes the request body upstream (consuming flow-control window only
// as bytes are written), one reads the HTTP/1.1 response and feeds the
// stream's response buffer, which a deferred data provider drains. Timers
// set to expire never serve as condition variables: a waiter checks its
// condition and waits in one strand step, a waker cancels the timer.
#include "gateway/http/h2_session.h"

#include <nghttp2/nghttp2.h>

#include <algorithm>
#include <array>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http/buffer_body.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/read.hpp>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "base/log.h"

namespace sg::http {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using Clock = std::chrono::steady_clock;

namespace {

constexpr size_t kReadChunk = 16 * 1024;
constexpr size_t kWriteBatch = 64 * 1024;
constexpr size_t kUpstreamRead = 64 * 1024;

bool hop_by_hop(const std::string& name) {
  return name == "connection" || name == "keep-alive" || name == "proxy-connection" || name == "transfer-encoding" ||
         name == "upgrade" || name == "te" || name == "http2-settings";
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// A condition variable for one strand.
struct Signal {
  asio::steady_timer timer;
  explicit Signal(const asio::any_io_executor& ex) : timer(ex, Clock::time_point::max()) {}
  asio::awaitable<void> wait() {
    timer.expires_at(Clock::time_point::max());
    boost::system::error_code ec;
    co_await timer.async_wait(asio::redirect_error(asio::use_awaitable, ec));
  }
  void notify() { timer.cancel(); }
};

enum class Kind { kPending, kControl, kProxy };

struct Stream {
  int32_t id;
  Kind kind = Kind::kPending;
  HttpRequest head;
  size_t header_bytes = 0;
  bool headers_too_large = false;
  bool request_done = false;  // END_STREAM received
  bool closed = false;        // nghttp2 closed the stream
  bool responded = false;     // a response was submitted
  bool discard = false;       // request body no longer wanted: consume and drop
  size_t held = 0;            // DATA bytes received, not yet consumed (window still shut)
  size_t discarded = 0;
  bool reset_sent = false;
  ProxyTarget target;
  // Control plane: the buffered body.
  std::string body;
  // Proxy: request body not yet written upstream (not yet consumed).
  std::string up_pending;
  std::unique_ptr<asio::local::stream_protocol::socket> up;
  Signal up_wake;  // request bytes arrived, or the stream ended
  // Response body: bytes not yet taken by the data provider.
  std::string out;
  size_t out_off = 0;
  bool out_eof = false;
  bool deferred = false;
  Signal space;  // the data provider took bytes, or the stream closed

  Stream(int32_t i, const asio::any_io_executor& ex) : id(i), up_wake(ex), space(ex) {}
  size_t out_size() const { return out.size() - out_off; }
};

struct Conn : std::enable_shared_from_this<Conn> {
  beast::ssl_stream<beast::tcp_stream>& sock;
  std::string remote;
  H2Deps deps;
  asio::any_io_executor ex;
  nghttp2_session* session = nullptr;
  std::map<int32_t, std::shared_ptr<Stream>> streams;
  bool dead = false;          // the socket is gone: no more nghttp2 I/O
  bool reading_done = false;  // the reader has stopped
  bool writer_done = false;
  int busy = 0;  // streams with a handler or an upstream in progress
  // Control-plane bodies buffered on this connection; beyond the budget
  // their window stays shut until a handler takes its body.
  size_t control_buffered = 0;
  size_t control_budget = 0;
  Clock::time_point last_read = Clock::now();
  std::optional<Clock::time_point> write_since;  // a socket write in flight since
  Signal wake;                                   // the writer has something to do
  Signal finished;                               // the writer or the watchdog ended

  Conn(beast::ssl_stream<beast::tcp_stream>& s, std::string r, H2Deps d, asio::any_io_executor e)
      : sock(s),
        remote(std::move(r)),
        deps(d),
        ex(e),
        control_budget(std::max<size_t>(8u << 20, 2 * d.cfg.body_limit)),
        wake(e),
        finished(e) {}
  ~Conn() {
    if (session) nghttp2_session_del(session);
  }

  void kick() { wake.notify(); }
  void close_socket() {
    boost::system::error_code ignored;
    beast::get_lowest_layer(sock).socket().close(ignored);
  }

  Stream* find(int32_t id) {
    auto it = streams.find(id);
    return it == streams.end() ? nullptr : it->second.get();
  }

  // Setup and the main loops.
  bool init();
  asio::awaitable<void> reader();
  asio::awaitable<void> writer();
  asio::awaitable<void> watchdog();

  // Requests.
  void on_request_head(Stream& s);
  void on_request_end(Stream& s);
  void dispatch(std::shared_ptr<Stream> s);
  asio::awaitable<void> run_handler(std::shared_ptr<Stream> s);
  asio::awaitable<void> run_proxy(std::shared_ptr<Stream> s);
  asio::awaitable<void> send_upstream(std::shared_ptr<Stream> s, bool chunked);
  void respond(Stream& s, HttpResponse r);
  void start_discard(Stream& s);
  // Reopens the window for n held bytes of s (the connection's only, once
  // the stream is closed: its held bytes still count there).
  void consume(Stream& s, size_t n) {
    n = std::min(n, s.held);
    s.held -= n;
    if (dead || n == 0) return;
    if (s.closed)
      nghttp2_session_consume_connection(session, n);
    else
      nghttp2_session_consume(session, s.id, n);
  }
  void drop_control_body(Stream& s) {
    control_buffered -= std::min(control_buffered, s.body.size());
    s.body.clear();
    s.body.shrink_to_fit();
  }
  // Consumes held control-plane bytes while the budget allows.
  void release_control() {
    for (auto& [id, st] : streams) {
      if (control_buffered > control_budget) break;
      if (st->kind == Kind::kControl && st->held > 0) consume(*st, st->held);
    }
    kick();
  }
  void push_body(Stream& s, const char* p, size_t n) {
    if (s.out_off > 0 && s.out_off >= s.out.size() / 2) {
      s.out.erase(0, s.out_off);
      s.out_off = 0;
    }
    s.out.append(p, n);
    resume(s);
  }
  void resume(Stream& s) {
    if (s.deferred && !s.closed && !dead) {
      s.deferred = false;
      nghttp2_session_resume_data(session, s.id);
    }
    kick();
  }
};

Conn* self(void* user) { return static_cast<Conn*>(user); }

ssize_t read_body(nghttp2_session*, int32_t, uint8_t* buf, size_t length, uint32_t* flags, nghttp2_data_source* src,
                  void*) {
  auto* s = static_cast<Stream*>(src->ptr);
  size_t n = std::min(length, s->out_size());
  if (n == 0 && !s->out_eof) {
    s->deferred = true;
    return NGHTTP2_ERR_DEFERRED;
  }
  // SAFETY: n <= length (nghttp2's buffer) and n <= out_size() bytes from out_off.
  std::memcpy(buf, s->out.data() + s->out_off, n);
  s->out_off += n;
  if (s->out_off == s->out.size()) {
    s->out.clear();
    s->out_off = 0;
  }
  if (s->out_eof && s->out_size() == 0) *flags |= NGHTTP2_DATA_FLAG_EOF;
  if (n > 0) s->space.notify();
  return static_cast<ssize_t>(n);
}

int on_begin_headers(nghttp2_session*, const nghttp2_frame* frame, void* user) {
  Conn* c = self(user);
  if (frame->hd.type != NGHTTP2_HEADERS || frame->headers.cat != NGHTTP2_HCAT_REQUEST) return 0;
  auto s = std::make_shared<Stream>(frame->hd.stream_id, c->ex);
  s->head.remote = c->remote;
  c->streams[s->id] = std::move(s);
  return 0;
}

int on_header(nghttp2_session*, const nghttp2_frame* frame, const uint8_t* name, size_t namelen, const uint8_t* value,
              size_t valuelen, uint8_t, void* user) {
  Conn* c = self(user);
  if (frame->hd.type != NGHTTP2_HEADERS) return 0;
  Stream* s = c->find(frame->hd.stream_id);
  if (!s || s->kind != Kind::kPending) return 0;  // trailers: not forwarded
  s->header_bytes += namelen + valuelen + 32;
  if (s->header_bytes > c->deps.cfg.header_limit) {
    s->headers_too_large = true;
    return 0;
  }
  // SAFETY: nghttp2 passes namelen/valuelen bytes at name/value.
  std::string n(reinterpret_cast<const char*>(name), namelen);
  std::string v(reinterpret_cast<const char*>(value), valuelen);
  HttpRequest& h = s->head;
  if (n == ":method") {
    h.method = std::move(v);
  } else if (n == ":path") {
    h.target = std::move(v);
    size_t q = h.target.find('?');
    h.path = h.target.substr(0, q);
    if (q != std::string::npos) h.query = h.target.substr(q + 1);
  } else if (n == ":authority") {
    h.headers.try_emplace("host", std::move(v));
  } else if (!n.empty() && n[0] == ':') {
    // :scheme and others: not part of the HTTP/1.1 head.
  } else if (n == "host") {
    h.headers.try_emplace(n, std::move(v));  // :authority wins
  } else {
    auto [it, fresh] = h.headers.try_emplace(n, v);
    if (!fresh) {
      it->second += n == "cookie" ? "; " : ", ";
      it->second += v;
    }
  }
  return 0;
}

int on_frame_recv(nghttp2_session*, const nghttp2_frame* frame, void* user) {
  Conn* c = self(user);
  if (frame->hd.type != NGHTTP2_HEADERS && frame->hd.type != NGHTTP2_DATA) return 0;
  Stream* s = c->find(frame->hd.stream_id);
  if (!s) return 0;
  if (frame->hd.type == NGHTTP2_HEADERS && s->kind == Kind::kPending) c->on_request_head(*s);
  if ((frame->hd.flags & NGHTTP2_FLAG_END_STREAM) && !s->request_done) {
    s->request_done = true;
    c->on_request_end(*s);
  }
  return 0;
}

int on_data_chunk(nghttp2_session*, uint8_t, int32_t id, const uint8_t* data, size_t len, void* user) {
  Conn* c = self(user);
  Stream* s = c->find(id);
  if (!s) {
    nghttp2_session_consume_connection(c->session, len);
    return 0;
  }
  // SAFETY: nghttp2 passes len bytes at data.
  const char* p = reinterpret_cast<const char*>(data);
  s->held += len;
  if (s->discard || s->kind == Kind::kPending) {
    s->discarded += len;
    c->consume(*s, len);
    // A client that keeps sending after its answer: stop it (once).
    if (s->discarded > c->deps.cfg.body_limit && s->responded && !s->reset_sent) {
      s->reset_sent = true;
      nghttp2_submit_rst_stream(c->session, NGHTTP2_FLAG_NONE, id, NGHTTP2_NO_ERROR);
    }
    return 0;
  }
  if (s->kind == Kind::kControl) {
    if (s->body.size() + len > c->deps.cfg.body_limit) {
      c->respond(*s, json_error(413, "request body larger than the limit of " + std::to_string(c->deps.cfg.body_limit) +
                                         " bytes"));
      c->start_discard(*s);
      return 0;
    }
    s->body.append(p, len);
    c->control_buffered += len;
    if (c->control_buffered <= c->control_budget) c->consume(*s, s->held);
    return 0;
  }
  s->up_pending.append(p, len);
  s->up_wake.notify();
  return 0;
}

int on_stream_close(nghttp2_session*, int32_t id, uint32_t, void* user) {
  Conn* c = self(user);
  auto it = c->streams.find(id);
  if (it == c->streams.end()) return 0;
  std::shared_ptr<Stream> s = std::move(it->second);
  c->streams.erase(it);
  s->closed = true;
  c->consume(*s, s->held);
  if (s->kind == Kind::kControl && !s->body.empty()) {
    c->drop_control_body(*s);
    c->release_control();
  }
  if (s->up) {
    boost::system::error_code ignored;
    s->up->close(ignored);
  }
  s->up_wake.notify();
  s->space.notify();
  return 0;
}

}  // namespace

void Conn::respond(Stream& s, HttpResponse r) {
  if (s.responded || s.closed || dead) return;
  s.responded = true;
  bool no_body = r.status == 204 || r.status == 304 || (r.status >= 100 && r.status < 200) || s.head.method == "HEAD";
  std::vector<std::pair<std::string, std::string>> fields;
  fields.emplace_back(":status", std::to_string(r.status));
  fields.emplace_back("server", "sandgate");
  for (auto& [k, v] : r.headers) {
    std::string n = lower(k);
    if (hop_by_hop(n) || n == "content-length" || n == "server" || (n == "content-type" && !r.content_type.empty()))
      continue;
    fields.emplace_back(std::move(n), v);
  }
  if (!r.content_type.empty()) fields.emplace_back("content-type", r.content_type);
  if (!no_body) fields.emplace_back("content-length", std::to_string(r.body.size()));
  std::vector<nghttp2_nv> nv;
  for (auto& [k, v] : fields)
    nv.push_back({reinterpret_cast<uint8_t*>(k.data()), reinterpret_cast<uint8_t*>(v.data()), k.size(), v.size(),
                  NGHTTP2_NV_FLAG_NONE});
  s.out = no_body ? std::string() : std::move(r.body);
  s.out_off = 0;
  s.out_eof = true;
  nghttp2_data_provider prd{};
  prd.source.ptr = &s;
  prd.read_callback = read_body;
  nghttp2_submit_response(session, s.id, nv.data(), nv.size(), no_body ? nullptr : &prd);
  kick();
}

void Conn::start_discard(Stream& s) {
  s.discard = true;
  drop_control_body(s);
  s.up_pending.clear();
  consume(s, s.held);
  s.up_wake.notify();
  release_control();
}

void Conn::on_request_head(Stream& s) {
  const ServerConfig& cfg = deps.cfg;
  s.kind = Kind::kControl;
  if (s.headers_too_large) {
    respond(s,
            json_error(431, "request headers larger than the limit of " + std::to_string(cfg.header_limit) + " bytes"));
    start_discard(s);
    return;
  }
  if (deps.stream_hooks.owns && deps.stream_hooks.owns(s.head)) {
    std::string msg = "this route is served over HTTP/1.1 only: retry without HTTP/2";
    respond(s, deps.stream_hooks.error ? deps.stream_hooks.error(s.head, 505, msg) : json_error(505, msg));
    start_discard(s);
    return;
  }
  if (deps.proxy_hooks.route) {
    Result<std::optional<ProxyTarget>> target = deps.proxy_hooks.route(s.head);
    if (!target) {
      respond(s, json_error(400, target.error().message()));
      start_discard(s);
      return;
    }
    if (*target) {
      s.kind = Kind::kProxy;
      s.target = **target;
      ++busy;
      asio::co_spawn(ex, run_proxy(streams[s.id]), asio::detached);
      return;
    }
  }
  std::string len = s.head.header("content-length");
  if (!len.empty()) {
    char* end = nullptr;
    unsigned long long n = std::strtoull(len.c_str(), &end, 10);
    if (end && *end == '\0' && n > cfg.body_limit) {
      respond(s, json_error(413, "request body larger than the limit of " + std::to_string(cfg.body_limit) + " bytes"));
      start_discard(s);
    }
  }
}

void Conn::on_request_end(Stream& s) {
  if (s.kind == Kind::kControl && !s.discard && !s.responded) dispatch(streams[s.id]);
  if (s.kind == Kind::kProxy) s.up_wake.notify();
}

void Conn::dispatch(std::shared_ptr<Stream> s) {
  ++busy;
  asio::co_spawn(ex, run_handler(std::move(s)), asio::detached);
}

asio::awaitable<void> Conn::run_handler(std::shared_ptr<Stream> s) {
  auto keep = shared_from_this();
  HttpRequest req = s->head;
  req.body = s->body;
  drop_control_body(*s);
  release_control();
  // Hop to the worker pool: the handler may block on SQLite or the runtime.
  co_await asio::post(deps.workers.get_executor(), asio::use_awaitable);
  HttpResponse res;
  try {
    res = deps.handler(req);
  } catch (const std::exception& e) {
    LOG_ERROR("handler " << req.method << " " << req.path << " threw: " << e.what());
    res = json_error(500, "internal error");
  }
  co_await asio::post(ex, asio::use_awaitable);
  --busy;
  respond(*s, std::move(res));
}

asio::awaitable<void> Conn::send_upstream(std::shared_ptr<Stream> s, bool chunked) {
  auto keep = shared_from_this();
  boost::system::error_code ec;
  for (;;) {
    if (s->closed || dead) co_return;
    if (s->discard) co_return;
    if (s->up_pending.empty()) {
      if (s->request_done) break;
      co_await s->up_wake.wait();
      continue;
    }
    std::string piece = std::move(s->up_pending);
    s->up_pending.clear();
    std::vector<asio::const_buffer> bufs;
    char hex[24];
    int hn = std::snprintf(hex, sizeof hex, "%zx\r\n", piece.size());
    if (chunked) bufs.push_back(asio::buffer(hex, static_cast<size_t>(hn)));
    bufs.push_back(asio::buffer(piece));
    if (chunked) bufs.push_back(asio::buffer("\r\n", 2));
    co_await asio::async_write(*s->up, bufs, asio::redirect_error(asio::use_awaitable, ec));
    if (ec) {
      LOG_DEBUG("h2 request body to sandbox " << s->target.sandbox_id << ": " << ec.message());
      consume(*s, piece.size());
      if (!s->closed) start_discard(*s);
      kick();
      co_return;
    }
    // The window opens only now: the client can send as fast as the sandbox reads.
    consume(*s, piece.size());
    kick();
  }
  if (chunked)
    co_await asio::async_write(*s->up, asio::buffer("0\r\n\r\n", 5), asio::redirect_error(asio::use_awaitable, ec));
}

asio::awaitable<void> Conn::run_proxy(std::shared_ptr<Stream> s) {
  auto keep = shared_from_this();
  struct Done {
    Conn* c;
    ~Done() { --c->busy; }
  } done{this};
  const ProxyTarget target = s->target;
  auto fail = [&](const std::string& msg) {
    respond(*s, sandbox_unavailable(target.sandbox_id, msg));
    start_discard(*s);
  };
  // Connect on a worker: it may resume a paused sandbox first.
  co_await asio::post(deps.workers.get_executor(), asio::use_awaitable);
  Result<UniqueFd> fd = internal_error("no proxy connector");
  try {
    if (deps.proxy_hooks.connect) fd = deps.proxy_hooks.connect(target, s->head);
  } catch (const std::exception& e) {
    fd = internal_error(e.what());
  }
  co_await asio::post(ex, asio::use_awaitable);
  if (s->closed || dead) co_return;
  if (!fd) {
    if (fd.error().kind() == ErrorKind::kUnauthorized) {
      respond(*s, json_error(401, fd.error().message()));
      start_discard(*s);
      co_return;
    }
    fail(fd.error().kind() == ErrorKind::kNotFound ? "The sandbox was not found" : client_message(fd.error()));
    co_return;
  }
  boost::system::error_code ec;
  s->up = std::make_unique<asio::local::stream_protocol::socket>(ex);
  s->up->assign(asio::local::stream_protocol(), fd->release(), ec);
  if (ec) {
    fail("stream setup: " + ec.message());
    co_return;
  }

  // Request head: HTTP/1.1, one request per channel stream.
  const HttpRequest& h = s->head;
  bool has_length = h.headers.count("content-length") > 0;
  // The whole body may be here already (connect() takes a while): then its
  // length is known; otherwise chunked, as an HTTP/1.1 client would.
  bool chunked = !s->request_done && !has_length;
  bool known_length = s->request_done && !has_length && !s->up_pending.empty();
  std::string head = h.method + " " + h.target + " HTTP/1.1\r\n";
  head += "Host: " + h.header("host") + "\r\n";
  for (const auto& [k, v] : h.headers) {
    if (k == "host" || k == "expect" || hop_by_hop(k)) continue;
    head += k + ": " + v + "\r\n";
  }
  head += "Connection: close\r\n";
  if (chunked) head += "Transfer-Encoding: chunked\r\n";
  if (known_length) head += "Content-Length: " + std::to_string(s->up_pending.size()) + "\r\n";
  head += "\r\n";
  co_await asio::async_write(*s->up, asio::buffer(head), asio::redirect_error(asio::use_awaitable, ec));
  if (ec) {
    if (!s->closed) {
      respond(*s, port_unanswered(target));  // refused before the request went in
      start_discard(*s);
    }
    co_return;
  }
  asio::co_spawn(ex, send_upstream(s, chunked), asio::detached);

  // Response head (1xx interim answers skipped), then the body piece by piece.
  beast::flat_buffer ubuf;
  std::optional<bhttp::response_parser<bhttp::buffer_body>> resp;
  for (;;) {
    resp.emplace();
    resp->body_limit(boost::none);
    resp->header_limit(64 * 1024);
    if (h.method == "HEAD") resp->skip(true);
    co_await bhttp::async_read_header(*s->up, ubuf, *resp, asio::redirect_error(asio::use_awaitable, ec));
    if (s->closed || dead) co_return;
    if (ec) {
      respond(*s, port_unanswered(target));
      start_discard(*s);
      co_return;
    }
    unsigned code = resp->get().result_int();
    if (code == 101) {
      // Upgrade headers are not forwarded, so this is a confused upstream.
      fail("port " + std::to_string(target.port) + " answered 101 Switching Protocols, which HTTP/2 cannot carry");
      co_return;
    }
    if (code / 100 != 1) break;
  }
  auto& res = resp->get();
  unsigned code = res.result_int();
  bool no_body = code == 204 || code == 304 || h.method == "HEAD" || code / 100 == 1;
  std::vector<std::pair<std::string, std::string>> fields;
  fields.emplace_back(":status", std::to_string(code));
  for (const auto& f : res) {
    std::string n = lower(std::string(f.name_string()));
    if (hop_by_hop(n)) continue;
    fields.emplace_back(std::move(n), std::string(f.value()));
  }
  std::vector<nghttp2_nv> nv;
  for (auto& [k, v] : fields)
    nv.push_back({reinterpret_cast<uint8_t*>(k.data()), reinterpret_cast<uint8_t*>(v.data()), k.size(), v.size(),
                  NGHTTP2_NV_FLAG_NONE});
  nghttp2_data_provider prd{};
  prd.source.ptr = s.get();
  prd.read_callback = read_body;
  s->responded = true;
  s->out_eof = no_body || resp->is_done();
  nghttp2_submit_response(session, s->id, nv.data(), nv.size(), no_body ? nullptr : &prd);
  kick();
  if (no_body) co_return;

  std::vector<char> buf(kUpstreamRead);
  while (!resp->is_done()) {
    while (s->out_size() >= kH2ResponseBuffer && !s->closed && !dead) co_await s->space.wait();
    if (s->closed || dead) co_return;
    res.body().data = buf.data();
    res.body().size = buf.size();
    co_await bhttp::async_read_some(*s->up, ubuf, *resp, asio::redirect_error(asio::use_awaitable, ec));
    if (ec == bhttp::error::need_buffer) ec = {};
    if (s->closed || dead) co_return;
    if (ec) {
      LOG_DEBUG("h2 response from sandbox " << target.sandbox_id << ": " << ec.message());
      nghttp2_submit_rst_stream(session, NGHTTP2_FLAG_NONE, s->id, NGHTTP2_INTERNAL_ERROR);
      kick();
      co_return;
    }
    // A read may parse only framing (a chunk header): nothing to pass on.
    size_t n = buf.size() - res.body().size;
    if (n > 0) push_body(*s, buf.data(), n);
  }
  s->out_eof = true;
  resume(*s);
}

bool Conn::init() {
  nghttp2_session_callbacks* cbs = nullptr;
  if (nghttp2_session_callbacks_new(&cbs) != 0) return false;
  nghttp2_session_callbacks_set_on_begin_headers_callback(cbs, on_begin_headers);
  nghttp2_session_callbacks_set_on_header_callback(cbs, on_header);
  nghttp2_session_callbacks_set_on_frame_recv_callback(cbs, on_frame_recv);
  nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cbs, on_data_chunk);
  nghttp2_session_callbacks_set_on_stream_close_callback(cbs, on_stream_close);
  nghttp2_option* opt = nullptr;
  if (nghttp2_option_new(&opt) != 0) {
    nghttp2_session_callbacks_del(cbs);
    return false;
  }
  nghttp2_option_set_no_auto_window_update(opt, 1);
  nghttp2_option_set_max_outbound_ack(opt, 1000);
  int rv = nghttp2_session_server_new2(&session, cbs, this, opt);
  nghttp2_option_del(opt);
  nghttp2_session_callbacks_del(cbs);
  if (rv != 0) return false;
  nghttp2_settings_entry iv[] = {
      {NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS, kH2MaxStreams},
      {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, static_cast<uint32_t>(kH2StreamWindow)},
      {NGHTTP2_SETTINGS_MAX_HEADER_LIST_SIZE, static_cast<uint32_t>(deps.cfg.header_limit)},
  };
  if (nghttp2_submit_settings(session, NGHTTP2_FLAG_NONE, iv, sizeof iv / sizeof iv[0]) != 0) return false;
  return nghttp2_session_set_local_window_size(session, NGHTTP2_FLAG_NONE, 0, kH2ConnectionWindow) == 0;
}

asio::awaitable<void> Conn::reader() {
  std::array<uint8_t, kReadChunk> buf;
  boost::system::error_code ec;
  while (!dead && (nghttp2_session_want_read(session) || nghttp2_session_want_write(session))) {
    size_t n = co_await sock.async_read_some(asio::buffer(buf), asio::redirect_error(asio::use_awaitable, ec));
    if (ec || dead) break;
    last_read = Clock::now();
    ssize_t rv = nghttp2_session_mem_recv(session, buf.data(), n);
    if (rv < 0) {
      LOG_DEBUG("h2 " << remote << ": " << nghttp2_strerror(static_cast<int>(rv)));
      kick();
      break;
    }
    kick();
  }
  reading_done = true;
  kick();
}

asio::awaitable<void> Conn::writer() {
  std::string out;
  boost::system::error_code ec;
  while (!dead) {
    out.clear();
    while (out.size() < kWriteBatch) {
      const uint8_t* data = nullptr;
      ssize_t n = nghttp2_session_mem_send(session, &data);
      if (n < 0) {
        LOG_DEBUG("h2 " << remote << ": " << nghttp2_strerror(static_cast<int>(n)));
        dead = true;
        break;
      }
      if (n == 0) break;
      // SAFETY: nghttp2 keeps n bytes at data valid until the next mem_send.
      out.append(reinterpret_cast<const char*>(data), static_cast<size_t>(n));
    }
    if (!out.empty()) {
      write_since = Clock::now();
      co_await asio::async_write(sock, asio::buffer(out), asio::redirect_error(asio::use_awaitable, ec));
      write_since.reset();
      if (ec) break;
      continue;
    }
    if (dead || reading_done || (!nghttp2_session_want_read(session) && !nghttp2_session_want_write(session))) break;
    co_await wake.wait();
  }
  dead = true;
  close_socket();
  writer_done = true;
  finished.notify();
}

asio::awaitable<void> Conn::watchdog() {
  auto keep = shared_from_this();
  const auto& cfg = deps.cfg;
  auto period = std::clamp<std::chrono::milliseconds>(cfg.read_timeout / 4, std::chrono::milliseconds(10),
                                                      std::chrono::milliseconds(1000));
  asio::steady_timer t(ex);
  while (!dead) {
    t.expires_after(period);
    boost::system::error_code ec;
    co_await t.async_wait(asio::redirect_error(asio::use_awaitable, ec));
    if (dead) break;
    auto now = Clock::now();
    bool idle = busy == 0 && now - last_read > cfg.read_timeout;
    bool stalled = write_since && now - *write_since > cfg.stalled_write_timeout;
    if (idle || stalled) {
      LOG_DEBUG("h2 " << remote << ": " << (idle ? "idle" : "stalled write") << ", closing");
      dead = true;
      close_socket();
    }
  }
  finished.notify();
}

asio::awaitable<void> serve_h2(beast::ssl_stream<beast::tcp_stream>& stream, std::string remote, H2Deps deps) {
  try {
    auto ex = co_await asio::this_coro::executor;
    beast::get_lowest_layer(stream).expires_never();
    auto c = std::make_shared<Conn>(stream, std::move(remote), deps, ex);
    if (!c->init()) {
      LOG_WARN("h2 " << c->remote << ": nghttp2 session setup failed");
      co_return;
    }
    asio::co_spawn(ex, c->writer(), asio::detached);
    asio::co_spawn(ex, c->watchdog(), asio::detached);
    co_await c->reader();
    while (!c->writer_done) co_await c->finished.wait();
    c->dead = true;
    // Streams still open: their upstreams are closed, their coroutines end.
    auto streams = std::move(c->streams);
    for (auto& [id, s] : streams) {
      s->closed = true;
      if (s->up) {
        boost::system::error_code ignored;
        s->up->close(ignored);
      }
      s->up_wake.notify();
      s->space.notify();
    }
  } catch (const std::exception& e) {
    LOG_WARN("h2 connection: " << e.what());
  }
}

}  // namespace sg::http
