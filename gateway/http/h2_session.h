// HTTP/2 over TLS for HttpServer (server.cpp only: Asio and Beast types).
//
// serve_h2() runs one nghttp2 server session over a TLS stream whose ALPN
// selected "h2", with the semantics of the HTTP/1.1 path: each stream's head
// is routed by ProxyHooks::route; control-plane requests are buffered up to
// body_limit (413 beyond) and answered by the Handler on the worker pool;
// sandbox requests are relayed as HTTP/1.1 over the stream ProxyHooks::connect
// returns, streaming both bodies. Flow control bounds memory: request DATA is
// acknowledged (WINDOW_UPDATE) only as it is written upstream, and a stream's
// response buffer stops reading upstream while it holds kH2ResponseBuffer.
//
// Threads: every nghttp2 call and callback runs on the connection's strand
// (the executor serve_h2 is awaited on); handlers and connect() hop to the
// worker pool and post back, as HttpServer::Impl::dispatch does. Exceptions
// never escape. The caller owns the stream and closes it after return.
#pragma once

#include <atomic>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/ssl/ssl_stream.hpp>
#include <string>

#include "gateway/http/server.h"

namespace sg::http {

inline constexpr size_t kH2ResponseBuffer = 256 * 1024;  // per stream, upstream → client
inline constexpr int32_t kH2StreamWindow = 256 * 1024;   // per stream, client → upstream
inline constexpr int32_t kH2ConnectionWindow = 2 * 1024 * 1024;
inline constexpr uint32_t kH2MaxStreams = 256;

struct H2Deps {
  const ServerConfig& cfg;
  const Handler& handler;
  const ProxyHooks& proxy_hooks;
  const StreamHooks& stream_hooks;
  boost::asio::thread_pool& workers;
};

// Serves the connection until the client goes away, a protocol error, an
// idle read_timeout (no stream in progress), or a write stalled for
// stalled_write_timeout. Returns normally in every case.
boost::asio::awaitable<void> serve_h2(boost::beast::ssl_stream<boost::beast::tcp_stream>& stream, std::string remote,
                                      H2Deps deps);

}  // namespace sg::http
