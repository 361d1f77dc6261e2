// A small blocking HTTP/1.1 client over TCP, for the few places that talk
// to one known peer from a worker thread and cannot use the io_context:
// the etcd client (storage/etcd.h) and the cluster's node-to-node calls
// (gateway/cluster.h).
//
// Every call has a deadline (connect, write and each read are bounded by
// what is left of it; a connect by 5 s at most), the response head is bounded (64 KiB) and so is a
// whole body (body_limit). One request per connection ("Connection:
// close"), which keeps framing trivial: a body may be Content-Length,
// chunked, or run to EOF. Thread-safe: no shared state.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/fd.h"
#include "base/status.h"

namespace sg::net {

struct Endpoint {
  std::string host;  // a name or an address (IPv6 without brackets)
  uint16_t port = 0;
  std::string str() const;  // "host:port" ("[v6]:port")
};

// "host:port" or "[v6]:port". kInvalid otherwise.
Result<Endpoint> parse_endpoint(std::string_view s);

// Connects within timeout. kUnavailable when refused or unreachable,
// kTimeout when the deadline passes.
Result<UniqueFd> connect_tcp(const Endpoint& ep, std::chrono::milliseconds timeout);

struct Response {
  int status = 0;
  std::map<std::string, std::string> headers;  // lowercase names
  std::string body;
  std::string header(const std::string& lower) const {
    auto it = headers.find(lower);
    return it == headers.end() ? std::string() : it->second;
  }
};

struct Request {
  std::string method = "GET";
  std::string target = "/";
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;
};

// Serializes a request (Host, Content-Length and "Connection: close"
// added).
std::string serialize(const Request& req, const Endpoint& ep);

// One request on a fresh connection; the whole response within timeout.
// kUnavailable / kTimeout for transport failures, kInvalid for a malformed
// or oversized response; any HTTP status is a success here.
Result<Response> request(const Endpoint& ep, const Request& req, std::chrono::milliseconds timeout,
                         size_t body_limit = 16 << 20);

// A streaming request: the head within timeout, then on_data for each
// piece of the (de-chunked) body as it arrives, with no deadline between
// pieces but a check of `stop` at least every poll_interval. Returns when
// the body ends (Ok), on_data returns false (Ok), stop is set (Ok), or on
// an error. *status gets the response status (a non-2xx body is not
// streamed: it is returned as the error message).
Status stream(const Endpoint& ep, const Request& req, std::chrono::milliseconds timeout,
              const std::function<bool(std::string_view)>& on_data, const std::atomic<bool>& stop,
              std::chrono::milliseconds poll_interval = std::chrono::milliseconds(200));

// Reads a response head ("HTTP/1.1 200 ...\r\n...\r\n\r\n") from fd one
// byte at a time (so nothing past the head is consumed: the connection
// may become a tunnel), within the deadline. For CONNECT.
Result<Response> read_head_exact(int fd, std::chrono::steady_clock::time_point deadline);

// Writes all of data within the deadline.
Status write_all(int fd, std::string_view data, std::chrono::steady_clock::time_point deadline);

}  // namespace sg::net
