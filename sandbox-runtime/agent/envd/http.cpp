// HTTP/1.1 connection: parsing, body framing and response writing.
#include "sandbox-runtime/agent/envd/http.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace sg::envd {
namespace {

using Clock = std::chrono::steady_clock;

int ms_until(Clock::time_point deadline) {
  // Rounded up, so a poll that times out has reached the deadline.
  auto d = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
  if (d < 0) return 0;
  return d > 1000000 ? 1000000 : static_cast<int>(d);
}

std::string trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return std::string(s);
}

bool parse_u64(std::string_view s, int base, uint64_t* out) {
  if (s.empty() || s.size() > 16) return false;
  uint64_t v = 0;
  for (char c : s) {
    int d;
    if (c >= '0' && c <= '9') d = c - '0';
    else if (base == 16 && c >= 'a' && c <= 'f') d = c - 'a' + 10;
    else if (base == 16 && c >= 'A' && c <= 'F') d = c - 'A' + 10;
    else return false;
    v = v * base + d;
  }
  *out = v;
  return true;
}

}  // namespace

std::string lowercase(std::string_view s) {
  std::string out(s);
  for (char& c : out)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return out;
}

std::string url_decode(std::string_view s, bool plus_is_space) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    char c = s[i];
    if (c == '%' && i + 2 < s.size()) {
      uint64_t v;
      if (parse_u64(s.substr(i + 1, 2), 16, &v)) {
        out += static_cast<char>(v);
        i += 2;
        continue;
      }
    }
    out += (plus_is_space && c == '+') ? ' ' : c;
  }
  return out;
}

const std::string* Request::header(std::string_view name) const {
  for (auto& [k, v] : headers)
    if (k == name) return &v;
  return nullptr;
}

Conn::Conn(UniqueFd fd) : fd_(std::move(fd)) {
  int fl = ::fcntl(fd_.get(), F_GETFL);
  ::fcntl(fd_.get(), F_SETFL, fl | O_NONBLOCK);
}

void Conn::interrupt() { ::shutdown(fd_.get(), SHUT_RDWR); }

void Conn::linger(std::chrono::milliseconds total) {
  if (::shutdown(fd_.get(), SHUT_WR) != 0) return;
  auto end = Clock::now() + total;
  char tmp[64 << 10];
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now()).count();
    if (left <= 0) return;
    struct pollfd p = {fd_.get(), POLLIN, 0};
    int r = ::poll(&p, 1, static_cast<int>(std::min<long long>(left, 1000)));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return;  // idle for a second, or an error: enough
    ssize_t n = ::recv(fd_.get(), tmp, sizeof tmp, 0);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) return;  // the client closed (or reset)
  }
}

