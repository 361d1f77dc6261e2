// HttpServer implementation: one coroutine per connection on its own strand.
#include "gateway/http/server.h"

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/string_body.hpp>
#include <boost/beast/http/write.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/empty_body.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/experimental/awaitable_operators.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast/ssl/ssl_stream.hpp>
#include <openssl/ssl.h>

#include <sys/resource.h>
#include <sys/socket.h>

#include <array>
#include <atomic>
#include <optional>
#include <condition_variable>
#include <map>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "gateway/http/h2_session.h"
#include "gateway/http/relay.h"
#include "base/log.h"

namespace sg::http {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using tcp = asio::ip::tcp;

struct HttpServer::Impl {
  ServerConfig cfg;
  Handler handler;
  ProxyHooks proxy_hooks;
  StreamHooks stream_hooks;
  // Declared before ioc: the coroutine frames ioc destroys when it goes
  // (connections still open at stop) release their counts in these.
  std::mutex conns_mu;
  std::set<beast::tcp_stream*> conns;  // GUARDED_BY(conns_mu): open connections (lowest layer), closed on stop
  std::set<beast::basic_stream<asio::local::stream_protocol>*> local_conns;  // GUARDED_BY(conns_mu): adopted channel connections
  std::map<std::string, size_t> per_address;  // GUARDED_BY(conns_mu): open TCP connections by source address
  size_t tcp_open = 0;                        // GUARDED_BY(conns_mu)
  // A drain (drain()): HTTP/1.1 requests between their head and the end
  // of their response; drain() waits for none to be left.
  size_t busy = 0;  // GUARDED_BY(conns_mu)
  std::condition_variable busy_cv;
  std::atomic<bool> draining{false};
  // Streaming routes' request bodies held now, in all and by share
  // (StreamHooks::body_budget, share_budget).
  std::mutex body_mu;
  size_t stream_body_bytes = 0;                     // GUARDED_BY(body_mu)
  std::map<std::string, size_t> share_body_bytes;  // GUARDED_BY(body_mu)
  asio::io_context ioc;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work;
  asio::thread_pool workers;
  // On its own strand: the accept loop, drain() and stop() use it from
  // different io threads, and an Asio acceptor is not safe for concurrent
  // use (two closes at once crashed in the reactor).
  tcp::acceptor acceptor;
  std::vector<std::thread> io_threads;
  std::atomic<bool> stopping{false};
  uint16_t bound_port = 0;

  using LocalStream = beast::basic_stream<asio::local::stream_protocol>;
  std::unique_ptr<asio::ssl::context> tls;  // set when serving TLS
  size_t max_connections = 0;                 // resolved at start()
  size_t max_per_address = 0;
  // Rate-limited logging of repeated accept failures and refusals.
  uint64_t accept_log_ns = 0;  // accept loop only
  uint64_t accept_failures = 0;
  uint64_t refusal_log_ns = 0;
  uint64_t refusals = 0;

  Impl(ServerConfig c, Handler h, ProxyHooks p, StreamHooks st)
      : cfg(std::move(c)), handler(std::move(h)), proxy_hooks(std::move(p)), stream_hooks(std::move(st)),
        workers(static_cast<size_t>(std::max(1, cfg.worker_threads))), acceptor(asio::make_strand(ioc)) {}

  asio::awaitable<void> accept_loop();
  // addr: the source address, counted in per_address until the session ends.
  asio::awaitable<void> session(tcp::socket sock, std::string addr);
  // Serves requests on one connection (plain or TLS) until it closes.
  // bound_sandbox: set for connections adopted from a sandbox's channel.
  template <class Stream>
  asio::awaitable<void> serve(Stream& stream, const std::string& remote, const std::string& bound_sandbox = {});
  asio::awaitable<void> local_session(asio::local::stream_protocol::socket sock, std::string sandbox_id);
  // Reads the body of a streaming route and runs its handler; returns
  // whether the connection may carry another request.
  template <class Stream>
  // plain_head: the head already converted (remote and bound_sandbox set).
  asio::awaitable<bool> serve_stream(Stream& stream, beast::flat_buffer& buf,
                                     bhttp::request_parser<bhttp::empty_body>&& head, HttpRequest plain_head);
  asio::awaitable<HttpResponse> dispatch(HttpRequest req);
  // Relays one request to a sandbox; returns whether the client connection
  // may carry another request.
  template <class Stream>
  asio::awaitable<void> tunnel(Stream& client, beast::flat_buffer& cbuf, const HttpRequest& head);
  template <class Stream>
  asio::awaitable<bool> proxy(Stream& client, beast::flat_buffer& cbuf,
                              bhttp::request_parser<bhttp::empty_body>&& head, const HttpRequest& plain_head,
                              ProxyTarget target);
};

namespace {

uint64_t sys_now_ns() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}

template <class Body>
HttpRequest head_of(const bhttp::request<Body>& r, const std::string& remote) {
  HttpRequest out;
  out.method = std::string(r.method_string());
  out.target = std::string(r.target());
  size_t q = out.target.find('?');
  out.path = out.target.substr(0, q);
  if (q != std::string::npos) out.query = out.target.substr(q + 1);
  for (const auto& f : r) {
    std::string name(f.name_string());
    for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    auto [it, fresh] = out.headers.try_emplace(name, std::string(f.value()));
    if (!fresh) {
      it->second += ", ";
      it->second += std::string(f.value());
    }
  }
  out.remote = remote;
  return out;
}

HttpRequest to_plain(bhttp::request<bhttp::string_body>&& r, const std::string& remote) {
  HttpRequest out = head_of(r, remote);
  out.body = std::move(r.body());
  return out;
}

bool expects_continue(const bhttp::fields& f) {
  auto it = f.find(bhttp::field::expect);
  return it != f.end() && beast::iequals(it->value(), "100-continue");
}

bhttp::response<bhttp::string_body> to_beast(HttpResponse&& r, unsigned version, bool keep_alive) {
  bhttp::response<bhttp::string_body> res;
  res.version(version);
  res.result(static_cast<unsigned>(r.status));
  res.set(bhttp::field::server, "sandgate");
  for (auto& [k, v] : r.headers) res.set(k, v);
  if (!r.content_type.empty()) res.set(bhttp::field::content_type, r.content_type);
  res.body() = std::move(r.body);
  res.keep_alive(keep_alive);
  res.prepare_payload();
  return res;
}

// After an answer sent before the request body was read whole: stop
// sending, then read and drop what the client still sends (bounded: 64
// MiB or 5 s), so closing does not reset the connection and destroy the
// answer in the client's receive buffer before it is read.
template <class Stream>
asio::awaitable<void> linger_close(Stream& s) {
  auto& low = beast::get_lowest_layer(s);
  boost::system::error_code ec;
  low.socket().shutdown(asio::socket_base::shutdown_send, ec);
  std::array<char, 16 * 1024> sink;
  size_t drained = 0;
  low.expires_after(std::chrono::seconds(5));
  while (drained < (64u << 20)) {
    size_t n = co_await low.async_read_some(asio::buffer(sink), asio::redirect_error(asio::use_awaitable, ec));
    if (ec || n == 0) break;
    drained += n;
  }
}

// ResponseWriter over one HTTP/1.1 client connection.
template <class Stream>
class StreamWriter final : public ResponseWriter {
 public:
  StreamWriter(Stream& s, unsigned version, bool keep_alive, std::chrono::milliseconds write_timeout)
      : s_(s), version_(version), keep_alive_(keep_alive), write_timeout_(write_timeout) {}
  ~StreamWriter() override { unwatch_closed(); }

