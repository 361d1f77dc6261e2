// Implementation of the blocking HTTP/1.1 client (blocking_http.h).
#include "base/blocking_http.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstring>

namespace sg::net {

namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kHeadLimit = 64 * 1024;

int ms_left(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<int64_t>(left, 1 << 30));
}

Error timed_out(const std::string& what) { return Error(ErrorKind::kTimeout, what + ": timed out"); }
Error unavailable(const std::string& what, int err) {
  return Error(ErrorKind::kUnavailable, what + ": " + std::strerror(err));
}

// Waits for `events` on fd until the deadline. Ok(true): ready; Ok(false):
// timed out.
Result<bool> wait_for(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    int n = ::poll(&p, 1, ms_left(deadline));
    if (n > 0) return true;
    if (n == 0) return false;
    if (errno != EINTR) return unavailable("poll", errno);
  }
}

// Reads some bytes (0: EOF) within the deadline.
Result<size_t> read_some(int fd, char* buf, size_t n, Clock::time_point deadline, const std::string& what) {
  for (;;) {
    ssize_t r = ::recv(fd, buf, n, MSG_DONTWAIT);
    if (r >= 0) return static_cast<size_t>(r);
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return unavailable("read from " + what, errno);
    Result<bool> ready = wait_for(fd, POLLIN, deadline);
    if (!ready) return ready.error();
    if (!*ready) return timed_out("read from " + what);
  }
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

// Parses "HTTP/1.x NNN reason\r\nName: value\r\n...\r\n\r\n".
Result<Response> parse_head(std::string_view head) {
  Response r;
  size_t eol = head.find("\r\n");
  std::string_view status_line = head.substr(0, eol);
  if (status_line.size() < 12 || status_line.substr(0, 7) != "HTTP/1." || status_line[8] != ' ')
    return invalid_error("malformed HTTP status line");
  int code = 0;
  auto [p, ec] = std::from_chars(status_line.data() + 9, status_line.data() + 12, code);
  if (ec != std::errc() || p != status_line.data() + 12 || code < 100 || code > 599)
    return invalid_error("malformed HTTP status code");
  r.status = code;
  size_t pos = eol == std::string_view::npos ? head.size() : eol + 2;
  while (pos < head.size()) {
    size_t end = head.find("\r\n", pos);
    if (end == std::string_view::npos) end = head.size();
    std::string_view line = head.substr(pos, end - pos);
    pos = end + 2;
    if (line.empty()) break;
    size_t colon = line.find(':');
    if (colon == std::string_view::npos || colon == 0) return invalid_error("malformed HTTP header line");
    std::string name = lower(line.substr(0, colon));
    std::string value(trim(line.substr(colon + 1)));
    auto [it, fresh] = r.headers.emplace(name, value);
    if (!fresh) it->second += ", " + value;
  }
  return r;
}

// The body reader: de-chunks (or counts) bytes from the connection and
// hands each piece to a sink.
class BodyReader {
 public:
  BodyReader(int fd, std::string leftover, std::string what) : fd_(fd), buf_(std::move(leftover)), what_(std::move(what)) {}

  // Reads the whole body per the head's framing. The deadline function is
  // asked before each read (a stream re-arms it and checks its stop flag).
  Status run(const Response& head, const std::function<bool(std::string_view)>& sink,
             const std::function<Result<Clock::time_point>()>& next_deadline) {
    std::string te = lower(head.header("transfer-encoding"));
    std::string cl = head.header("content-length");
    if (te.find("chunked") != std::string::npos) return chunked(sink, next_deadline);
    if (!cl.empty()) {
      uint64_t n = 0;
      auto [p, ec] = std::from_chars(cl.data(), cl.data() + cl.size(), n);
      if (ec != std::errc() || p != cl.data() + cl.size()) return invalid_error("malformed Content-Length from " + what_);
      return counted(n, sink, next_deadline);
    }
    return to_eof(sink, next_deadline);
  }

 private:
  // More bytes into buf_. Ok(false) at EOF; stop_ when the sink or the
  // deadline function asked to stop.
  Result<bool> fill(const std::function<Result<Clock::time_point>()>& next_deadline) {
    for (;;) {
      Result<Clock::time_point> d = next_deadline();
      if (!d) return d.error();
      char tmp[16384];
      Result<size_t> n = read_some(fd_, tmp, sizeof(tmp), *d, what_);
      if (!n) {
        // A stream's slice ended with no data: ask again (the stop flag).
        if (n.error().kind() == ErrorKind::kTimeout && Clock::now() < hard_) continue;
        return n.error();
      }
      if (*n == 0) return false;
      buf_.append(tmp, *n);
      return true;
    }
  }

  Status counted(uint64_t n, const std::function<bool(std::string_view)>& sink,
                 const std::function<Result<Clock::time_point>()>& next_deadline) {
    while (n > 0) {
      if (buf_.empty()) {
        Result<bool> more = fill(next_deadline);
        if (!more) return more.error();
        if (!*more) return Error(ErrorKind::kUnavailable, "body from " + what_ + " ended early");
      }
      size_t take = static_cast<size_t>(std::min<uint64_t>(n, buf_.size()));
      if (!sink(std::string_view(buf_).substr(0, take))) return Status();
      buf_.erase(0, take);
      n -= take;
    }
    return Status();
  }

  Status to_eof(const std::function<bool(std::string_view)>& sink,
                const std::function<Result<Clock::time_point>()>& next_deadline) {
    for (;;) {
      if (!buf_.empty()) {
        if (!sink(buf_)) return Status();
        buf_.clear();
      }
      Result<bool> more = fill(next_deadline);
      if (!more) return more.error();
      if (!*more) return Status();
    }
  }

  // A line ending in CRLF from buf_ (bounded).
  Result<std::string> line(const std::function<Result<Clock::time_point>()>& next_deadline) {
    for (;;) {
      size_t eol = buf_.find("\r\n");
      if (eol != std::string::npos) {
        std::string l = buf_.substr(0, eol);
        buf_.erase(0, eol + 2);
        return l;
      }
      if (buf_.size() > 4096) return invalid_error("chunk header too long from " + what_);
      Result<bool> more = fill(next_deadline);
      if (!more) return more.error();
      if (!*more) return Error(ErrorKind::kUnavailable, "chunked body from " + what_ + " ended early");
    }
  }

  Status chunked(const std::function<bool(std::string_view)>& sink,
                 const std::function<Result<Clock::time_point>()>& next_deadline) {
    for (;;) {
      Result<std::string> size_line = line(next_deadline);
      if (!size_line) return size_line.error();
      std::string_view hex = *size_line;
      if (size_t semi = hex.find(';'); semi != std::string_view::npos) hex = hex.substr(0, semi);
      hex = trim(hex);
      uint64_t n = 0;
      auto [p, ec] = std::from_chars(hex.data(), hex.data() + hex.size(), n, 16);
      if (hex.empty() || ec != std::errc() || p != hex.data() + hex.size())
        return invalid_error("malformed chunk size from " + what_);
      if (n == 0) return Status();  // trailers are not read: the connection closes
      if (Status s = counted(n, sink, next_deadline); !s) return s;
      Result<std::string> crlf = line(next_deadline);
      if (!crlf) return crlf.error();
      if (!crlf->empty()) return invalid_error("malformed chunk end from " + what_);
    }
  }

 public:
  Clock::time_point hard_ = Clock::time_point::min();

 private:
  int fd_;
  std::string buf_;
  std::string what_;
};

// Reads the head (bounded); returns it and whatever came after it.
Result<std::pair<Response, std::string>> read_head(int fd, Clock::time_point deadline, const std::string& what) {
  std::string buf;
  for (;;) {
    size_t end = buf.find("\r\n\r\n");
    if (end != std::string::npos) {
      Result<Response> r = parse_head(std::string_view(buf).substr(0, end + 2));
      if (!r) return r.error().with_context(what);
      return std::make_pair(std::move(*r), buf.substr(end + 4));
    }
    if (buf.size() > kHeadLimit) return invalid_error("response head from " + what + " larger than 64 KiB");
    char tmp[4096];
    Result<size_t> n = read_some(fd, tmp, sizeof(tmp), deadline, what);
    if (!n) return n.error();
    if (*n == 0) return Error(ErrorKind::kUnavailable, what + " closed the connection before answering");
    buf.append(tmp, *n);
  }
}

// A request sent and its answer's head read: the connection, the head,
// and the bytes read past the head (the body's start).
struct Exchange {
  UniqueFd fd;
  Response head;
  std::string leftover;
};

Result<Exchange> exchange(const Endpoint& ep, const Request& req, Clock::time_point deadline) {
  // A peer that does not answer a connect at all (partitioned) is given
  // up on early, whatever the whole call may take.
  Result<UniqueFd> fd = connect_tcp(ep, std::chrono::milliseconds(std::min(ms_left(deadline), 5000)));
  if (!fd) return fd.error();
  if (Status s = write_all(fd->get(), serialize(req, ep), deadline); !s) return s.error();
  auto head = read_head(fd->get(), deadline, ep.str());
  if (!head) return head.error();
  return Exchange{std::move(*fd), std::move(head->first), std::move(head->second)};
}

}  // namespace

