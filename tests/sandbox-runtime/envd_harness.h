// Test harness for envd: a Server on 127.0.0.1:0 with passwd/group files in
// a temp dir, a reaper thread standing in for the agent's main loop, and a
// small HTTP/1.1 client over a real TCP socket that understands Connect
// envelopes.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "sandbox-runtime/agent/envd/rpc.h"
#include "sandbox-runtime/agent/envd/server.h"
#include "sandbox-runtime/agent/reaper.h"
#include "base/sys.h"

namespace envd_test {

using nlohmann::json;

// Blocks SIGCHLD process-wide (before any server thread exists) and reaps
// on every SIGCHLD, like the agent's main loop.
class ReaperThread {
 public:
  explicit ReaperThread(sg::agent::Reaper& r) : r_(r) {
    sigset_t s;
    sigemptyset(&s);
    sigaddset(&s, SIGCHLD);
    pthread_sigmask(SIG_BLOCK, &s, nullptr);
    t_ = std::thread([this, s] {
      while (!stop_) {
        struct timespec ts = {0, 20 * 1000 * 1000};  // re-checks stop_, not a sync sleep
        sigtimedwait(&s, nullptr, &ts);
        r_.reap_all();
      }
    });
  }
  ~ReaperThread() {
    stop_ = true;
    t_.join();
  }

 private:
  sg::agent::Reaper& r_;
  std::atomic<bool> stop_{false};
  std::thread t_;
};

struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/envd-test-XXXXXX";
    path = mkdtemp(tmpl);
    chmod(path.c_str(), 0755);  // uid 1000 must reach its home below
  }
  ~TempDir() { (void)sg::sys::remove_tree(path); }
};

struct HttpResponse {
  int status = 0;
  std::map<std::string, std::string> headers;  // lowercase names
  std::string body;
  json j() const { return json::parse(body, nullptr, false); }
};

class Client {
 public:
  explicit Client(uint16_t port) {
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd_, reinterpret_cast<struct sockaddr*>(&a), sizeof a) < 0) throw std::runtime_error("connect");
    struct timeval tv = {20, 0};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  }
  ~Client() { close(fd_); }
  int fd() const { return fd_; }
  void set_rcvbuf(int n) { setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &n, sizeof n); }

  void send_raw(const std::string& s) {
    size_t off = 0;
    while (off < s.size()) {
      ssize_t n = ::send(fd_, s.data() + off, s.size() - off, MSG_NOSIGNAL);
      if (n <= 0) throw std::runtime_error("send");
      off += static_cast<size_t>(n);
    }
  }
  void send_request(const std::string& method, const std::string& target,
                    const std::map<std::string, std::string>& headers, const std::string& body) {
    std::string r = method + " " + target + " HTTP/1.1\r\nHost: localhost\r\n";
    for (auto& [k, v] : headers) r += k + ": " + v + "\r\n";
    r += "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
    send_raw(r);
  }
  // Reads a head; fills status and headers.
  HttpResponse read_head() {
    HttpResponse r;
    size_t end;
    while ((end = buf_.find("\r\n\r\n")) == std::string::npos) fill();
    std::string head = buf_.substr(0, end);
    buf_.erase(0, end + 4);
    r.status = std::stoi(head.substr(9, 3));
    size_t s = head.find("\r\n");
    while (s != std::string::npos && s + 2 < head.size()) {
      size_t e = head.find("\r\n", s + 2);
      std::string line = head.substr(s + 2, e == std::string::npos ? std::string::npos : e - s - 2);
      size_t c = line.find(':');
      std::string k = line.substr(0, c);
      for (auto& ch : k) ch = static_cast<char>(tolower(ch));
      r.headers[k] = line.substr(line.find_first_not_of(' ', c + 1));
      s = e;
    }
    chunked_ = r.headers.count("transfer-encoding") > 0;
    remaining_ = r.headers.count("content-length") ? std::stoull(r.headers["content-length"]) : 0;
    done_ = !chunked_ && remaining_ == 0;
    return r;
  }
  // Next bytes of the body; empty at its end.
  std::string read_body_some() {
    if (done_) return {};
    if (!chunked_) {
      if (buf_.empty()) fill();
      size_t k = std::min<size_t>(remaining_, buf_.size());
      std::string out = buf_.substr(0, k);
      buf_.erase(0, k);
      remaining_ -= k;
      if (remaining_ == 0) done_ = true;
      return out;
    }
    size_t nl;
    while ((nl = buf_.find("\r\n")) == std::string::npos) fill();
    size_t n = std::stoul(buf_.substr(0, nl), nullptr, 16);
    buf_.erase(0, nl + 2);
    while (buf_.size() < n + 2) fill();
    std::string out = buf_.substr(0, n);
    buf_.erase(0, n + 2);
    if (n == 0) done_ = true;
    return out;
  }
  HttpResponse request(const std::string& method, const std::string& target,
                       const std::map<std::string, std::string>& headers = {}, const std::string& body = "") {
    send_request(method, target, headers, body);
    HttpResponse r = read_head();
    for (std::string s; !(s = read_body_some()).empty();) r.body += s;
    return r;
  }
  // Connect envelopes of a streaming response body.
  struct Env {
    uint8_t flags;
    json msg;
  };
  Env next_envelope() {
    while (ebuf_.size() < 5) more_stream();
    uint32_t n = (uint32_t(uint8_t(ebuf_[1])) << 24) | (uint32_t(uint8_t(ebuf_[2])) << 16) |
                 (uint32_t(uint8_t(ebuf_[3])) << 8) | uint32_t(uint8_t(ebuf_[4]));
    while (ebuf_.size() < 5 + n) more_stream();
    Env e{uint8_t(ebuf_[0]), json::parse(ebuf_.substr(5, n))};
    ebuf_.erase(0, 5 + n);
    return e;
  }
  // Next non-keepalive message (process streams).
  Env next_event() {
    for (;;) {
      Env e = next_envelope();
      if (e.flags == 0 && e.msg.contains("event") && e.msg["event"].contains("keepalive")) continue;
      return e;
    }
  }
  bool body_done() const { return done_; }

 private:
  void more_stream() {
    std::string s = read_body_some();
    if (s.empty()) throw std::runtime_error("stream ended");
    ebuf_ += s;
  }
  void fill() {
    char tmp[65536];
    ssize_t n = ::recv(fd_, tmp, sizeof tmp, 0);
    if (n <= 0) throw std::runtime_error("recv: connection closed or timed out");
    buf_.append(tmp, static_cast<size_t>(n));
  }
  int fd_ = -1;
  std::string buf_, ebuf_;
  bool chunked_ = false, done_ = true;
  uint64_t remaining_ = 0;
};

