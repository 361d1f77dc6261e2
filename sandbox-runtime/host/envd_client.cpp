// run_command: see envd_client.h. One HTTP/1.1 request on a fresh stream
// (Connection: close), the reply read with poll() against one deadline.
#include "sandbox-runtime/host/envd_client.h"

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <thread>
#include <nlohmann/json.hpp>

#include "base/base64.h"
#include "base/sys.h"

namespace sg::host {

namespace {

using json = nlohmann::json;

constexpr size_t kMaxHead = 16 << 10;
constexpr std::chrono::milliseconds kStreamSlack{10000};

// Reads the reply bytes as they come, against a deadline.
class Reader {
 public:
  Reader(int fd, uint64_t deadline_ns) : fd_(fd), deadline_(deadline_ns) {}

  // At least one more byte into buf_; false at EOF. kTimeout past the
  // deadline.
  Result<bool> fill() {
    for (;;) {
      uint64_t now = sys::monotonic_ns();
      if (now >= deadline_) return Error(ErrorKind::kTimeout, "envd: no reply before the deadline");
      struct pollfd p = {fd_, POLLIN, 0};
      int r = ::poll(&p, 1, static_cast<int>((deadline_ - now) / 1000000 + 1));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) return sys::errno_error("poll", "envd stream");
      if (r == 0) continue;
      char tmp[16384];
      ssize_t n = ::recv(fd_, tmp, sizeof tmp, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return sys::errno_error("recv", "envd stream");
      if (n == 0) return false;
      buf_.append(tmp, static_cast<size_t>(n));
      return true;
    }
  }
  // Ensures n bytes are buffered; false at EOF first.
  Result<bool> need(size_t n) {
    while (buf_.size() < n) {
      Result<bool> more = fill();
      if (!more || !*more) return more;
    }
    return true;
  }
  std::string& buf() { return buf_; }

 private:
  int fd_;
  uint64_t deadline_;
  std::string buf_;
};

Error bad(const std::string& why) { return internal_error("envd: malformed reply: " + why); }

// The chunked body, decoded as it arrives, into whole envelopes.
class Envelopes {
 public:
  explicit Envelopes(Reader& r) : r_(r) {}

  // The next envelope's flags and message; nullopt at the body's end.
  Result<std::optional<std::pair<uint8_t, std::string>>> next() {
    while (body_.size() < 5 || body_.size() < 5 + length()) {
      if (done_) {
        if (body_.empty()) return std::optional<std::pair<uint8_t, std::string>>();
        return bad("the body ends inside an envelope");
      }
      if (Status s = chunk(); !s) return s.error();
      if (body_.size() >= 5 && length() > kMaxEnvelope) return bad("an envelope of " + std::to_string(length()) + " bytes");
    }
    size_t len = length();
    std::pair<uint8_t, std::string> e{static_cast<uint8_t>(body_[0]), body_.substr(5, len)};
    body_.erase(0, 5 + len);
    return std::optional<std::pair<uint8_t, std::string>>(std::move(e));
  }

 private:
  size_t length() const {
    size_t n = 0;
    for (int i = 1; i <= 4; ++i) n = (n << 8) | static_cast<uint8_t>(body_[static_cast<size_t>(i)]);
    return n;
  }
  // One chunk of the chunked encoding into body_.
  Status chunk() {
    std::string& b = r_.buf();
    size_t eol;
    while ((eol = b.find("\r\n")) == std::string::npos) {
      if (b.size() > 64) return bad("a chunk size line over 64 bytes");
      Result<bool> more = r_.fill();
      if (!more) return more.error();
      if (!*more) return bad("the stream ends inside the chunked body");
    }
    size_t size = 0;
    for (size_t i = 0; i < eol && b[i] != ';'; ++i) {
      char c = b[i];
      int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
      if (v < 0 || size > (kMaxEnvelope >> 4)) return bad("chunk size '" + b.substr(0, eol) + "'");
      size = size * 16 + static_cast<size_t>(v);
    }
    Result<bool> whole = r_.need(eol + 2 + size + 2);
    if (!whole) return whole.error();
    if (!*whole) return bad("the stream ends inside a chunk");
    if (size == 0) {
      done_ = true;
      return Status::Ok();
    }
    body_.append(b, eol + 2, size);
    b.erase(0, eol + 2 + size + 2);
    return Status::Ok();
  }