  asio::awaitable<bool> write_head(int status, const std::vector<std::pair<std::string, std::string>>& headers,
                                   std::optional<uint64_t> content_length) override {
    unwatch_closed();
    if (sr_ || failed_) co_return false;
    res_.version(version_);
    res_.result(static_cast<unsigned>(status));
    res_.set(bhttp::field::server, "sandgate");
    for (const auto& [k, v] : headers) res_.insert(k, v);
    if (content_length)
      res_.content_length(*content_length);
    else if (version_ >= 11)
      res_.chunked(true);
    else
      keep_alive_ = false;  // HTTP/1.0 has no chunked coding (RFC 9112 6.1): the body ends at the close
    res_.keep_alive(keep_alive_);
    res_.body().data = nullptr;
    res_.body().size = 0;
    res_.body().more = true;
    sr_.emplace(res_);
    boost::system::error_code ec;
    arm();
    co_await bhttp::async_write_header(s_, *sr_, asio::redirect_error(asio::use_awaitable, ec));
    co_return ok(ec);
  }

  asio::awaitable<bool> write_body(std::string_view bytes) override {
    if (!sr_ || failed_) co_return false;
    if (bytes.empty()) co_return true;  // an empty chunk would end the body
    res_.body().data = const_cast<char*>(bytes.data());
    res_.body().size = bytes.size();
    res_.body().more = true;
    boost::system::error_code ec;
    arm();
    // Writes the piece, then stops asking for the next one (need_buffer).
    co_await bhttp::async_write(s_, *sr_, asio::redirect_error(asio::use_awaitable, ec));
    if (ec == bhttp::error::need_buffer) ec = {};
    res_.body().data = nullptr;
    res_.body().size = 0;
    co_return ok(ec);
  }

  asio::awaitable<bool> finish() override {
    if (!sr_ || failed_) co_return false;
    res_.body().data = nullptr;
    res_.body().size = 0;
    res_.body().more = false;
    boost::system::error_code ec;
    arm();
    co_await bhttp::async_write(s_, *sr_, asio::redirect_error(asio::use_awaitable, ec));
    if (ec == bhttp::error::need_buffer) ec = {};
    finished_ = !ec;
    co_return ok(ec);
  }

  asio::awaitable<bool> respond(HttpResponse r) override {
    unwatch_closed();
    if (sr_ || responded_ || failed_) co_return false;
    responded_ = true;
    auto res = to_beast(std::move(r), version_, keep_alive_);
    keep_alive_ = res.keep_alive();
    boost::system::error_code ec;
    arm();
    co_await bhttp::async_write(s_, res, asio::redirect_error(asio::use_awaitable, ec));
    finished_ = !ec;
    co_return ok(ec);
  }

