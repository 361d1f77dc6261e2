// Relay helpers for the proxy path of HttpServer (server.cpp only: Beast).
//
// relay_body() moves one message body from a parser on one stream to a
// serializer on another through a fixed 64 KiB buffer, chunk by chunk, so a
// relayed body of any size costs the gateway one buffer and streams (each
// piece is written as soon as it is read: Connect envelopes are not held
// back). pump() copies raw bytes one way after a protocol upgrade.
#pragma once

#include <boost/asio/awaitable.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http/buffer_body.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/serializer.hpp>
#include <boost/beast/http/write.hpp>

#include <boost/asio/local/stream_protocol.hpp>
#include <boost/beast/core/stream_traits.hpp>
#include <boost/beast/core/tcp_stream.hpp>

#include <array>
#include <functional>

namespace sg::http::relay {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;

inline constexpr size_t kRelayBuffer = 64 * 1024;

// Reads the body of `p` from `in` and writes it with `sr` (made from
// p.get()) to `out`. before_read / before_write arm the caller's timeouts.
// On an error, *out_failed (when given) says whether writing to `out`
// failed (rather than reading from `in`).
template <bool isRequest, class In, class Out>
asio::awaitable<boost::system::error_code> relay_body(In& in, beast::flat_buffer& in_buf,
                                                      bhttp::parser<isRequest, bhttp::buffer_body>& p,
                                                      bhttp::serializer<isRequest, bhttp::buffer_body>& sr, Out& out,
                                                      const std::function<void()>& before_read,
                                                      const std::function<void()>& before_write,
                                                      bool* out_failed = nullptr) {
  if (out_failed) *out_failed = false;
  std::array<char, kRelayBuffer> buf;
  boost::system::error_code ec;
  do {
    if (!p.is_done()) {
      p.get().body().data = buf.data();
      p.get().body().size = buf.size();
      before_read();
      co_await bhttp::async_read_some(in, in_buf, p, asio::redirect_error(asio::use_awaitable, ec));
      if (ec == bhttp::error::need_buffer) ec = {};
      if (ec) co_return ec;
      p.get().body().size = buf.size() - p.get().body().size;
      // A read may parse only framing (a chunk header). Never hand the
      // serializer an empty piece while more follows: in chunked encoding
      // an empty chunk is the end of the body.
      if (p.get().body().size == 0 && !p.is_done()) continue;
      // The body's end with no bytes in this read: no buffer at all. An
      // empty buffer would be serialized as a chunk of size 0, which is
      // itself a last chunk, and the final one would follow it: two
      // terminators, the second read by a keep-alive client as the start
      // of its next response.
      p.get().body().data = p.get().body().size == 0 ? nullptr : buf.data();
      p.get().body().more = !p.is_done();
    } else if (sr.is_done()) {
      break;
    } else {
      p.get().body().data = nullptr;
      p.get().body().size = 0;
      p.get().body().more = false;
    }
    before_write();
    co_await bhttp::async_write(out, sr, asio::redirect_error(asio::use_awaitable, ec));
    if (ec == bhttp::error::need_buffer) ec = {};
    if (ec) {
      if (out_failed) *out_failed = true;
      co_return ec;
    }
  } while (!p.is_done() || !sr.is_done());
  co_return ec;
}

// Half-closes the sending side (TLS streams: the TCP socket under them).
inline void half_close(asio::local::stream_protocol::socket& s) {
  boost::system::error_code ignored;
  s.shutdown(asio::socket_base::shutdown_send, ignored);
}
template <class Stream>
void half_close(Stream& s) {
  boost::system::error_code ignored;
  beast::get_lowest_layer(s).socket().shutdown(asio::socket_base::shutdown_send, ignored);
}

// Copies bytes from `in` to `out` until EOF or an error, first flushing
// what `leftover` already holds; then half-closes `out`.
template <class In, class Out>
asio::awaitable<void> pump(In& in, Out& out, beast::flat_buffer& leftover) {
  boost::system::error_code ec;
  if (leftover.size() > 0) {
    co_await asio::async_write(out, leftover.data(), asio::redirect_error(asio::use_awaitable, ec));
    leftover.consume(leftover.size());
    if (ec) co_return;
  }
  std::array<char, 16 * 1024> buf;
  for (;;) {
    size_t n = co_await in.async_read_some(asio::buffer(buf), asio::redirect_error(asio::use_awaitable, ec));
    if (ec || n == 0) break;
    co_await asio::async_write(out, asio::buffer(buf.data(), n), asio::redirect_error(asio::use_awaitable, ec));
    if (ec) break;
  }
  half_close(out);
}

}  // namespace sg::http::relay
