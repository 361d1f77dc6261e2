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

#include <atomic>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "sys/log.h"

namespace sg::http {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using tcp = asio::ip::tcp;

struct HttpServer::Impl {
  ServerConfig cfg;
  Handler handler;
  asio::io_context ioc;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work;
  asio::thread_pool workers;
  tcp::acceptor acceptor;
  std::vector<std::thread> io_threads;
  std::atomic<bool> stopping{false};
  uint16_t bound_port = 0;

  std::mutex conns_mu;
  std::set<std::shared_ptr<beast::tcp_stream>> conns;  // GUARDED_BY(conns_mu): open connections, closed on stop

  Impl(ServerConfig c, Handler h)
      : cfg(std::move(c)), handler(std::move(h)), workers(static_cast<size_t>(std::max(1, cfg.worker_threads))),
        acceptor(ioc) {}

  asio::awaitable<void> accept_loop();
  asio::awaitable<void> session(tcp::socket sock);
  asio::awaitable<HttpResponse> dispatch(HttpRequest req);
};

namespace {

HttpRequest to_plain(bhttp::request<bhttp::string_body>&& r, const std::string& remote) {
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
  out.body = std::move(r.body());
  out.remote = remote;
  return out;
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

asio::awaitable<void> HttpServer::Impl::session(tcp::socket sock) {
  std::string remote;
  {
    boost::system::error_code ec;
    auto ep = sock.remote_endpoint(ec);
    if (!ec) remote = ep.address().to_string() + ":" + std::to_string(ep.port());
  }
  auto stream = std::make_shared<beast::tcp_stream>(std::move(sock));
  {
    std::lock_guard<std::mutex> g(conns_mu);
    if (stopping) co_return;
    conns.insert(stream);
  }
  beast::flat_buffer buf(cfg.header_limit + 1024);
  try {
    for (;;) {
      bhttp::request_parser<bhttp::string_body> parser;
      parser.header_limit(static_cast<uint32_t>(cfg.header_limit));
      parser.body_limit(cfg.body_limit);
      stream->expires_after(cfg.read_timeout);
      boost::system::error_code ec;
      co_await bhttp::async_read(*stream, buf, parser, asio::redirect_error(asio::use_awaitable, ec));
      if (ec) {
        if (ec == bhttp::error::end_of_stream || ec == asio::error::eof || ec == beast::error::timeout ||
            ec == asio::error::operation_aborted || ec == asio::error::connection_reset)
          break;
        int status = 400;
        std::string msg = "malformed HTTP request: " + ec.message();
        if (ec == bhttp::error::body_limit) {
          status = 413;
          msg = "request body larger than the limit of " + std::to_string(cfg.body_limit) + " bytes";
        } else if (ec == bhttp::error::header_limit) {
          status = 431;
          msg = "request headers larger than the limit of " + std::to_string(cfg.header_limit) + " bytes";
        }
        auto res = to_beast(json_error(status, msg), 11, false);
        stream->expires_after(cfg.read_timeout);
        co_await bhttp::async_write(*stream, res, asio::redirect_error(asio::use_awaitable, ec));
        break;
      }
      auto breq = parser.release();
      bool keep_alive = breq.keep_alive();
      unsigned version = breq.version();
      HttpResponse res = co_await dispatch(to_plain(std::move(breq), remote));
      auto bres = to_beast(std::move(res), version, keep_alive && !stopping);
      stream->expires_after(cfg.read_timeout);
      co_await bhttp::async_write(*stream, bres, asio::redirect_error(asio::use_awaitable, ec));
      if (ec || !bres.keep_alive()) break;
    }
  } catch (const std::exception& e) {
    LOG_WARN("connection " << remote << ": " << e.what());
  }
  boost::system::error_code ignored;
  stream->socket().shutdown(tcp::socket::shutdown_both, ignored);
  stream->close();
  std::lock_guard<std::mutex> g(conns_mu);
  conns.erase(stream);
}

asio::awaitable<void> HttpServer::Impl::accept_loop() {
  for (;;) {
    boost::system::error_code ec;
    tcp::socket sock(asio::make_strand(ioc));
    co_await acceptor.async_accept(sock, asio::redirect_error(asio::use_awaitable, ec));
    if (ec) {
      if (stopping || ec == asio::error::operation_aborted) co_return;
      LOG_WARN("accept: " << ec.message());
      continue;
    }
    auto ex = sock.get_executor();
    asio::co_spawn(ex, session(std::move(sock)), asio::detached);
  }
}

HttpServer::HttpServer(ServerConfig cfg, Handler handler) : impl_(std::make_unique<Impl>(std::move(cfg), std::move(handler))) {}

HttpServer::~HttpServer() { stop(); }

Status HttpServer::start() {
  Impl& m = *impl_;
  boost::system::error_code ec;
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
  m.work.emplace(m.ioc.get_executor());
  asio::co_spawn(m.ioc, m.accept_loop(), asio::detached);
  for (int i = 0; i < std::max(1, m.cfg.io_threads); ++i) m.io_threads.emplace_back([&m] { m.ioc.run(); });
  return Status::Ok();
}

uint16_t HttpServer::port() const { return impl_->bound_port; }

void HttpServer::stop() {
  Impl& m = *impl_;
  if (m.stopping.exchange(true)) return;
  asio::post(m.ioc, [&m] {
    boost::system::error_code ec;
    m.acceptor.close(ec);
    std::lock_guard<std::mutex> g(m.conns_mu);
    for (auto& s : m.conns) s->socket().close(ec);
  });
  // Let running handlers finish (they may be mid-create), then abandon
  // whatever the io_context still has pending (idle keep-alive reads, timers).
  m.workers.join();
  m.work.reset();
  m.ioc.stop();
  for (auto& t : m.io_threads) t.join();
  m.io_threads.clear();
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
