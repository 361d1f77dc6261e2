// A small HTTP/1.1 server connection for envd: request heads (64 KiB cap,
// 30 s to arrive once started, 5 min idle between requests), request bodies
// framed by Content-Length or chunked encoding (read incrementally, every
// read bounded by a timeout), and responses with Content-Length or chunked
// encoding, each chunk written through at once so streaming envelopes reach
// the client as they are produced. Keep-alive follows HTTP/1.1 rules.
//
// Thread safety: one Conn is used by one thread, except interrupt(), which
// any thread may call to make every blocked read or write fail promptly.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/fd.h"

namespace sg::envd {

inline constexpr size_t kMaxHeaderBytes = 64 << 10;
inline constexpr std::chrono::seconds kHeaderTimeout{30};
inline constexpr std::chrono::seconds kIdleTimeout{300};

struct Request {
  std::string method;
  std::string target;  // as sent
  std::string path;    // target before '?', percent-decoded
  std::map<std::string, std::string> query;  // decoded; the first value of a repeated key
  std::vector<std::pair<std::string, std::string>> headers;  // names lowercased
  bool keep_alive = true;
  bool chunked = false;
  uint64_t content_length = 0;
  bool expect_continue = false;
  // The first header of that (lowercase) name, or nullptr.
  const std::string* header(std::string_view name) const;
};

// Outcome of a read: data, the clean end, or a failure (timeout, reset,
// malformed framing) after which the connection must be closed.
struct HttpError {
  int status;  // 400, 408, 413, 431 ... or 0 for "just close"
  std::string message;
};

class Conn {
 public:
  explicit Conn(UniqueFd fd);
  int fd() const { return fd_.get(); }

  // The next request head. nullopt: the peer closed or idled out between
  // requests (close silently). An HttpError: answer it (if status != 0)
  // and close.
  std::optional<Request> read_request(HttpError* err);

  // Request body of the current request, incrementally. Returns bytes read,
  // 0 at the end of the body, -1 on error (*err set).
  long read_body(char* buf, size_t n, HttpError* err);
  // The whole body, at most limit bytes (413 beyond).
  bool read_body_all(size_t limit, std::string* out, HttpError* err);
  // Reads and discards the rest of the body (up to limit) so the next
  // request can be read; false: close instead.
  bool discard_body(size_t limit);
  bool body_done() const { return body_done_; }
  // An overall deadline for the body reads of the current request (besides
  // the per-read idle timeout); cleared by the next read_request. A read
  // past it fails like an idle timeout; body_deadline_passed() tells them
  // apart.
  void set_body_deadline(std::optional<std::chrono::steady_clock::time_point> d) { body_deadline_ = d; }
  bool body_deadline_passed() const;

  // Responses. Each returns false when the peer is gone (close).
  bool write_all(std::string_view data);
  bool send_response(int status, const std::vector<std::pair<std::string, std::string>>& headers,
                     std::string_view body);
  bool begin_chunked(int status, const std::vector<std::pair<std::string, std::string>>& headers);
  // A head framed by Content-Length: length; the caller writes the body
  // (none for HEAD) with write_all.
  bool begin_sized(int status, const std::vector<std::pair<std::string, std::string>>& headers, uint64_t length);
  bool write_chunk(std::string_view data);
  bool end_chunked();
  // Whether the peer asked to close, or we decided to (after an error).
  bool keep_alive() const { return keep_alive_; }
  void set_close() { keep_alive_ = false; }
  // Makes every blocked and future read/write fail (shutdown(2)).
  void interrupt();
  // A lingering close, for a response sent before the request body was
  // read to its end (507 on a full disk, 413, ...): closing with unread
  // bytes would make the kernel send a reset, which can destroy the
  // response in the client's receive queue before it reads it. Instead
  // shut down the write side (the response is followed by FIN) and read
  // and drop whatever the client still sends, until it closes or for at
  // most `total`, then close.
  void linger(std::chrono::milliseconds total);
  // True when the peer has closed or reset (non-blocking check).
  bool peer_gone();

 private:
  // Fills buf_ with more bytes by the deadline; false on EOF/timeout/error.
  bool fill(std::chrono::steady_clock::time_point deadline, bool* eof);
  long read_raw(char* buf, size_t n, HttpError* err);
  bool read_line(std::string* line, size_t limit, HttpError* err);

  UniqueFd fd_;
  std::string buf_;  // bytes received and not consumed yet
  size_t pos_ = 0;
  bool keep_alive_ = true;
  // Body state of the current request.
  bool chunked_ = false;
  uint64_t remaining_ = 0;  // of the body (Content-Length) or of the current chunk
  bool in_chunk_ = false;
  bool body_done_ = true;
  std::optional<std::chrono::steady_clock::time_point> body_deadline_;
  // now + kIdleTimeout, or the body deadline when that is sooner.
  std::chrono::steady_clock::time_point body_read_deadline() const;
};

const char* status_text(int status);
std::string url_decode(std::string_view s, bool plus_is_space);
std::string lowercase(std::string_view s);

}  // namespace sg::envd