std::string Endpoint::str() const {
  if (host.find(':') != std::string::npos) return "[" + host + "]:" + std::to_string(port);
  return host + ":" + std::to_string(port);
}

Result<Endpoint> parse_endpoint(std::string_view s) {
  Endpoint ep;
  std::string_view port;
  if (!s.empty() && s.front() == '[') {
    size_t close = s.find(']');
    if (close == std::string_view::npos || close + 1 >= s.size() || s[close + 1] != ':')
      return invalid_error("malformed address \"" + std::string(s) + "\": want [v6]:port");
    ep.host = std::string(s.substr(1, close - 1));
    port = s.substr(close + 2);
  } else {
    size_t colon = s.rfind(':');
    if (colon == std::string_view::npos || colon == 0)
      return invalid_error("malformed address \"" + std::string(s) + "\": want host:port");
    ep.host = std::string(s.substr(0, colon));
    port = s.substr(colon + 1);
  }
  unsigned p = 0;
  auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), p);
  if (ec != std::errc() || end != port.data() + port.size() || p == 0 || p > 65535)
    return invalid_error("malformed port in \"" + std::string(s) + "\"");
  for (char c : ep.host)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == ':' || c == '_'))
      return invalid_error("malformed host in \"" + std::string(s) + "\"");
  if (ep.host.empty()) return invalid_error("empty host in \"" + std::string(s) + "\"");
  ep.port = static_cast<uint16_t>(p);
  return ep;
}

