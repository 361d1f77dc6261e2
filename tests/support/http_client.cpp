// Test HTTP client implementation.
#include "tests/support/http_client.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "base/fd.h"
#include "base/sys.h"

namespace sg::test {

namespace {

UniqueFd dial(const std::string& host, int port, std::string& err) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, host.c_str(), &a.sin_addr);
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    err = std::string("connect: ") + std::strerror(errno);
    return UniqueFd();
  }
  return fd;
}

bool send_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    ssize_t n = ::send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    off += static_cast<size_t>(n);
  }
  return true;
}

// Reads until EOF or the deadline. Returns false on timeout.
bool read_all(int fd, std::string& out, std::chrono::milliseconds timeout) {
  uint64_t deadline = sys::monotonic_ns() + static_cast<uint64_t>(timeout.count()) * 1000000ull;
  char buf[16384];
  for (;;) {
    uint64_t now = sys::monotonic_ns();
    if (now >= deadline) return false;
    pollfd p{fd, POLLIN, 0};
    int r = ::poll(&p, 1, static_cast<int>((deadline - now) / 1000000ull) + 1);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return true;  // reset: treat as closed
    }
    if (n == 0) return true;
    out.append(buf, static_cast<size_t>(n));
  }
}

}  // namespace

Response parse_response(const std::string& raw) {
  Response r;
  size_t he = raw.find("\r\n\r\n");
  if (raw.rfind("HTTP/1.", 0) != 0 || he == std::string::npos) {
    r.error = "no HTTP response (" + std::to_string(raw.size()) + " bytes)";
    return r;
  }
  r.status = std::atoi(raw.c_str() + 9);
  size_t pos = raw.find("\r\n") + 2;
  while (pos < he) {
    size_t e = raw.find("\r\n", pos);
    std::string line = raw.substr(pos, e - pos);
    size_t c = line.find(':');
    if (c != std::string::npos) {
      std::string k = line.substr(0, c), v = line.substr(c + 1);
      for (char& ch : k) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
      while (!v.empty() && v.front() == ' ') v.erase(0, 1);
      r.headers[k] = v;
    }
    pos = e + 2;
  }
  std::string body = raw.substr(he + 4);
  if (r.header("transfer-encoding").find("chunked") != std::string::npos) {
    std::string out;
    size_t p = 0;
    while (p < body.size()) {
      size_t e = body.find("\r\n", p);
      if (e == std::string::npos) break;
      size_t n = std::strtoul(body.substr(p, e - p).c_str(), nullptr, 16);
      if (n == 0) break;
      out += body.substr(e + 2, n);
      p = e + 2 + n + 2;
    }
    body = out;
  } else if (!r.header("content-length").empty()) {
    body = body.substr(0, std::strtoul(r.header("content-length").c_str(), nullptr, 10));
  }
  r.body = body;
  return r;
}

Response HttpClient::raw(const std::string& bytes, std::chrono::milliseconds timeout) {
  Response r;
  UniqueFd fd = dial(host_, port_, r.error);
  if (!fd) return r;
  if (!send_all(fd.get(), bytes)) {
    r.error = "send failed";
    return r;
  }
  std::string in;
  if (!read_all(fd.get(), in, timeout)) {
    r = parse_response(in);
    if (r.status == 0) r.error = "timed out";
    return r;
  }
  return parse_response(in);
}

Response HttpClient::request(const std::string& method, const std::string& target, const std::string& body,
                             const std::map<std::string, std::string>& headers, std::chrono::milliseconds timeout) {
  std::string req = method + " " + target + " HTTP/1.1\r\nHost: " + host_ + ":" + std::to_string(port_) +
                    "\r\nConnection: close\r\n";
  bool has_ct = false;
  for (const auto& [k, v] : headers) {
    req += k + ": " + v + "\r\n";
    if (strcasecmp(k.c_str(), "content-type") == 0) has_ct = true;
  }
  if (!body.empty() && !has_ct) req += "Content-Type: application/json\r\n";
  if (!body.empty() || method == "POST" || method == "PUT") req += "Content-Length: " + std::to_string(body.size()) + "\r\n";
  req += "\r\n" + body;
  return raw(req, timeout);
}

long long HttpClient::wait_for_close(const std::string& bytes, std::chrono::milliseconds timeout) {
  std::string err;
  UniqueFd fd = dial(host_, port_, err);
  if (!fd) return -1;
  uint64_t t0 = sys::monotonic_ns();
  if (!send_all(fd.get(), bytes)) return -1;
  std::string in;
  if (!read_all(fd.get(), in, timeout)) return -1;
  return static_cast<long long>((sys::monotonic_ns() - t0) / 1000000ull);
}

}  // namespace sg::test