inline std::string envelope_of(const json& j) { return sg::envd::envelope(0, j.dump()); }

struct Env {
  TempDir tmp;
  std::string home;       // of "tester" (our own uid)
  std::string user_home;  // of "user" (uid 1000)
  sg::agent::Reaper reaper;
  std::unique_ptr<ReaperThread> reaper_thread;
  std::unique_ptr<sg::envd::Server> server;

  // tweak adjusts the server's config before it starts (limits, seams).
  explicit Env(const std::string& token = "", const std::function<void(sg::envd::EnvdConfig&)>& tweak = {}) {
    home = tmp.path + "/home/tester";
    user_home = tmp.path + "/home/user";
    (void)sg::sys::make_dirs(home);
    (void)sg::sys::make_dirs(user_home);
    chown(user_home.c_str(), 1000, 1000);
    std::string uid = std::to_string(getuid()), gid = std::to_string(getgid());
    (void)sg::sys::write_file(tmp.path + "/passwd", "root:x:0:0:root:/root:/bin/bash\n"
                                                    "tester:x:" + uid + ":" + gid + "::" + home + ":/bin/sh\n"
                                                    "user:x:1000:1000::" + user_home + ":/bin/bash\n");
    (void)sg::sys::write_file(tmp.path + "/group", "root:x:0:\ntestgrp:x:4242:tester\nuser:x:1000:\n");
    reaper_thread = std::make_unique<ReaperThread>(reaper);
    sg::envd::EnvdConfig cfg;
    cfg.access_token = token;
    cfg.default_user = "tester";
    cfg.default_env = {"SANDBOX_VAR=yes", "PATH=/usr/local/bin:/usr/bin:/bin"};
    cfg.passwd_path = tmp.path + "/passwd";
    cfg.group_path = tmp.path + "/group";
    if (tweak) tweak(cfg);
    server = std::make_unique<sg::envd::Server>(cfg, reaper);
    auto st = server->listen("127.0.0.1", 0);
    if (!st) throw std::runtime_error(st.error().message());
    st = server->start();
    if (!st) throw std::runtime_error(st.error().message());
  }
  ~Env() {
    server->stop();
    server.reset();
    reaper_thread.reset();
  }
  uint16_t port() const { return server->port(); }

  // Unary Connect call.
  HttpResponse unary(const std::string& method, const json& req, std::map<std::string, std::string> h = {}) {
    Client c(port());
    h["Content-Type"] = "application/json";
    h["Connect-Protocol-Version"] = "1";
    return c.request("POST", "/" + method, h, req.dump());
  }
  // Opens a server stream; the head is read, envelopes follow on the client.
  std::unique_ptr<Client> stream(const std::string& method, const json& req,
                                 std::map<std::string, std::string> h = {}, int* status = nullptr) {
    auto c = std::make_unique<Client>(port());
    h["Content-Type"] = "application/connect+json";
    h["Connect-Protocol-Version"] = "1";
    c->send_request("POST", "/" + method, h, envelope_of(req));
    HttpResponse r = c->read_head();
    if (status) *status = r.status;
    return c;
  }
};

inline std::string b64(const std::string& s) { return sg::envd::base64_encode(s); }
inline std::string unb64(const std::string& s) { return sg::envd::base64_decode(s).value_or("<bad base64>"); }

}  // namespace envd_test