  void watch_closed(std::function<void()> on_gone) override {
    unwatch_closed();
    watch_ = std::make_shared<Watch>();
    watch_->on_gone = std::move(on_gone);
    auto& sock = beast::get_lowest_layer(s_).socket();
    watch_->fd = sock.native_handle();
    sock.async_wait(asio::socket_base::wait_read, [w = watch_](const boost::system::error_code& ec) {
      if (ec || w->cancelled) return;  // the socket may be gone: touch nothing but w
      char c;
      ssize_t n = ::recv(w->fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
      bool gone = n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
      if (gone && w->on_gone) w->on_gone();
    });
  }

  void unwatch_closed() override {
    if (!watch_) return;
    watch_->cancelled = true;
    boost::system::error_code ignored;
    beast::get_lowest_layer(s_).socket().cancel(ignored);
    watch_.reset();
  }

  bool reusable() const override { return keep_alive_ && finished_ && !failed_; }

 private:
  struct Watch {
    bool cancelled = false;
    int fd = -1;
    std::function<void()> on_gone;
  };
  void arm() { beast::get_lowest_layer(s_).expires_after(write_timeout_); }
  bool ok(const boost::system::error_code& ec) {
    if (ec) failed_ = true;
    return !ec;
  }

  Stream& s_;
  unsigned version_;
  bool keep_alive_;
  std::chrono::milliseconds write_timeout_;
  bhttp::response<bhttp::buffer_body> res_;
  std::optional<bhttp::serializer<false, bhttp::buffer_body>> sr_;
  bool responded_ = false;
  bool finished_ = false;
  bool failed_ = false;
  std::shared_ptr<Watch> watch_;
};

}  // namespace

asio::awaitable<HttpResponse> HttpServer::Impl::dispatch(HttpRequest req) {
  auto conn_exec = co_await asio::this_coro::executor;
  // Hop to the worker pool: the handler may block on SQLite or the runtime.
  co_await asio::post(workers.get_executor(), asio::use_awaitable);
  HttpResponse res;
  try {
    res = handler(req);
  } catch (const std::exception& e) {
    LOG_ERROR("handler " << req.method << " " << req.path << " threw: " << e.what());
    res = json_error(500, "internal error");
  }
  co_await asio::post(conn_exec, asio::use_awaitable);
  co_return res;
}

// A CONNECT from another cluster node (ProxyHooks::tunnel): once the hook
// has a stream to the sandbox port, the connection is a byte pipe both
// ways; what crosses it is the entry node's relayed HTTP.
template <class Stream>
asio::awaitable<void> HttpServer::Impl::tunnel(Stream& client, beast::flat_buffer& cbuf, const HttpRequest& head) {
  auto& tcp_layer = beast::get_lowest_layer(client);
  auto conn_exec = co_await asio::this_coro::executor;
  co_await asio::post(workers.get_executor(), asio::use_awaitable);
  Result<UniqueFd> fd = internal_error("no tunnel hook");
  try {
    fd = proxy_hooks.tunnel(head);
  } catch (const std::exception& e) {
    fd = internal_error(e.what());
  }
  co_await asio::post(conn_exec, asio::use_awaitable);
  boost::system::error_code ec;
  if (!fd) {
    int status = 502;
    switch (fd.error().kind()) {
      case ErrorKind::kUnauthorized: status = 401; break;
      case ErrorKind::kNotFound: status = 404; break;
      case ErrorKind::kInvalid: status = 400; break;
      case ErrorKind::kUnavailable: status = 503; break;
      default: break;
    }
    auto res = to_beast(json_error(status, fd.error().message()), 11, false);
    tcp_layer.expires_after(cfg.read_timeout);
    co_await bhttp::async_write(client, res, asio::redirect_error(asio::use_awaitable, ec));
    if (!ec) co_await linger_close(client);
    co_return;
  }
  asio::local::stream_protocol::socket up(conn_exec);
  up.assign(asio::local::stream_protocol(), fd->release(), ec);
  if (ec) co_return;
  static constexpr std::string_view kEstablished = "HTTP/1.1 200 Connection established\r\n\r\n";
  tcp_layer.expires_after(cfg.read_timeout);
  co_await asio::async_write(client, asio::buffer(kEstablished.data(), kEstablished.size()),
                             asio::redirect_error(asio::use_awaitable, ec));
  if (ec) co_return;
  tcp_layer.expires_never();
  beast::flat_buffer ubuf;
  using namespace asio::experimental::awaitable_operators;
  co_await (relay::pump(client, up, cbuf) && relay::pump(up, client, ubuf));
}

template <class Stream>
asio::awaitable<bool> HttpServer::Impl::proxy(Stream& client, beast::flat_buffer& cbuf,
                                              bhttp::request_parser<bhttp::empty_body>&& head,
                                              const HttpRequest& plain_head, ProxyTarget target) {
  auto& tcp_layer = beast::get_lowest_layer(client);
  using namespace asio::experimental::awaitable_operators;
  auto conn_exec = co_await asio::this_coro::executor;
  boost::system::error_code ec;
  bool client_keep_alive = head.get().keep_alive();
  unsigned version = head.get().version();
  auto answer = [&](HttpResponse r) -> asio::awaitable<bool> {
    // The request body (if any) was not read: the connection cannot go on,
    // and closes lingering, so the answer is not lost to a reset.
    auto res = to_beast(std::move(r), version, false);
    tcp_layer.expires_after(cfg.read_timeout);
    boost::system::error_code wec;
    co_await bhttp::async_write(client, res, asio::redirect_error(asio::use_awaitable, wec));
    if (!wec) co_await linger_close(client);
    co_return false;
  };

  // Connect on a worker: it may resume a paused sandbox first.
  co_await asio::post(workers.get_executor(), asio::use_awaitable);
  Result<UniqueFd> fd = internal_error("no proxy connector");
  try {
    if (proxy_hooks.connect) fd = proxy_hooks.connect(target, plain_head);
  } catch (const std::exception& e) {
    fd = internal_error(e.what());
  }
  co_await asio::post(conn_exec, asio::use_awaitable);
  if (!fd) {
    if (fd.error().kind() == ErrorKind::kUnauthorized) co_return co_await answer(json_error(401, fd.error().message()));
    if (fd.error().kind() == ErrorKind::kNotFound) co_return co_await answer(sandbox_unavailable(target.sandbox_id, "The sandbox was not found"));
    co_return co_await answer(sandbox_unavailable(target.sandbox_id, client_message(fd.error())));
  }
  asio::local::stream_protocol::socket up(conn_exec);
  up.assign(asio::local::stream_protocol(), fd->release(), ec);
  if (ec) co_return co_await answer(sandbox_unavailable(target.sandbox_id, "stream setup: " + ec.message()));

  // Request: head, then the body streamed through one buffer.
  if (expects_continue(head.get())) {
    head.get().erase(bhttp::field::expect);
    bhttp::response<bhttp::empty_body> cont{bhttp::status::continue_, version};
    co_await bhttp::async_write(client, cont, asio::redirect_error(asio::use_awaitable, ec));
    if (ec) co_return false;
  }
  bhttp::request_parser<bhttp::buffer_body> rp(std::move(head));
  rp.body_limit(boost::none);
  auto& req = rp.get();
  bool upgrade = req.find(bhttp::field::upgrade) != req.end();
  // One channel stream per request: the sandbox side closes after answering.
  if (!upgrade) req.keep_alive(false);
  bhttp::serializer<true, bhttp::buffer_body> sr(req);
  co_await bhttp::async_write_header(up, sr, asio::redirect_error(asio::use_awaitable, ec));
  if (ec) co_return co_await answer(port_unanswered(target));  // refused before the request went in
  bool up_failed = false;
  ec = co_await relay::relay_body(client, cbuf, rp, sr, up, [&] { tcp_layer.expires_after(cfg.read_timeout); }, [] {},
                                  &up_failed);
  // The sandbox stopped reading the body: it may have answered early
  // (envd's 507 for a full disk, 413): that answer is relayed below, and
  // the connection then closed, since the rest of the body was not read.
  bool answered_early = false;
  if (ec) {
    LOG_DEBUG("relay request body to sandbox " << target.sandbox_id << ": " << ec.message());
    if (!up_failed) co_return false;
    answered_early = true;
  }

  // Response: head, then the body, each piece written as it arrives.
  beast::flat_buffer ubuf;
  bhttp::response_parser<bhttp::buffer_body> resp;
  resp.body_limit(boost::none);
  resp.header_limit(64 * 1024);
  // A response to HEAD announces a length but carries no body.
  if (req.method() == bhttp::verb::head) resp.skip(true);
  co_await bhttp::async_read_header(up, ubuf, resp, asio::redirect_error(asio::use_awaitable, ec));
  if (ec)
    co_return co_await answer(port_unanswered(target));
  auto& res = resp.get();
  if (upgrade && res.result() == bhttp::status::switching_protocols) {
    bhttp::serializer<false, bhttp::buffer_body> rs(res);
    tcp_layer.expires_after(cfg.read_timeout);
    co_await bhttp::async_write_header(client, rs, asio::redirect_error(asio::use_awaitable, ec));
    if (ec) co_return false;
    tcp_layer.expires_never();
    co_await (relay::pump(client, up, cbuf) && relay::pump(up, client, ubuf));
    co_return false;
  }
  unsigned code = res.result_int();
  bool framed = res.has_content_length() || res.chunked() || code / 100 == 1 || code == 204 || code == 304 ||
                req.method() == bhttp::verb::head;
  bool keep = client_keep_alive && framed && !stopping && !draining && !answered_early;
  res.keep_alive(keep);
  bhttp::serializer<false, bhttp::buffer_body> rs(res);
  // A client that goes away while the response is quiet (a watch stream
  // with no events) is noticed at once: its stream into the sandbox is
  // closed, so envd ends the call and frees what it held. Readable data
  // (a pipelined request, a TLS alert) just ends the watch.
  struct Gone {
    bool done = false;
  };
  auto gone = std::make_shared<Gone>();
  int client_fd = tcp_layer.socket().native_handle();
  tcp_layer.socket().async_wait(asio::socket_base::wait_read,
                                [gone, client_fd, &up](const boost::system::error_code& wec) {
                                  if (wec || gone->done) return;  // up may be gone: touch nothing else
                                  char c;
                                  ssize_t n = ::recv(client_fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
                                  if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
                                    boost::system::error_code ignored;
                                    up.shutdown(asio::socket_base::shutdown_both, ignored);
                                  }
                                });
  // The head goes out at once: a stream whose first body bytes come late
  // (an execution that prints nothing yet, server-sent events) is already
  // answered, so the client's wait for the response head ends.
  tcp_layer.expires_after(cfg.stalled_write_timeout);
  co_await bhttp::async_write_header(client, rs, asio::redirect_error(asio::use_awaitable, ec));
  if (!ec)
    ec = co_await relay::relay_body(up, ubuf, resp, rs, client, [] {},
                                    [&] { tcp_layer.expires_after(cfg.stalled_write_timeout); });
  gone->done = true;
  {
    boost::system::error_code ignored;
    tcp_layer.socket().cancel(ignored);  // the wait above, if still pending
  }
  if (ec) {
    LOG_DEBUG("relay response from sandbox " << target.sandbox_id << ": " << ec.message());
    co_return false;
  }
  if (answered_early) co_await linger_close(client);
  co_return keep;
}

template <class Stream>
asio::awaitable<bool> HttpServer::Impl::serve_stream(Stream& stream, beast::flat_buffer& buf,
                                                     bhttp::request_parser<bhttp::empty_body>&& head,
                                                     HttpRequest plain_head) {
  boost::system::error_code ec;
  auto conn_exec = co_await asio::this_coro::executor;
  const std::string& remote = plain_head.remote;
  const std::string bound_sandbox = plain_head.bound_sandbox;
  unsigned head_version = head.get().version();
  auto refuse = [&](int status, const std::string& msg) -> asio::awaitable<bool> {
    HttpResponse r = stream_hooks.error ? stream_hooks.error(plain_head, status, msg) : json_error(status, msg);
    auto res = to_beast(std::move(r), head_version, false);
    beast::get_lowest_layer(stream).expires_after(cfg.read_timeout);
    boost::system::error_code wec;
    co_await bhttp::async_write(stream, res, asio::redirect_error(asio::use_awaitable, wec));
    co_return false;
  };
  if (auto len = head.content_length(); len && *len > stream_hooks.body_limit)
    co_return co_await refuse(413, "request body larger than the limit of " + std::to_string(stream_hooks.body_limit) + " bytes");
  if (stream_hooks.precheck) {
    if (std::optional<HttpResponse> early = stream_hooks.precheck(plain_head)) {
      auto res = to_beast(std::move(*early), head_version, false);
      beast::get_lowest_layer(stream).expires_after(cfg.read_timeout);
      boost::system::error_code wec;
      co_await bhttp::async_write(stream, res, asio::redirect_error(asio::use_awaitable, wec));
      co_return false;
    }
  }
  // Who is calling, before a byte of the body is read or charged: the
  // budget is never held for strangers.
  Authorized who;
  if (stream_hooks.authorize) {
    co_await asio::post(workers.get_executor(), asio::use_awaitable);
    try {
      who = stream_hooks.authorize(plain_head);
    } catch (const std::exception& e) {
      LOG_ERROR("authorize " << plain_head.method << " " << plain_head.path << " threw: " << e.what());
      who.refusal = json_error(500, "internal error");
    }
    co_await asio::post(conn_exec, asio::use_awaitable);
    if (who.refusal) {
      auto res = to_beast(std::move(*who.refusal), head_version, false);
      beast::get_lowest_layer(stream).expires_after(cfg.read_timeout);
      boost::system::error_code wec;
      co_await bhttp::async_write(stream, res, asio::redirect_error(asio::use_awaitable, wec));
      co_return false;
    }
  }
  // The body's bytes are charged as they arrive (in all and to the
  // caller's share) and given back when the request ends.
  struct Charge {
    Impl& m;
    std::string share;
    size_t held = 0;
    bool grow(size_t n) {
      std::lock_guard<std::mutex> g(m.body_mu);
      size_t& mine = m.share_body_bytes[share];
      if (m.stream_body_bytes + n > m.stream_hooks.body_budget || mine + n > m.stream_hooks.share_budget) {
        if (mine == 0) m.share_body_bytes.erase(share);
        return false;
      }
      m.stream_body_bytes += n;
      mine += n;
      held += n;
      return true;
    }
    ~Charge() {
      if (held == 0) return;
      std::lock_guard<std::mutex> g(m.body_mu);
      m.stream_body_bytes -= held;
      auto it = m.share_body_bytes.find(share);
      if (it != m.share_body_bytes.end() && (it->second -= held) == 0) m.share_body_bytes.erase(it);
    }
  } charge{*this, who.share};
  if (expects_continue(head.get())) {
    bhttp::response<bhttp::empty_body> cont{bhttp::status::continue_, head_version};
    co_await bhttp::async_write(stream, cont, asio::redirect_error(asio::use_awaitable, ec));
    if (ec) co_return false;
  }
  // Read through a fixed buffer and append, so memory follows the bytes
  // received, not what Content-Length announces.
  bhttp::request_parser<bhttp::buffer_body> parser(std::move(head));
  parser.body_limit(stream_hooks.body_limit);
  std::string body;
  std::array<char, 64 * 1024> piece;
  while (!parser.is_done()) {
    parser.get().body().data = piece.data();
    parser.get().body().size = piece.size();
    beast::get_lowest_layer(stream).expires_after(cfg.read_timeout);
    co_await bhttp::async_read_some(stream, buf, parser, asio::redirect_error(asio::use_awaitable, ec));
    if (ec == bhttp::error::need_buffer) ec = {};
    if (ec) {
      if (ec == bhttp::error::body_limit)
        co_return co_await refuse(413, "request body larger than the limit of " + std::to_string(stream_hooks.body_limit) + " bytes");
      if (ec == bhttp::error::end_of_stream || ec == asio::error::eof || ec == beast::error::timeout ||
          ec == asio::error::connection_reset || ec == asio::error::operation_aborted)
        co_return false;
      co_return co_await refuse(400, "malformed HTTP request: " + ec.message());
    }
    size_t n = piece.size() - parser.get().body().size;
    if (n == 0) continue;
    if (body.size() + n > stream_hooks.body_limit)
      co_return co_await refuse(413, "request body larger than the limit of " + std::to_string(stream_hooks.body_limit) + " bytes");
    if (!charge.grow(n))
      co_return co_await refuse(503, "the gateway is holding too many request bodies; retry shortly");
    body.append(piece.data(), n);
  }
  bool keep_alive = parser.get().keep_alive() && !stopping && !draining;
  unsigned version = parser.get().version();
  HttpRequest req = head_of(parser.get(), remote);
  req.body = std::move(body);
  req.bound_sandbox = bound_sandbox;
  beast::get_lowest_layer(stream).expires_never();
  StreamWriter<Stream> out(stream, version, keep_alive, cfg.stalled_write_timeout);
  try {
    co_await stream_hooks.serve(std::move(req), out);
  } catch (const std::exception& e) {
    LOG_ERROR("stream handler " << plain_head.method << " " << plain_head.path << " threw: " << e.what());
    co_return false;
  }
  co_return out.reusable() && !stopping;
}

template <class Stream>
asio::awaitable<void> HttpServer::Impl::serve(Stream& stream, const std::string& remote, const std::string& bound_sandbox) {
  beast::flat_buffer buf(cfg.header_limit + 1024);
  try {
    for (;;) {
      boost::system::error_code ec;
      // An answer before the body was read; the connection then closes
      // lingering (a reset would destroy the answer in flight).
      auto fail = [&](int status, const std::string& msg) -> asio::awaitable<void> {
        auto res = to_beast(json_error(status, msg), 11, false);
        beast::get_lowest_layer(stream).expires_after(cfg.read_timeout);
        boost::system::error_code wec;
        co_await bhttp::async_write(stream, res, asio::redirect_error(asio::use_awaitable, wec));
        if (!wec) co_await linger_close(stream);
      };
      auto read_failed = [&](const boost::system::error_code& e) {
        return e == bhttp::error::end_of_stream || e == asio::error::eof || e == beast::error::timeout ||
               e == asio::error::operation_aborted || e == asio::error::connection_reset;
      };
      // The head first: it decides between the control plane (bounded
      // body, read whole) and a sandbox (streamed body).
      bhttp::request_parser<bhttp::empty_body> head;
      head.header_limit(static_cast<uint32_t>(cfg.header_limit));
      // Bodies are bounded per route below (the proxy streams any size).
      head.body_limit(boost::none);
      // Draining (an upgrade's stop): no next request on this connection.
      if (draining) break;
      beast::get_lowest_layer(stream).expires_after(cfg.read_timeout);
      co_await bhttp::async_read_header(stream, buf, head, asio::redirect_error(asio::use_awaitable, ec));
      // From its head to the end of its response a request is in
      // progress: a drain waits for it. (The guard goes with the frame,
      // before ioc, when a connection is still open at the stop.)
      struct InProgress {
        Impl& m;
        explicit InProgress(Impl& im) : m(im) {
          std::lock_guard<std::mutex> g(m.conns_mu);
          ++m.busy;
        }
        ~InProgress() {
          {
            std::lock_guard<std::mutex> g(m.conns_mu);
            --m.busy;
          }
          m.busy_cv.notify_all();
        }
        InProgress(const InProgress&) = delete;
        InProgress& operator=(const InProgress&) = delete;
      };
      std::optional<InProgress> in_progress;
      if (!ec) in_progress.emplace(*this);
      if (ec) {
        if (read_failed(ec)) break;
        if (ec == bhttp::error::header_limit)
          co_await fail(431, "request headers larger than the limit of " + std::to_string(cfg.header_limit) + " bytes");
        else
          co_await fail(400, "malformed HTTP request: " + ec.message());
        break;
      }
      // The head as handlers see it, converted once for every hook below.
      HttpRequest h = head_of(head.get(), remote);
      h.bound_sandbox = bound_sandbox;
      // Framing Beast leaves to its caller (RFC 9112 6): refused before
      // any body byte is read, and the connection closed, for every kind
      // of route alike.
      if (std::string why = framing_error(h, head.get().version()); !why.empty()) {
        co_await fail(400, "malformed HTTP request: " + why);
        break;
      }
      if (stream_hooks.owns && stream_hooks.serve && stream_hooks.owns(h)) {
        if (!co_await serve_stream(stream, buf, std::move(head), std::move(h)) || stopping) break;
        continue;
      }
      if (!bound_sandbox.empty()) {
        // A sandbox's own connection reaches gateway services only.
        co_await fail(404, "no route for " + std::string(head.get().method_string()) + " " +
                               std::string(head.get().target().substr(0, 200)) +
                               " on the in-sandbox gateway address (only the model API is served here)");
        break;
      }
      if (h.method == "CONNECT") {
        if (!proxy_hooks.tunnel) co_await fail(405, "method CONNECT not allowed here");
        else co_await tunnel(stream, buf, h);
        break;
      }
      if (proxy_hooks.route) {
        Result<std::optional<ProxyTarget>> target = proxy_hooks.route(h);
        if (!target) {
          co_await fail(400, target.error().message());
          break;
        }
        if (*target) {
          if (!co_await proxy(stream, buf, std::move(head), h, **target) || stopping) break;
          continue;
        }
      }
      if (expects_continue(head.get())) {
        bhttp::response<bhttp::empty_body> cont{bhttp::status::continue_, head.get().version()};
        co_await bhttp::async_write(stream, cont, asio::redirect_error(asio::use_awaitable, ec));
        if (ec) break;
      }
      size_t limit = cfg.body_limit;
      if (cfg.body_limit_for)
        if (size_t l = cfg.body_limit_for(h); l > 0) limit = l;
      if (auto len = head.content_length(); len && *len > limit) {
        co_await fail(413, "request body larger than the limit of " + std::to_string(limit) + " bytes");
        break;
      }
      bhttp::request_parser<bhttp::string_body> parser(std::move(head));
      parser.body_limit(limit);
      beast::get_lowest_layer(stream).expires_after(cfg.read_timeout);
      co_await bhttp::async_read(stream, buf, parser, asio::redirect_error(asio::use_awaitable, ec));
      if (ec) {
        if (read_failed(ec)) break;
        if (ec == bhttp::error::body_limit)
          co_await fail(413, "request body larger than the limit of " + std::to_string(limit) + " bytes");
        else
          co_await fail(400, "malformed HTTP request: " + ec.message());
        break;
      }
      auto breq = parser.release();
      bool keep_alive = breq.keep_alive();
      unsigned version = breq.version();
      HttpResponse res = co_await dispatch(to_plain(std::move(breq), remote));
      auto bres = to_beast(std::move(res), version, keep_alive && !stopping && !draining);
      beast::get_lowest_layer(stream).expires_after(cfg.read_timeout);
      co_await bhttp::async_write(stream, bres, asio::redirect_error(asio::use_awaitable, ec));
      if (ec || !bres.keep_alive()) break;
    }
  } catch (const std::exception& e) {
    LOG_WARN("connection " << remote << ": " << e.what());
  }
}

asio::awaitable<void> HttpServer::Impl::session(tcp::socket sock, std::string addr) {
  struct Uncount {
    Impl& m;
    std::string addr;
    ~Uncount() {
      std::lock_guard<std::mutex> g(m.conns_mu);
      --m.tcp_open;
      auto it = m.per_address.find(addr);
      if (it != m.per_address.end() && --it->second == 0) m.per_address.erase(it);
    }
  } uncount{*this, std::move(addr)};
  std::string remote;
  {
    boost::system::error_code ec;
    auto ep = sock.remote_endpoint(ec);
    if (!ec) remote = ep.address().to_string() + ":" + std::to_string(ep.port());
  }
  auto track = [this](beast::tcp_stream* s, bool add) {
    std::lock_guard<std::mutex> g(conns_mu);
    if (!add) {
      conns.erase(s);
      return true;
    }
    if (stopping) return false;
    conns.insert(s);
    return true;
  };
  if (tls) {
    beast::ssl_stream<beast::tcp_stream> stream(beast::tcp_stream(std::move(sock)), *tls);
    beast::tcp_stream* lowest = &beast::get_lowest_layer(stream);
    if (!track(lowest, true)) co_return;
    boost::system::error_code ec;
    lowest->expires_after(cfg.read_timeout);
    co_await stream.async_handshake(asio::ssl::stream_base::server, asio::redirect_error(asio::use_awaitable, ec));
    if (ec) {
      LOG_DEBUG("TLS handshake with " << remote << ": " << ec.message());
    } else {
      const unsigned char* proto = nullptr;
      unsigned proto_len = 0;
      SSL_get0_alpn_selected(stream.native_handle(), &proto, &proto_len);
      // SAFETY: OpenSSL returns proto_len bytes at proto (or none).
      if (proto_len == 2 && std::memcmp(proto, "h2", 2) == 0)
        co_await serve_h2(stream, remote, H2Deps{cfg, handler, proxy_hooks, stream_hooks, workers});
      else
        co_await serve(stream, remote);
      lowest->expires_after(std::chrono::seconds(2));
      co_await stream.async_shutdown(asio::redirect_error(asio::use_awaitable, ec));
    }
    lowest->close();
    track(lowest, false);
    co_return;
  }
  beast::tcp_stream stream(std::move(sock));
  if (!track(&stream, true)) co_return;
  co_await serve(stream, remote);
  boost::system::error_code ignored;
  stream.socket().shutdown(tcp::socket::shutdown_both, ignored);
  stream.close();
  track(&stream, false);
}

asio::awaitable<void> HttpServer::Impl::local_session(asio::local::stream_protocol::socket sock, std::string sandbox_id) {
  LocalStream stream(std::move(sock));
  {
    std::lock_guard<std::mutex> g(conns_mu);
    if (stopping) co_return;
    local_conns.insert(&stream);
  }
  co_await serve(stream, "sandbox " + sandbox_id, sandbox_id);
  boost::system::error_code ignored;
  stream.socket().shutdown(asio::socket_base::shutdown_both, ignored);
  stream.close();
  std::lock_guard<std::mutex> g(conns_mu);
  local_conns.erase(&stream);
}

asio::awaitable<void> HttpServer::Impl::accept_loop() {
  std::chrono::milliseconds backoff{0};
  asio::steady_timer pause(co_await asio::this_coro::executor);
  for (;;) {
    boost::system::error_code ec;
    tcp::socket sock(asio::make_strand(ioc));
    co_await acceptor.async_accept(sock, asio::redirect_error(asio::use_awaitable, ec));
    if (ec) {
      if (stopping || draining || ec == asio::error::operation_aborted) co_return;
      // Out of descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM), or
      // a transient error: retrying at once only spins. Back off, doubling
      // up to a second, and log once a second at most.
      ++accept_failures;
      uint64_t now = sys_now_ns();
      if (now - accept_log_ns >= 1000000000ull) {
        LOG_WARN("accept: " << ec.message() << " (" << accept_failures << " failures since the last report; "
                            << "backing off " << std::max<int64_t>(10, backoff.count()) << " ms)");
        accept_log_ns = now;
        accept_failures = 0;
      }
      backoff = std::min<std::chrono::milliseconds>(std::chrono::milliseconds(1000),
                                                    std::max<std::chrono::milliseconds>(std::chrono::milliseconds(10), backoff * 2));
      pause.expires_after(backoff);
      co_await pause.async_wait(asio::redirect_error(asio::use_awaitable, ec));
      if (stopping) co_return;
      continue;
    }
    backoff = std::chrono::milliseconds(0);
    std::string addr;
    {
      auto ep = sock.remote_endpoint(ec);
      if (ec) continue;  // already gone
      addr = ep.address().to_string();
    }
    const char* refused = nullptr;
    {
      std::lock_guard<std::mutex> g(conns_mu);
      size_t& mine = per_address[addr];
      if (tcp_open >= max_connections)
        refused = "the server has too many open connections";
      else if (mine >= max_per_address)
        refused = "too many open connections from this address";
      if (refused) {
        if (mine == 0) per_address.erase(addr);
      } else {
        ++mine;
        ++tcp_open;
      }
    }
    if (refused) {
      // A best-effort answer without a coroutine or a buffer: a plain 503
      // that fits the socket's send buffer, then the close. A TLS client
      // just sees the close.
      if (!tls) {
        std::string body = std::string("{\"code\":503,\"message\":\"") + refused + "; retry later\"}";
        std::string res = "HTTP/1.1 503 Service Unavailable\r\nServer: sandgate\r\nContent-Type: application/json\r\n"
                          "Retry-After: 1\r\nConnection: close\r\nContent-Length: " + std::to_string(body.size()) +
                          "\r\n\r\n" + body;
        (void)::send(sock.native_handle(), res.data(), res.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      }
      sock.shutdown(tcp::socket::shutdown_both, ec);
      sock.close(ec);
      ++refusals;
      uint64_t now = sys_now_ns();
      if (now - refusal_log_ns >= 1000000000ull) {
        LOG_WARN("refused " << refusals << " connection(s) since the last report, the last from " << addr << ": "
                            << refused << " (limits " << max_connections << " in all, " << max_per_address
                            << " per address)");
        refusal_log_ns = now;
        refusals = 0;
      }
      continue;
    }
    // Responses are streamed in pieces (Connect envelopes): send each at once.
    sock.set_option(tcp::no_delay(true), ec);
    auto ex = sock.get_executor();
    asio::co_spawn(ex, session(std::move(sock), std::move(addr)), asio::detached);
  }
}

HttpServer::HttpServer(ServerConfig cfg, Handler handler, ProxyHooks proxy, StreamHooks streams)
    : impl_(std::make_unique<Impl>(std::move(cfg), std::move(handler), std::move(proxy), std::move(streams))) {}

Status HttpServer::adopt(UniqueFd fd, std::string sandbox_id) {
  Impl& m = *impl_;
  if (m.stopping) return Error(ErrorKind::kUnavailable, "the server is stopping");
  boost::system::error_code ec;
  asio::local::stream_protocol::socket sock(asio::make_strand(m.ioc));
  sock.assign(asio::local::stream_protocol(), fd.get(), ec);
  if (ec) return internal_error("adopt channel connection: " + ec.message());
  (void)fd.release();
  auto ex = sock.get_executor();
  asio::co_spawn(ex, m.local_session(std::move(sock), std::move(sandbox_id)), asio::detached);
  return Status::Ok();
}

HttpServer::~HttpServer() { stop(); }

namespace {

// ALPN: take h2 when offered, else http/1.1; otherwise proceed without ALPN.
int select_alpn(SSL*, const unsigned char** out, unsigned char* outlen, const unsigned char* in, unsigned inlen,
                void*) {
  static const unsigned char kH2[] = {2, 'h', '2'};
  static const unsigned char kHttp11[] = {8, 'h', 't', 't', 'p', '/', '1', '.', '1'};
  for (const unsigned char* want : {kH2, kHttp11}) {
    // SAFETY: OpenSSL gives inlen bytes at in, a list of length-prefixed names.
    for (unsigned i = 0; i < inlen;) {
      unsigned n = in[i];
      if (i + 1 + n > inlen) break;
      if (n == want[0] && std::memcmp(in + i, want, n + 1) == 0) {
        *out = in + i + 1;
        *outlen = static_cast<unsigned char>(n);
        return SSL_TLSEXT_ERR_OK;
      }
      i += 1 + n;
    }
  }
  return SSL_TLSEXT_ERR_NOACK;
}

}  // namespace

Status HttpServer::start() {
  Impl& m = *impl_;
  boost::system::error_code ec;
  if (!m.cfg.tls_cert_file.empty() || !m.cfg.tls_key_file.empty()) {
    if (m.cfg.tls_cert_file.empty() || m.cfg.tls_key_file.empty())
      return invalid_error("TLS needs both a certificate file and a key file");
    auto ctx = std::make_unique<asio::ssl::context>(asio::ssl::context::tls_server);
    ctx->set_options(asio::ssl::context::default_workarounds | asio::ssl::context::no_sslv2 |
                     asio::ssl::context::no_sslv3 | asio::ssl::context::no_tlsv1 | asio::ssl::context::no_tlsv1_1);
    ctx->use_certificate_chain_file(m.cfg.tls_cert_file, ec);
    if (ec) return invalid_error("TLS certificate " + m.cfg.tls_cert_file + ": " + ec.message());
    ctx->use_private_key_file(m.cfg.tls_key_file, asio::ssl::context::pem, ec);
    if (ec) return invalid_error("TLS key " + m.cfg.tls_key_file + ": " + ec.message());
    SSL_CTX_set_alpn_select_cb(ctx->native_handle(), select_alpn, nullptr);
    m.tls = std::move(ctx);
  }
  auto addr = asio::ip::make_address(m.cfg.address, ec);
  if (ec) return invalid_error("listen address '" + m.cfg.address + "': " + ec.message());
  tcp::endpoint ep(addr, m.cfg.port);
  m.acceptor.open(ep.protocol(), ec);
  if (!ec) m.acceptor.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) m.acceptor.bind(ep, ec);
  if (!ec) m.acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec)
    return internal_error("listen on " + m.cfg.address + ":" + std::to_string(m.cfg.port) + ": " + ec.message());
  m.bound_port = m.acceptor.local_endpoint().port();
  {
    rlimit rl{};
    size_t soft = ::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY ? rl.rlim_cur : 65536;
    size_t dflt = std::max<size_t>(16, std::min<size_t>(16384, soft / 2));
    m.max_connections = m.cfg.max_connections ? m.cfg.max_connections : dflt;
    m.max_per_address = m.cfg.max_connections_per_address ? m.cfg.max_connections_per_address
                                                          : std::max<size_t>(4, m.max_connections / 4);
  }
  m.work.emplace(m.ioc.get_executor());
  asio::co_spawn(m.acceptor.get_executor(), m.accept_loop(), asio::detached);
  for (int i = 0; i < std::max(1, m.cfg.io_threads); ++i) m.io_threads.emplace_back([&m] { m.ioc.run(); });
  return Status::Ok();
}