  Reader& r_;
  std::string body_;
  bool done_ = false;
};

std::string request(const std::string& token, const Command& c) {
  json env = json::object();
  for (const auto& [k, v] : c.env) env[k] = v;
  json process = {{"cmd", "/bin/bash"}, {"args", {"-l", "-c", c.script}}, {"envs", env}};
  if (!c.cwd.empty()) process["cwd"] = c.cwd;
  std::string msg = json{{"process", process}, {"stdin", false}}.dump();
  std::string body(5, '\0');
  for (int i = 0; i < 4; ++i) body[1 + static_cast<size_t>(i)] = static_cast<char>((msg.size() >> (8 * (3 - i))) & 0xff);
  body += msg;
  return "POST /process.Process/Start HTTP/1.1\r\nHost: envd\r\nConnection: close\r\n"
         "Connect-Protocol-Version: 1\r\nContent-Type: application/connect+json\r\n"
         "Keepalive-Ping-Interval: 5\r\n" +
         // On Start the timeout is the process's lifetime: none for a
         // process meant to run on.
         (c.background ? std::string() : "Connect-Timeout-Ms: " + std::to_string(c.timeout.count()) + "\r\n") +
         "X-Access-Token: " + token + "\r\n"
         "Authorization: Basic " + base64_encode(c.user + ":") + "\r\n"
         "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

Status send_all(int fd, const std::string& data) {
  for (size_t at = 0; at < data.size();) {
    ssize_t n = ::send(fd, data.data() + at, data.size() - at, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return sys::errno_error("send", "envd stream");
    at += static_cast<size_t>(n);
  }
  return Status::Ok();
}

// The response head: 200 with a chunked body, or the error the body says.
Status read_head(Reader& r) {
  std::string& b = r.buf();
  size_t end;
  while ((end = b.find("\r\n\r\n")) == std::string::npos) {
    if (b.size() > kMaxHead) return bad("a response head over 16 KiB");
    Result<bool> more = r.fill();
    if (!more) return more.error();
    if (!*more) return Error(ErrorKind::kUnavailable, "envd closed the stream before answering");
  }
  std::string head = b.substr(0, end);
  b.erase(0, end + 4);
  if (head.rfind("HTTP/1.1 ", 0) != 0 || head.size() < 12) return bad("status line '" + head.substr(0, 40) + "'");
  int status = std::atoi(head.c_str() + 9);
  if (status != 200) {
    std::string lower = head;
    for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    // An error answer has a small body: quote what is buffered.
    return Error(status == 401 ? ErrorKind::kUnauthorized : ErrorKind::kInternal,
                 "envd answered " + std::to_string(status) + ": " + b.substr(0, 300));
  }
  std::string lower = head;
  for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (lower.find("transfer-encoding: chunked") == std::string::npos) return bad("a stream that is not chunked");
  return Status::Ok();
}

}  // namespace

Result<CommandResult> run_command(runtime::Sandbox& sandbox, const std::string& access_token, const Command& command,
                                  const OutputFn& output) {
  if (command.timeout.count() <= 0) return invalid_error("run_command: the timeout must be positive");
  Result<UniqueFd> fd = sandbox.open_port(kEnvdPort);
  if (!fd) return fd.error();
  uint64_t deadline = sys::monotonic_ns() + static_cast<uint64_t>((command.timeout + kStreamSlack).count()) * 1000000ull;
  if (Status s = send_all(fd->get(), request(access_token, command)); !s) return s.error();
  Reader reader(fd->get(), deadline);
  if (Status s = read_head(reader); !s) return s.error();
  Envelopes envelopes(reader);
  CommandResult result;
  bool ended = false;
  for (;;) {
    auto e = envelopes.next();
    if (!e) return e.error();
    if (!*e) return bad("the stream ended without an end-of-stream message");
    auto& [flags, msg] = **e;
    json j = json::parse(msg, nullptr, false);
    if (j.is_discarded() || !j.is_object()) return bad("an envelope that is not a JSON object");
    if (flags & 0x02) {  // end of stream
      if (auto err = j.find("error"); err != j.end() && err->is_object()) {
        std::string code = err->value("code", "");
        std::string message = err->value("message", "");
        if (code == "deadline_exceeded")
          return Error(ErrorKind::kTimeout, "the command ran past its time limit of " +
                                                std::to_string(command.timeout.count() / 1000) + " s");
        return Error(code == "unauthenticated" ? ErrorKind::kUnauthorized : ErrorKind::kInvalid,
                     "envd: " + code + ": " + message);
      }
      if (!ended) return bad("the stream ended before the process did");
      return result;
    }
    auto ev = j.find("event");
    if (ev == j.end() || !ev->is_object()) return bad("a message without an event");
    if (auto st = ev->find("start"); st != ev->end() && st->is_object()) {
      result.pid = st->value("pid", 0);
      if (command.background) return result;
    } else if (auto d = ev->find("data"); d != ev->end() && d->is_object()) {
      for (auto [key, stream] : {std::pair{"stdout", 1}, std::pair{"stderr", 2}}) {
        auto v = d->find(key);
        if (v == d->end() || !v->is_string()) continue;
        std::optional<std::string> bytes = base64_decode(v->get<std::string>());
        if (!bytes) return bad("output that is not base64");
        if (output) output(stream, *bytes);
      }
    } else if (auto end = ev->find("end"); end != ev->end() && end->is_object()) {
      ended = true;
      result.exit_code = end->contains("exitCode") && (*end)["exitCode"].is_number_integer() ? (*end)["exitCode"].get<int>() : 0;
      result.status = end->value("status", "");
    }
    // keepalive: nothing to do.
  }
}

std::optional<runtime::StartCommand> start_command_of(const std::string& config_json,
                                                      std::chrono::milliseconds ready_timeout) {
  nlohmann::json config = nlohmann::json::parse(config_json, nullptr, false);
  if (!config.is_object() || !config.contains("startCmd") || !config["startCmd"].is_string()) return std::nullopt;
  runtime::StartCommand start;
  start.script = config["startCmd"].get<std::string>();
  if (auto r = config.find("readyCmd"); r != config.end() && r->is_string()) start.ready = r->get<std::string>();
  if (auto u = config.find("user"); u != config.end() && u->is_string()) start.user = u->get<std::string>();
  if (auto w = config.find("workdir"); w != config.end() && w->is_string()) start.cwd = w->get<std::string>();
  if (auto env = config.find("env"); env != config.end() && env->is_object())
    for (auto it = env->begin(); it != env->end(); ++it)
      if (it->is_string()) start.env.emplace_back(it.key(), it->get<std::string>());
  start.ready_timeout = ready_timeout;
  return start;
}

Status start_and_wait_ready(runtime::Sandbox& sandbox, const std::string& access_token,
                            const runtime::StartCommand& start) {
  uint64_t until = sys::monotonic_ns() + static_cast<uint64_t>(start.ready_timeout.count()) * 1000000ull;
  Command cmd;
  cmd.script = start.script;
  cmd.user = start.user;
  cmd.cwd = start.cwd;
  cmd.env = start.env;
  cmd.background = true;
  Result<CommandResult> started = run_command(sandbox, access_token, cmd, {});
  if (!started) return started.error().with_context("start command");
  if (start.ready.empty()) return Status::Ok();
  Command check = cmd;
  check.script = start.ready;
  check.background = false;
  check.timeout = std::chrono::milliseconds(10000);
  for (int attempt = 0;; ++attempt) {
    Result<CommandResult> r = run_command(sandbox, access_token, check, {});
    if (r && r->exit_code == 0) return Status::Ok();
    if (sys::monotonic_ns() >= until)
      return Error(ErrorKind::kTimeout, "its ready command did not succeed within " +
                                            std::to_string(start.ready_timeout.count() / 1000) +
                                            " s of the start command (last: " +
                                            (r ? r->status : r.error().message()) + ")");
    std::this_thread::sleep_for(std::chrono::milliseconds(attempt < 20 ? 50 : 250));
  }
}

}  // namespace sg::host
