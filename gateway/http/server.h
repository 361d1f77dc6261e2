// HttpServer: the HTTP/1.1 listener (Boost.Beast on Asio coroutines).
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
#include <string>

#include "gateway/http/message.h"
#include "sys/status.h"

namespace sg::http {

struct ServerConfig {
  std::string address = "127.0.0.1";
  uint16_t port = 0;  // 0: an ephemeral port
  int io_threads = 2;
  int worker_threads = 8;
  size_t header_limit = 16 * 1024;
  size_t body_limit = 1 << 20;
  std::chrono::milliseconds read_timeout{30000};
};

using Handler = std::function<HttpResponse(HttpRequest&)>;

class HttpServer {
 public:
  HttpServer(ServerConfig cfg, Handler handler);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds and listens; starts io and worker threads.
  Status start();
  uint16_t port() const;
  // Stops accepting, closes connections, joins threads.
  void stop();

  // Runs fn on the worker pool after delay (for periodic jobs such as the
  // timeout sweep). Thread-safe.
  void schedule(std::chrono::milliseconds delay, std::function<void()> fn);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace sg::http
