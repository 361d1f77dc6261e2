// HttpServer: the HTTP/1.1 listener (Boost.Beast on Asio coroutines), and
// HTTP/2 over TLS when ALPN selects h2 (h2_session.h).
//
// Threads: `io_threads` run the io_context and only parse and write; every
// request's handler runs on the worker pool (it may block on SQLite or the
// runtime) and its response is posted back to the connection. Beast types
// stay inside server.cpp; handlers see http::HttpRequest/HttpResponse.
//
// Hostile clients: headers are bounded (header_limit), bodies are bounded
// (body_limit, 413 beyond), and every read has a deadline (read_timeout);
// a client that stalls is disconnected. Exceptions never escape a
// connection.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "base/http/message.h"
#include "base/http/routing.h"
#include "base/http/stream_handler.h"
#include "base/fd.h"
#include "base/status.h"

namespace sg::http {

struct ServerConfig {
  std::string address = "127.0.0.1";
  uint16_t port = 0;  // 0: an ephemeral port
  int io_threads = 2;
  int worker_threads = 8;
  size_t header_limit = 16 * 1024;
  size_t body_limit = 1 << 20;
  // A larger limit for some routes (template file uploads), decided from
  // the head; 0 or unset: body_limit. HTTP/1.1 only (h2 keeps body_limit).
  std::function<size_t(const HttpRequest& head)> body_limit_for;
  std::chrono::milliseconds read_timeout{30000};
  // TLS: PEM certificate chain and key. Both empty: plain HTTP. ALPN
  // prefers h2 (served by h2_session.h), then http/1.1.
  std::string tls_cert_file;
  std::string tls_key_file;
  // A client that accepts no bytes of a relayed response for this long is
  // dropped (streams that are merely quiet are fine: only writes count).
  std::chrono::milliseconds stalled_write_timeout{300000};
  // Open client connections (TCP) in all and from one source address. A
  // connection past either is answered 503 (plain HTTP; TLS: closed) and
  // closed at once, so idle floods cannot use up the process's descriptors.
  // 0: the default, half the soft RLIMIT_NOFILE (at most 16384) in all
  // and a quarter of that per address.
  size_t max_connections = 0;
  size_t max_connections_per_address = 0;
};

using Handler = std::function<HttpResponse(HttpRequest&)>;

// Sandbox traffic (envd and user ports) is not handled here but relayed:
// route() looks at the request head on the io thread (cheap, pure) and
// names a target; connect() runs on a worker (it may resume a paused
// sandbox) and returns a connected stream to the target port. The request
// and response are then relayed with bounded buffers, streaming in both
// directions, WebSocket upgrades included.
struct ProxyHooks {
  std::function<Result<std::optional<ProxyTarget>>(const HttpRequest& head)> route;
  // head: the request (headers only), for the credentials a paused
  // sandbox must see before it is resumed. kUnauthorized is answered 401,
  // any other error as E2B's 502.
  std::function<Result<UniqueFd>(const ProxyTarget& target, const HttpRequest& head)> connect;
  // CONNECT requests (another cluster node's tunnel to a sandbox port,
  // docs/cluster.md): a connected stream, then the connection is a pipe
  // both ways. Errors answer kUnauthorized 401, kNotFound 404, kInvalid
  // 400, kUnavailable 503, others 502. Unset: CONNECT is 405.
  std::function<Result<UniqueFd>(const HttpRequest& head)> tunnel;
};

class HttpServer {
 public:
  HttpServer(ServerConfig cfg, Handler handler, ProxyHooks proxy = {}, StreamHooks streams = {});
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds and listens; starts io and worker threads.
  Status start();
  uint16_t port() const;
  // An upgrade's first step: stops accepting and lets each HTTP/1.1
  // request in progress (a create, a pause, a proxied command stream)
  // finish, its connection closing after the response; idle connections
  // are left to stop(). Returns once none is in progress (true) or after
  // timeout (false). HTTP/2 streams are not waited for. Then stop().
  bool drain(std::chrono::milliseconds timeout);
  // Stops accepting, closes connections, joins threads.
  void stop();

  // Serves HTTP/1.1 on a connected stream socket that came from a
  // sandbox's channel (a socketpair end): its requests carry
  // bound_sandbox = sandbox_id, and only StreamHooks routes are served on
  // it (anything else is 404; sandbox routing is never applied). Thread-safe,
  // does not block. kUnavailable once stopping.
  Status adopt(UniqueFd fd, std::string sandbox_id);

  // Runs fn on the worker pool after delay (for periodic jobs such as the
  // timeout sweep). Thread-safe.
  void schedule(std::chrono::milliseconds delay, std::function<void()> fn);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace sg::http