uint16_t HttpServer::port() const { return impl_->bound_port; }

bool HttpServer::drain(std::chrono::milliseconds timeout) {
  Impl& m = *impl_;
  if (m.stopping) return true;
  m.draining = true;
  asio::post(m.acceptor.get_executor(), [&m] {
    boost::system::error_code ec;
    m.acceptor.close(ec);
  });
  std::unique_lock<std::mutex> l(m.conns_mu);
  return m.busy_cv.wait_for(l, timeout, [&m] { return m.busy == 0; });
}

void HttpServer::stop() {
  Impl& m = *impl_;
  if (m.stopping.exchange(true)) return;
  asio::post(m.acceptor.get_executor(), [&m] {
    boost::system::error_code ec;
    m.acceptor.close(ec);
    // Each connection is closed on its own strand: its coroutine may be
    // using (or itself closing) the socket on another io thread right now,
    // and Asio sockets are not safe for concurrent use. A stream still
    // tracked when that runs is alive: a session untracks itself on its
    // strand before its stream goes, and nothing is tracked once stopping.
    std::lock_guard<std::mutex> g(m.conns_mu);
    for (beast::tcp_stream* s : m.conns)
      asio::post(s->get_executor(), [&m, s] {
        std::lock_guard<std::mutex> l(m.conns_mu);
        boost::system::error_code ignored;
        if (m.conns.count(s)) s->socket().close(ignored);
      });
    for (Impl::LocalStream* s : m.local_conns)
      asio::post(s->get_executor(), [&m, s] {
        std::lock_guard<std::mutex> l(m.conns_mu);
        boost::system::error_code ignored;
        if (m.local_conns.count(s)) s->socket().close(ignored);
      });
  });
  // Let running handlers finish (they may be mid-create), then abandon
  // whatever the io_context still has pending (idle keep-alive reads, timers).
  m.workers.join();
  m.work.reset();
  m.ioc.stop();
  for (auto& t : m.io_threads) t.join();
  m.io_threads.clear();
  // ioc.stop() may have abandoned closes posted above before they ran: with
  // no io thread left nothing else uses these sockets, so close them here
  // (their peers see the end now, not when the server is destroyed).
  std::lock_guard<std::mutex> g(m.conns_mu);
  boost::system::error_code ignored;
  for (beast::tcp_stream* s : m.conns) s->socket().close(ignored);
  for (Impl::LocalStream* s : m.local_conns) s->socket().close(ignored);
}

void HttpServer::schedule(std::chrono::milliseconds delay, std::function<void()> fn) {
  Impl& m = *impl_;
  if (m.stopping) return;
  auto timer = std::make_shared<asio::steady_timer>(m.ioc, delay);
  timer->async_wait([&m, timer, fn = std::move(fn)](const boost::system::error_code& ec) mutable {
    if (ec || m.stopping) return;
    asio::post(m.workers, std::move(fn));
  });
}

}  // namespace sg::http
