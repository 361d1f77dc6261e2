// Streaming handlers: routes whose response is produced piece by piece by
// a coroutine on the connection's executor (the model API proxy,
// wait-engine/llm/proxy.h), instead of returned whole by a Handler or
// relayed to a sandbox.
//
// The server reads the request head, asks StreamHooks::owns(), reads the
// body whole up to StreamHooks::body_limit (error() shapes the 413 and other
// early refusals the way the route's clients expect), then awaits
// StreamHooks::serve() with a ResponseWriter over the client connection.
// The writer frames the body (Content-Length when announced, else chunked;
// to an HTTP/1.0 client, unframed up to the close)
// and reports a client that went away as false from its writes.
//
// Threads: serve() runs on the connection's executor (a strand); it must
// not block: blocking work hops to a pool and back. The writer may only be
// used from that executor.
//
// HTTP/1.1 only: over HTTP/2 these routes are refused with error(505, ...)
// (h2_session.h), as no model client used with sandgate speaks h2 to it.
#pragma once

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/awaitable.hpp>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/http/message.h"

namespace sg::http {

class ResponseWriter {
 public:
  virtual ~ResponseWriter() = default;
  // Sends the status line and headers (framing headers are set by the
  // writer: pass neither Content-Length nor Transfer-Encoding). With
  // content_length the body must be exactly that long; without, it is sent
  // chunked (HTTP/1.0: unframed, and the connection closes after it).
  // False: the client is gone.
  virtual boost::asio::awaitable<bool> write_head(int status,
                                                  const std::vector<std::pair<std::string, std::string>>& headers,
                                                  std::optional<uint64_t> content_length) = 0;
  // One piece of the body, written at once (no coalescing: SSE events go
  // out as they come). False: the client is gone.
  virtual boost::asio::awaitable<bool> write_body(std::string_view bytes) = 0;
  // Ends the body. False: the client is gone.
  virtual boost::asio::awaitable<bool> finish() = 0;
  // A whole response in one go (errors).
  virtual boost::asio::awaitable<bool> respond(HttpResponse res) = 0;
  // Calls on_gone (on the connection's executor) once if the client closes
  // its side or resets the connection while no response is being written.
  // It never consumes request bytes: readable data (a pipelined request, a
  // TLS alert) just ends the watch. unwatch_closed() stops it; the writer's
  // destruction does too. One watch at a time.
  virtual void watch_closed(std::function<void()> on_gone) = 0;
  virtual void unwatch_closed() = 0;
  // Whether the connection can carry another request afterwards.
  virtual bool reusable() const = 0;
};

// What StreamHooks::authorize decides: a refusal, or the share (the
// caller's tenant) its body is charged to.
struct Authorized {
  std::optional<HttpResponse> refusal;
  std::string share;
};

struct StreamHooks {
  std::function<bool(const HttpRequest& head)> owns;
  size_t body_limit = 32 << 20;
  // Request bodies all streaming routes may hold at once, and the part of
  // it one share (tenant) may hold. A body is charged as its bytes arrive,
  // and only once authorize() has accepted the caller: a request that
  // would pass either bound is refused with error(503) and its connection
  // closed, so neither strangers nor one tenant can make the gateway
  // buffer without bound or lock the others out. A connection holds at
  // most one body (body_limit) at a time.
  size_t body_budget = 256 << 20;
  size_t share_budget = 64 << 20;
  // Runs on the io thread right after the head, before the body is read; a
  // response refuses the request there (e.g. credentials that cannot be
  // valid). Must not block. Optional.
  std::function<std::optional<HttpResponse>(const HttpRequest& head)> precheck;
  // Runs on the worker pool after precheck, before any body byte is read
  // or charged (it may block on SQLite): authenticates the caller. A
  // refusal answers the request; otherwise the share its body is charged
  // to. Optional: without it, every body is charged to the share "".
  std::function<Authorized(const HttpRequest& head)> authorize;
  // An early refusal (body too large, malformed framing, wrong protocol).
  std::function<HttpResponse(const HttpRequest& head, int status, const std::string& message)> error;
  std::function<boost::asio::awaitable<void>(HttpRequest req, ResponseWriter& out)> serve;
};

}  // namespace sg::http