Result<UniqueFd> connect_tcp(const Endpoint& ep, std::chrono::milliseconds timeout) {
  Clock::time_point deadline = Clock::now() + timeout;
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_family = AF_UNSPEC;
  addrinfo* res = nullptr;
  std::string port = std::to_string(ep.port);
  if (int rc = ::getaddrinfo(ep.host.c_str(), port.c_str(), &hints, &res); rc != 0)
    return Error(ErrorKind::kUnavailable, "resolve " + ep.host + ": " + gai_strerror(rc));
  Error last = Error(ErrorKind::kUnavailable, "connect " + ep.str() + ": no address");
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    UniqueFd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol));
    if (!fd) {
      last = unavailable("socket for " + ep.str(), errno);
      continue;
    }
    int one = 1;
    ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (::connect(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
      if (errno != EINPROGRESS) {
        last = unavailable("connect " + ep.str(), errno);
        continue;
      }
      Result<bool> ready = wait_for(fd.get(), POLLOUT, deadline);
      if (!ready) {
        last = ready.error();
        continue;
      }
      if (!*ready) {
        last = timed_out("connect " + ep.str());
        break;
      }
      int err = 0;
      socklen_t len = sizeof(err);
      ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) {
        last = unavailable("connect " + ep.str(), err);
        continue;
      }
    }
    // Back to blocking mode: callers bound each operation with poll.
    int fl = ::fcntl(fd.get(), F_GETFL);
    ::fcntl(fd.get(), F_SETFL, fl & ~O_NONBLOCK);
    ::freeaddrinfo(res);
    return fd;
  }
  ::freeaddrinfo(res);
  return last;
}