bool Conn::peer_gone() {
  struct pollfd p = {fd_.get(), POLLRDHUP, 0};
  return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

bool Conn::fill(Clock::time_point deadline, bool* eof) {
  *eof = false;
  if (pos_ > 0 && pos_ == buf_.size()) {
    buf_.clear();
    pos_ = 0;
  } else if (pos_ > (64 << 10)) {
    buf_.erase(0, pos_);
    pos_ = 0;
  }
  char tmp[64 << 10];
  for (;;) {
    ssize_t n = ::recv(fd_.get(), tmp, sizeof tmp, 0);
    if (n > 0) {
      buf_.append(tmp, static_cast<size_t>(n));
      return true;
    }
    if (n == 0) {
      *eof = true;
      return false;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return false;
    struct pollfd p = {fd_.get(), POLLIN, 0};
    int r = ::poll(&p, 1, ms_until(deadline));
    if (r == 0) return false;  // timeout
    if (r < 0 && errno != EINTR) return false;
  }
}

Clock::time_point Conn::body_read_deadline() const {
  auto d = Clock::now() + kIdleTimeout;
  if (body_deadline_ && *body_deadline_ < d) d = *body_deadline_;
  return d;
}

bool Conn::body_deadline_passed() const { return body_deadline_ && Clock::now() >= *body_deadline_; }

bool Conn::read_line(std::string* line, size_t limit, HttpError* err) {
  auto deadline = body_read_deadline();
  for (;;) {
    size_t nl = buf_.find('\n', pos_);
    if (nl != std::string::npos) {
      line->assign(buf_, pos_, nl - pos_);
      if (!line->empty() && line->back() == '\r') line->pop_back();
      pos_ = nl + 1;
      return true;
    }
    if (buf_.size() - pos_ > limit) {
      *err = {400, "line too long"};
      return false;
    }
    bool eof;
    if (!fill(deadline, &eof)) {
      *err = {0, eof ? "connection closed in body" : "body read timed out or failed"};
      return false;
    }
  }
}

std::optional<Request> Conn::read_request(HttpError* err) {
  *err = {0, ""};
  if (!body_done_ && !discard_body(1 << 20)) return std::nullopt;
  body_deadline_.reset();
  auto idle_deadline = Clock::now() + kIdleTimeout;
  std::optional<Clock::time_point> head_deadline;
  size_t end;
  for (;;) {
    // Tolerate stray CRLFs between requests (RFC 9112 2.2).
    while (pos_ < buf_.size() && (buf_[pos_] == '\r' || buf_[pos_] == '\n')) ++pos_;
    end = buf_.find("\r\n\r\n", pos_);
    if (end != std::string::npos) break;
    if (buf_.size() - pos_ > kMaxHeaderBytes) {
      *err = {431, "request header larger than 64 KiB"};
      return std::nullopt;
    }
    if (pos_ < buf_.size() && !head_deadline) head_deadline = Clock::now() + kHeaderTimeout;
    bool eof;
    if (!fill(head_deadline ? *head_deadline : idle_deadline, &eof)) {
      if (head_deadline && pos_ < buf_.size()) *err = {eof ? 0 : 408, "request header timed out"};
      return std::nullopt;
    }
    if (!head_deadline && pos_ < buf_.size()) head_deadline = Clock::now() + kHeaderTimeout;
  }
  if (end - pos_ > kMaxHeaderBytes) {
    *err = {431, "request header larger than 64 KiB"};
    return std::nullopt;
  }
  std::string_view head(buf_.data() + pos_, end - pos_);
  pos_ = end + 4;

  Request req;
  size_t eol = head.find("\r\n");
  std::string_view line = head.substr(0, eol);
  size_t sp1 = line.find(' ');
  size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp2 == std::string_view::npos) {
    *err = {400, "malformed request line"};
    return std::nullopt;
  }
  req.method = std::string(line.substr(0, sp1));
  req.target = std::string(line.substr(sp1 + 1, sp2 - sp1 - 1));
  std::string version(line.substr(sp2 + 1));
  if (version != "HTTP/1.1" && version != "HTTP/1.0") {
    *err = {400, "unsupported HTTP version"};
    return std::nullopt;
  }
  req.keep_alive = version == "HTTP/1.1";
  size_t start = eol == std::string_view::npos ? head.size() : eol + 2;
  while (start < head.size()) {
    size_t e = head.find("\r\n", start);
    if (e == std::string_view::npos) e = head.size();
    std::string_view h = head.substr(start, e - start);
    start = e + 2;
    size_t colon = h.find(':');
    if (colon == std::string_view::npos || colon == 0) {
      *err = {400, "malformed header line"};
      return std::nullopt;
    }
    req.headers.emplace_back(lowercase(h.substr(0, colon)), trim(h.substr(colon + 1)));
  }
  size_t q = req.target.find('?');
  req.path = url_decode(req.target.substr(0, q), false);
  if (q != std::string::npos) {
    std::string_view qs(req.target);
    qs.remove_prefix(q + 1);
    while (!qs.empty()) {
      size_t amp = qs.find('&');
      std::string_view kv = qs.substr(0, amp);
      size_t eq = kv.find('=');
      std::string k = url_decode(kv.substr(0, eq), true);
      std::string v = eq == std::string_view::npos ? "" : url_decode(kv.substr(eq + 1), true);
      req.query.emplace(std::move(k), std::move(v));
      if (amp == std::string_view::npos) break;
      qs.remove_prefix(amp + 1);
    }
  }
  if (auto* c = req.header("connection")) {
    std::string lc = lowercase(*c);
    if (lc.find("close") != std::string::npos) req.keep_alive = false;
    if (lc.find("keep-alive") != std::string::npos) req.keep_alive = true;
  }
  if (auto* te = req.header("transfer-encoding")) {
    if (lowercase(*te) != "chunked") {
      *err = {501, "unsupported transfer encoding"};
      return std::nullopt;
    }
    req.chunked = true;
  } else if (auto* cl = req.header("content-length")) {
    if (!parse_u64(*cl, 10, &req.content_length)) {
      *err = {400, "bad Content-Length"};
      return std::nullopt;
    }
  }
  if (auto* ex = req.header("expect")) req.expect_continue = lowercase(*ex) == "100-continue";
  keep_alive_ = req.keep_alive;
  chunked_ = req.chunked;
  in_chunk_ = false;
  remaining_ = req.content_length;
  body_done_ = !req.chunked && req.content_length == 0;
  if (req.expect_continue && !body_done_) {
    if (!write_all("HTTP/1.1 100 Continue\r\n\r\n")) return std::nullopt;
  }
  return req;
}

long Conn::read_raw(char* buf, size_t n, HttpError* err) {
  if (pos_ == buf_.size()) {
    bool eof;
    if (!fill(body_read_deadline(), &eof)) {
      *err = {0, eof ? "connection closed in body" : "body read timed out or failed"};
      return -1;
    }
  }
  size_t k = std::min(n, buf_.size() - pos_);
  std::memcpy(buf, buf_.data() + pos_, k);
  pos_ += k;
  return static_cast<long>(k);
}

long Conn::read_body(char* buf, size_t n, HttpError* err) {
  if (body_done_ || n == 0) return 0;
  if (!chunked_) {
    long k = read_raw(buf, std::min<uint64_t>(n, remaining_), err);
    if (k < 0) {
      keep_alive_ = false;
      return -1;
    }
    remaining_ -= static_cast<uint64_t>(k);
    if (remaining_ == 0) body_done_ = true;
    return k;
  }
  for (;;) {
    if (in_chunk_ && remaining_ > 0) {
      long k = read_raw(buf, std::min<uint64_t>(n, remaining_), err);
      if (k < 0) {
        keep_alive_ = false;
        return -1;
      }
      remaining_ -= static_cast<uint64_t>(k);
      return k;
    }
    std::string line;
    if (in_chunk_) {  // the CRLF after a chunk's data
      if (!read_line(&line, 16, err) || !line.empty()) {
        if (err->message.empty()) *err = {400, "malformed chunk"};
        keep_alive_ = false;
        return -1;
      }
      in_chunk_ = false;
    }
    if (!read_line(&line, 1024, err)) {
      keep_alive_ = false;
      return -1;
    }
    std::string_view sz(line);
    size_t semi = sz.find(';');
    uint64_t v;
    if (!parse_u64(trim(sz.substr(0, semi)), 16, &v)) {
      *err = {400, "malformed chunk size"};
      keep_alive_ = false;
      return -1;
    }
    if (v == 0) {
      // Trailers until an empty line.
      for (int i = 0; i < 64; ++i) {
        if (!read_line(&line, 8192, err)) {
          keep_alive_ = false;
          return -1;
        }
        if (line.empty()) {
          body_done_ = true;
          return 0;
        }
      }
      *err = {400, "too many trailers"};
      keep_alive_ = false;
      return -1;
    }
    in_chunk_ = true;
    remaining_ = v;
  }
}

bool Conn::read_body_all(size_t limit, std::string* out, HttpError* err) {
  out->clear();
  char tmp[64 << 10];
  for (;;) {
    long k = read_body(tmp, sizeof tmp, err);
    if (k < 0) return false;
    if (k == 0) return true;
    if (out->size() + static_cast<size_t>(k) > limit) {
      *err = {413, "request body larger than " + std::to_string(limit >> 20) + " MiB"};
      keep_alive_ = false;
      return false;
    }
    out->append(tmp, static_cast<size_t>(k));
  }
}

bool Conn::discard_body(size_t limit) {
  char tmp[16 << 10];
  size_t total = 0;
  HttpError err;
  while (!body_done_) {
    long k = read_body(tmp, sizeof tmp, &err);
    if (k < 0) return false;
    total += static_cast<size_t>(k);
    if (total > limit) {
      keep_alive_ = false;
      return false;
    }
  }
  return true;
}

bool Conn::write_all(std::string_view data) {
  auto deadline = Clock::now() + kIdleTimeout;
  while (!data.empty()) {
    ssize_t n = ::send(fd_.get(), data.data(), data.size(), MSG_NOSIGNAL);
    if (n > 0) {
      data.remove_prefix(static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      struct pollfd p = {fd_.get(), POLLOUT, 0};
      int r = ::poll(&p, 1, ms_until(deadline));
      if (r == 0) return false;
      if (r < 0 && errno != EINTR) return false;
      if (p.revents & (POLLERR | POLLHUP)) return false;
      continue;
    }
    keep_alive_ = false;
    return false;
  }
  return true;
}

static std::string head_of(int status, const std::vector<std::pair<std::string, std::string>>& headers,
                           bool keep_alive) {
  std::string h = "HTTP/1.1 " + std::to_string(status) + " " + status_text(status) + "\r\n";
  for (auto& [k, v] : headers) h += k + ": " + v + "\r\n";
  if (!keep_alive) h += "Connection: close\r\n";
  return h;
}

bool Conn::send_response(int status, const std::vector<std::pair<std::string, std::string>>& headers,
                         std::string_view body) {
  std::string h = head_of(status, headers, keep_alive_);
  if (status != 204 && status != 304) h += "Content-Length: " + std::to_string(body.size()) + "\r\n";
  h += "\r\n";
  if (body.size() < (64 << 10)) {
    h.append(body);
    return write_all(h);
  }
  return write_all(h) && write_all(body);
}

bool Conn::begin_chunked(int status, const std::vector<std::pair<std::string, std::string>>& headers) {
  std::string h = head_of(status, headers, keep_alive_);
  h += "Transfer-Encoding: chunked\r\n\r\n";
  return write_all(h);
}

bool Conn::begin_sized(int status, const std::vector<std::pair<std::string, std::string>>& headers,
                       uint64_t length) {
  std::string h = head_of(status, headers, keep_alive_);
  h += "Content-Length: " + std::to_string(length) + "\r\n\r\n";
  return write_all(h);
}

bool Conn::write_chunk(std::string_view data) {
  if (data.empty()) return true;
  char len[24];
  int n = std::snprintf(len, sizeof len, "%zx\r\n", data.size());
  std::string out(len, static_cast<size_t>(n));
  out.append(data);
  out += "\r\n";
  return write_all(out);
}

bool Conn::end_chunked() { return write_all("0\r\n\r\n"); }

const char* status_text(int s) {
  switch (s) {
    case 100: return "Continue";
    case 200: return "OK";
    case 204: return "No Content";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 409: return "Conflict";
    case 411: return "Length Required";
    case 413: return "Content Too Large";
    case 415: return "Unsupported Media Type";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 499: return "Client Closed Request";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 504: return "Gateway Timeout";
    case 507: return "Insufficient Storage";
    default: return "Status";
  }
}

}  // namespace sg::envd