Status write_all(int fd, std::string_view data, Clock::time_point deadline) {
  while (!data.empty()) {
    ssize_t n = ::send(fd, data.data(), data.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n > 0) {
      data.remove_prefix(static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return unavailable("write", errno);
    Result<bool> ready = wait_for(fd, POLLOUT, deadline);
    if (!ready) return ready.error();
    if (!*ready) return timed_out("write");
  }
  return Status();
}

std::string serialize(const Request& req, const Endpoint& ep) {
  std::string out = req.method + " " + req.target + " HTTP/1.1\r\nHost: " + ep.str() + "\r\n";
  for (const auto& [k, v] : req.headers) out += k + ": " + v + "\r\n";
  if (!req.body.empty() || req.method == "POST" || req.method == "PUT" || req.method == "PATCH")
    out += "Content-Length: " + std::to_string(req.body.size()) + "\r\n";
  out += "Connection: close\r\n\r\n";
  out += req.body;
  return out;
}

Result<Response> request(const Endpoint& ep, const Request& req, std::chrono::milliseconds timeout_ms,
                         size_t body_limit) {
  Clock::time_point deadline = Clock::now() + timeout_ms;
  std::string what = ep.str();
  Result<Exchange> x = exchange(ep, req, deadline);
  if (!x) return x.error();
  Response r = std::move(x->head);
  if (req.method == "HEAD" || r.status == 204 || r.status == 304 || r.status / 100 == 1) return r;
  BodyReader body(x->fd.get(), std::move(x->leftover), what);
  bool too_big = false;
  Status s = body.run(
      r,
      [&](std::string_view piece) {
        if (r.body.size() + piece.size() > body_limit) {
          too_big = true;
          return false;
        }
        r.body.append(piece);
        return true;
      },
      [&]() -> Result<Clock::time_point> { return deadline; });
  if (too_big) return invalid_error("response body from " + what + " larger than " + std::to_string(body_limit) + " bytes");
  if (!s) return s.error();
  return r;
}

Status stream(const Endpoint& ep, const Request& req, std::chrono::milliseconds timeout_ms,
              const std::function<bool(std::string_view)>& on_data, const std::atomic<bool>& stop,
              std::chrono::milliseconds poll_interval) {
  Clock::time_point deadline = Clock::now() + timeout_ms;
  std::string what = ep.str();
  Result<Exchange> x = exchange(ep, req, deadline);
  if (!x) return x.error();
  Response r = std::move(x->head);
  if (r.status / 100 != 2) {
    std::string body = x->leftover.substr(0, 512);
    return Error(r.status / 100 == 5 ? ErrorKind::kUnavailable : ErrorKind::kInvalid,
                 what + " answered " + std::to_string(r.status) + ": " + body);
  }
  BodyReader body(x->fd.get(), std::move(x->leftover), what);
  // Each read waits one poll interval; a quiet one is retried (hard_ is
  // the far future) unless stop is set.
  body.hard_ = Clock::time_point::max();
  bool stopped = false;
  Status s = body.run(
      r, on_data, [&]() -> Result<Clock::time_point> {
        if (stop.load()) {
          stopped = true;
          return Error(ErrorKind::kUnavailable, "stopped");
        }
        return Clock::now() + poll_interval;
      });
  if (stopped) return Status();
  return s;
}

Result<Response> read_head_exact(int fd, Clock::time_point deadline) {
  std::string buf;
  for (;;) {
    if (buf.size() >= 4 && buf.compare(buf.size() - 4, 4, "\r\n\r\n") == 0) return parse_head(buf);
    if (buf.size() > kHeadLimit) return invalid_error("response head larger than 64 KiB");
    char c;
    Result<size_t> n = read_some(fd, &c, 1, deadline, "peer");
    if (!n) return n.error();
    if (*n == 0) return Error(ErrorKind::kUnavailable, "peer closed the connection before answering");
    buf.push_back(c);
  }
}

}  // namespace sg::net
