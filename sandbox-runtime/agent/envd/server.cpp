// envd server: listener, connection workers, routing, auth and the Connect
// handlers of process.Process and filesystem.Filesystem.
#include "sandbox-runtime/agent/envd/server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <system_error>
#include <thread>

#include "sandbox-runtime/agent/envd/files.h"
#include "sandbox-runtime/agent/envd/filesystem.h"
#include "sandbox-runtime/agent/envd/http.h"
#include "sandbox-runtime/agent/envd/rpc.h"
#include "sandbox-runtime/agent/envd/users.h"
#include "base/log.h"
#include "base/sys.h"

namespace sg::envd {

using Clock = std::chrono::steady_clock;
using Headers = std::vector<std::pair<std::string, std::string>>;

namespace {

constexpr size_t kMaxUnaryBody = 16 << 20;
// The longest Connect-Timeout-Ms honoured (30 days, longer than any
// sandbox lives); larger values are clamped to it.
constexpr long long kMaxCallTimeoutMs = 30ll * 24 * 3600 * 1000;
constexpr const char* kDefaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

// A server-streaming response: 200 and the envelope stream, started lazily
// so an error before the first message is still an end-of-stream envelope.
class Stream {
 public:
  explicit Stream(Conn& c) : c_(c) {}
  bool send(const json& msg) {
    if (!begin()) return false;
    ok_ = c_.write_chunk(envelope(0, msg.dump()));
    return ok_;
  }
  void finish(const std::optional<RpcError>& err) {
    if (!begin()) return;
    if (c_.write_chunk(end_stream(err))) c_.end_chunked();
  }

 private:
  bool begin() {
    if (!started_) {
      started_ = true;
      ok_ = c_.begin_chunked(200, {{"Content-Type", "application/connect+json"}});
    }
    return ok_;
  }
  Conn& c_;
  bool started_ = false, ok_ = true;
};

struct CallContext {
  User user;
  std::chrono::milliseconds timeout{0};      // Connect-Timeout-Ms, 0 = none
  std::chrono::seconds keepalive{90};        // Keepalive-Ping-Interval
};

std::optional<std::pair<pid_t, std::string>> selector(const json& req) {
  const json* p = field(req, "process");
  if (!p || !p->is_object()) return std::nullopt;
  auto pid = get_int(*p, "pid");
  std::string tag = get_string(*p, "tag");
  if (!pid || (*pid <= 0 && tag.empty()) || *pid > INT32_MAX) return std::nullopt;
  return std::make_pair(static_cast<pid_t>(*pid), tag);
}

RpcError bad_selector() { return rpc_error(Code::kInvalidArgument, "request needs process.pid or process.tag"); }

// ProcessInput {stdin|pty: base64} inside msg["input"]: (is_pty, bytes).
RpcResult<std::pair<bool, std::string>> process_input(const json& msg) {
  const json* in = field(msg, "input");
  if (!in || !in->is_object()) return rpc_error(Code::kInvalidArgument, "request needs input.stdin or input.pty");
  bool pty = field(*in, "pty") != nullptr;
  const json* data = pty ? field(*in, "pty") : field(*in, "stdin");
  if (!data || !data->is_string()) return rpc_error(Code::kInvalidArgument, "request needs input.stdin or input.pty");
  auto bytes = base64_decode(data->get<std::string>());
  if (!bytes) return rpc_error(Code::kInvalidArgument, "input is not valid base64");
  return std::make_pair(pty, std::move(*bytes));
}

// A connection no thread can serve: a canned 503 written without blocking
// (the socket buffer of a new connection has room), then a close. Written
// before the request is read: the reply still reaches a client whose request
// is not sent yet; one already sent may be lost to the reset close sends.
void refuse_connection(UniqueFd fd) {
  static const std::string kBody =
      error_json(rpc_error(Code::kUnavailable, "envd has no thread for this connection: the sandbox is out of "
                                               "processes or threads (pids limit); retry after some exit"))
          .dump();
  std::string r = "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                  "Connection: close\r\nContent-Length: " + std::to_string(kBody.size()) + "\r\n\r\n" + kBody;
  [[maybe_unused]] ssize_t n = ::send(fd.get(), r.data(), r.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
  ::shutdown(fd.get(), SHUT_WR);
}

}  // namespace

struct Server::Impl {
  Impl(EnvdConfig c, agent::Reaper& r)
      : cfg(std::move(c)),
        spawn(cfg.spawn ? cfg.spawn : SpawnFn(spawn_detached)),
        users(cfg.passwd_path, cfg.group_path),
        procs(r, spawn),
        hub(cfg.watch, &users) {}

  EnvdConfig cfg;  // access_token and default_env as at construction: read identity()
  // The token and environment in force: a microVM cloned from a warm
  // snapshot is configured again (reconfigure()), while its requests run.
  struct Identity {
    std::string access_token;
    std::vector<std::string> default_env;
  };
  std::shared_ptr<const Identity> ident = std::make_shared<const Identity>(Identity{cfg.access_token, cfg.default_env});
  mutable std::mutex ident_mu;
  std::shared_ptr<const Identity> identity() const {
    std::lock_guard lk(ident_mu);
    return ident;
  }
  SpawnFn spawn;
  UserDb users;
  ProcessManager procs;
  WatchHub hub;  // before watchers: outlives them
  UniqueFd listener;
  uint16_t bound_port = 0;
  std::thread acceptor;
  std::atomic<bool> stopping{false};

  std::mutex mu;
  std::condition_variable conns_done;
  std::condition_variable work;  // a connection was queued for an idle worker, or stopping
  std::set<Conn*> conns;         // GUARDED_BY(mu)
  size_t busy = 0;               // GUARDED_BY(mu): connections being served or queued
  size_t workers = 0;            // GUARDED_BY(mu): worker threads alive
  size_t idle = 0;               // GUARDED_BY(mu): workers waiting for a connection
  std::deque<UniqueFd> queued;   // GUARDED_BY(mu): accepted, for idle workers (size <= idle)
  uint64_t rejected = 0;         // GUARDED_BY(mu)
  uint64_t refused_threads = 0;  // GUARDED_BY(mu)
  std::map<std::string, std::shared_ptr<Watcher>> watchers;  // GUARDED_BY(watch_mu)
  std::mutex watch_mu;

  void accept_loop();
  bool start_worker(UniqueFd* first);
  void worker(UniqueFd first);
  void serve(UniqueFd fd);
  void handle(Conn& c, const Request& r);
  void handle_rpc(Conn& c, const Request& r, const std::string& service, const std::string& method);
  bool check_token(const Request& r) const {
    std::shared_ptr<const Identity> id = identity();
    if (id->access_token.empty()) return true;
    const std::string* t = r.header("x-access-token");
    return t && constant_time_equal(*t, id->access_token);
  }
  RpcResult<User> rpc_user(const Request& r);

  // process.Process
  void start(Conn& c, const json& req, const CallContext& ctx);
  void connect(Conn& c, const json& req, const CallContext& ctx);
  void stream_process(Stream& s, Subscription& sub, const CallContext& ctx, bool is_start);
  RpcResult<json> unary_process(const std::string& method, const json& req);
  void stream_input(Conn& c, const CallContext& ctx);
  std::optional<RpcError> read_input_stream(Conn& c);
  std::optional<RpcError> input_message(std::string_view payload, std::optional<pid_t>* pid);
  // filesystem.Filesystem
  void watch_dir(Conn& c, const json& req, const CallContext& ctx);
  RpcResult<json> unary_fs(const std::string& method, const json& req, const CallContext& ctx);
};

Server::Server(EnvdConfig cfg, agent::Reaper& reaper) : impl_(std::make_unique<Impl>(std::move(cfg), reaper)) {}

Server::~Server() { stop(); }

Status Server::listen(const std::string& address, uint16_t port) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) return sys::errno_error("socket", "envd listener");
  int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  struct sockaddr_in a = {};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  if (::inet_pton(AF_INET, address.c_str(), &a.sin_addr) != 1)
    return invalid_error("envd listen address '" + address + "' is not an IPv4 address");
  std::string where = address + ":" + std::to_string(port);
  // SAFETY: sockaddr_in is the sockaddr layout for AF_INET.
  if (::bind(fd.get(), reinterpret_cast<struct sockaddr*>(&a), sizeof a) < 0) return sys::errno_error("bind", where);
  if (::listen(fd.get(), 128) < 0) return sys::errno_error("listen", where);
  socklen_t len = sizeof a;
  if (::getsockname(fd.get(), reinterpret_cast<struct sockaddr*>(&a), &len) < 0)
    return sys::errno_error("getsockname", where);
  impl_->bound_port = ntohs(a.sin_port);
  impl_->listener = std::move(fd);
  return Status::Ok();
}

uint16_t Server::port() const { return impl_->bound_port; }

Status Server::start() {
  Impl& m = *impl_;
  assert(m.listener.valid());
  if (Status s = m.hub.start(); !s) LOG_ERROR("envd: " << s.error().message() << "; directory watchers are refused");
  // The reserve: workers that exist before any sandbox process does, so
  // envd answers even when the sandbox has used up its threads.
  for (size_t i = 0; i < kReserveWorkers; ++i) {
    UniqueFd none;
    if (!m.start_worker(&none)) LOG_WARN("envd: could not start reserve worker " << i);
  }
  try {
    m.acceptor = std::thread([&m] { m.accept_loop(); });
  } catch (const std::system_error& e) {
    return internal_error(std::string("envd accept thread: ") + e.what());
  }
  return Status::Ok();
}

void Server::reconfigure(std::string access_token, std::vector<std::string> default_env) {
  auto id = std::make_shared<const Impl::Identity>(Impl::Identity{std::move(access_token), std::move(default_env)});
  std::lock_guard lk(impl_->ident_mu);
  impl_->ident = std::move(id);
}

void Server::stop() {
  Impl& m = *impl_;
  if (m.stopping.exchange(true)) return;
  if (m.listener) ::shutdown(m.listener.get(), SHUT_RDWR);
  if (m.acceptor.joinable()) m.acceptor.join();
  {
    std::lock_guard<std::mutex> g(m.mu);
    for (Conn* c : m.conns) c->interrupt();
    m.work.notify_all();
  }
  m.procs.shutdown();
  m.hub.stop();
  std::unique_lock<std::mutex> l(m.mu);
  m.conns_done.wait(l, [&] { return m.workers == 0; });
  m.listener.reset();
}

ServerStats Server::stats() {
  ServerStats s;
  {
    std::lock_guard<std::mutex> g(impl_->mu);
    s.connections = impl_->conns.size();
    s.rejected_connections = impl_->rejected;
    s.workers = impl_->workers;
    s.idle_workers = impl_->idle;
    s.refused_threads = impl_->refused_threads;
  }
  s.processes = impl_->procs.stats();
  s.watch = impl_->hub.stats();
  return s;
}

// A new worker serving *first (if valid) and then waiting for more. False:
// no thread; *first is still the caller's.
bool Server::Impl::start_worker(UniqueFd* first) {
  {
    std::lock_guard<std::mutex> g(mu);
    ++workers;
  }
  // Shared, so the connection comes back to the caller if the thread is
  // refused (std::function needs a copyable callable).
  auto slot = std::make_shared<UniqueFd>(std::move(*first));
  bool ok = spawn([this, slot] { worker(std::move(*slot)); });
  if (ok) return true;
  *first = std::move(*slot);
  std::lock_guard<std::mutex> g(mu);
  --workers;
  conns_done.notify_all();
  return false;
}

void Server::Impl::worker(UniqueFd first) {
  UniqueFd fd = std::move(first);
  std::unique_lock<std::mutex> l(mu);
  for (;;) {
    if (fd) {
      l.unlock();
      serve(std::move(fd));
      l.lock();
      --busy;
    }
    if (queued.empty()) {
      if (stopping || idle >= kMaxIdleWorkers) break;
      ++idle;
      work.wait(l, [&] { return stopping || !queued.empty(); });
      --idle;
    }
    if (queued.empty()) break;  // stopping
    fd = std::move(queued.front());
    queued.pop_front();
  }
  --workers;
  conns_done.notify_all();
}

void Server::Impl::accept_loop() {
  while (!stopping) {
    int fd = ::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (stopping) return;
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE || errno == ENOMEM || errno == ENOBUFS) {
        LOG_WARN("envd: accept: " << std::strerror(errno) << "; retrying in 100 ms");
        struct pollfd p = {listener.get(), 0, 0};
        ::poll(&p, 1, 100);
        continue;
      }
      if (!stopping) LOG_ERROR("envd: accept: " << std::strerror(errno));
      return;
    }
    UniqueFd cfd(fd);
    {
      std::lock_guard<std::mutex> g(mu);
      if (busy >= cfg.max_connections) {
        ++rejected;
        continue;  // closed: the client retries
      }
      ++busy;
      if (idle > queued.size()) {
        queued.push_back(std::move(cfd));
        work.notify_one();
        continue;
      }
    }
    if (start_worker(&cfd)) continue;
    uint64_t refusals;
    {
      std::lock_guard<std::mutex> g(mu);
      --busy;
      refusals = ++refused_threads;
    }
    if (refusals == 1 || refusals % 1000 == 0)  // once, not once per retry of a client
      LOG_WARN("envd: no thread for a connection (the sandbox is out of processes or threads); answered 503 ("
               << refusals << " so far)");
    refuse_connection(std::move(cfd));
  }
}

void Server::Impl::serve(UniqueFd fd) {
  int one = 1;
  ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  Conn c(std::move(fd));
  {
    std::lock_guard<std::mutex> g(mu);
    conns.insert(&c);
    if (stopping) c.interrupt();
  }
  for (;;) {
    HttpError err;
    auto req = c.read_request(&err);
    if (!req) {
      if (err.status) {
        c.set_close();
        send_http_error(c, err.status, err.message);
      }
      break;
    }
    handle(c, *req);
    if (!c.keep_alive() || stopping) break;
    if (!c.body_done() && !c.discard_body(1 << 20)) break;
  }
  if (!c.body_done() && !stopping) c.linger(std::chrono::seconds(5));
  std::lock_guard<std::mutex> g(mu);
  conns.erase(&c);
}

void Server::Impl::handle(Conn& c, const Request& r) {
  const std::string& p = r.path;
  if (p == "/health") {
    if (r.method != "GET" && r.method != "HEAD") return send_http_error(c, 405, "use GET /health");
    c.send_response(204, {{"X-Envd-Version", cfg.version}}, {});
    return;
  }
  if (p == "/files") {
    if (r.method != "GET" && r.method != "HEAD" && r.method != "POST")
      return send_http_error(c, 405, "use GET or POST /files");
    FilesContext fc{&users, identity()->access_token, cfg.default_user};
    serve_files(c, r, fc);
    return;
  }
  if (!check_token(r)) {
    c.set_close();
    return send_http_error(c, 401, r.header("x-access-token") ? "invalid access token" : "missing access token");
  }
  if (p == "/envs" && r.method == "GET") {
    json env = json::object();
    for (auto& kv : identity()->default_env) {
      size_t eq = kv.find('=');
      if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    c.send_response(200, {{"Content-Type", "application/json"}}, env.dump());
    return;
  }
  // /<package>.<Service>/<Method>
  if (p.size() > 1 && r.method == "POST") {
    size_t slash = p.find('/', 1);
    if (slash != std::string::npos) {
      std::string service = p.substr(1, slash - 1), method = p.substr(slash + 1);
      if (service == "process.Process" || service == "filesystem.Filesystem")
        return handle_rpc(c, r, service, method);
    }
  }
  send_http_error(c, 404, "no route for " + r.method + " " + p);
}

RpcResult<User> Server::Impl::rpc_user(const Request& r) {
  std::string name = cfg.default_user;
  if (const std::string* a = r.header("authorization")) {
    if (lowercase(a->substr(0, 6)) != "basic ") return rpc_error(Code::kUnauthenticated, "unsupported Authorization scheme");
    auto dec = base64_decode(a->substr(6));
    if (!dec) return rpc_error(Code::kUnauthenticated, "malformed Basic Authorization header");
    name = dec->substr(0, dec->find(':'));
    if (name.empty()) name = cfg.default_user;
  }
  auto u = users.find(name);
  if (!u) return rpc_error(Code::kUnauthenticated, "invalid username: '" + name + "'");
  return *u;
}

void Server::Impl::handle_rpc(Conn& c, const Request& r, const std::string& service, const std::string& method) {
  static const std::set<std::string> kStreams = {"Start", "Connect", "WatchDir"};
  bool client_stream = service == "process.Process" && method == "StreamInput";
  bool stream = kStreams.count(method) > 0 || client_stream;
  const std::string* ct = r.header("content-type");
  std::string lct = ct ? lowercase(ct->substr(0, ct->find(';'))) : "";
  auto unary_error = [&](const RpcError& e) {
    c.send_response(code_http_status(e.code), {{"Content-Type", "application/json"}}, error_json(e).dump());
  };
  std::string want = stream ? "application/connect+json" : "application/json";
  if (lct != want) {
    c.set_close();
    c.send_response(415, {{"Content-Type", "application/json"}},
                    error_json(rpc_error(Code::kUnimplemented, "unsupported content type '" + lct + "', want " + want))
                        .dump());
    return;
  }
  CallContext ctx;
  if (const std::string* t = r.header("connect-timeout-ms")) {
    char* end = nullptr;
    long long v = std::strtoll(t->c_str(), &end, 10);
    // Clamped: a client's 10^13 ms (10^19 ns, past int64) must not overflow the deadline arithmetic
    // (Clock::now() + timeout) into the past, which would end the call at once.
    if (!t->empty() && !*end && v > 0) ctx.timeout = std::chrono::milliseconds(std::min<long long>(v, kMaxCallTimeoutMs));
  }
  if (const std::string* k = r.header("keepalive-ping-interval")) {
    char* end = nullptr;
    long long v = std::strtoll(k->c_str(), &end, 10);
    if (!k->empty() && !*end && v > 0 && v < 86400) ctx.keepalive = std::chrono::seconds(v);
  }
  if (client_stream) {
    auto u = rpc_user(r);
    if (!u) {
      Stream s(c);
      return s.finish(u.error());  // the unread body is discarded (bounded) or the connection closed
    }
    ctx.user = std::move(*u);
    return stream_input(c, ctx);
  }
  std::string body;
  HttpError herr;
  if (!c.read_body_all(kMaxUnaryBody, &body, &herr)) {
    c.set_close();
    if (herr.status) send_http_error(c, herr.status, herr.message);
    return;
  }
  json req;
  std::optional<RpcError> perr;
  if (stream) {
    auto env = parse_single_envelope(body);
    if (!env) perr = env.error();
    else body = std::move(env->payload);
  }
  if (!perr) {
    req = json::parse(body.empty() ? "{}" : body, nullptr, false);
    if (req.is_discarded() || !req.is_object())
      perr = rpc_error(Code::kInvalidArgument, "request body is not a JSON object");
  }
  if (!perr) {
    auto u = rpc_user(r);
    if (!u) perr = u.error();
    else ctx.user = std::move(*u);
  }
  if (perr) {
    if (stream) {
      Stream s(c);
      s.finish(perr);
    } else {
      unary_error(*perr);
    }
    return;
  }
  if (stream) {
    if (method == "Start" && service == "process.Process") return start(c, req, ctx);
    if (method == "Connect" && service == "process.Process") return connect(c, req, ctx);
    if (method == "WatchDir" && service == "filesystem.Filesystem") return watch_dir(c, req, ctx);
    Stream s(c);
    return s.finish(rpc_error(Code::kUnimplemented, service + "/" + method + " is not implemented"));
  }
  RpcResult<json> res = service == "process.Process" ? unary_process(method, req) : unary_fs(method, req, ctx);
  if (!res) return unary_error(res.error());
  c.send_response(200, {{"Content-Type", "application/json"}}, res->dump());
}

// ---- process.Process ----

static std::optional<std::string> find_executable(const std::string& cmd, const std::vector<std::string>& env,
                                                  const std::string& cwd) {
  auto usable = [](const std::string& p) {
    struct stat st;
    return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(p.c_str(), X_OK) == 0;
  };
  if (cmd.find('/') != std::string::npos) {
    std::string p = cmd[0] == '/' ? cmd : cwd + "/" + cmd;
    return usable(p) ? std::optional<std::string>(p) : std::nullopt;
  }
  std::string path = kDefaultPath;
  for (auto& e : env)
    if (e.rfind("PATH=", 0) == 0) path = e.substr(5);
  size_t s = 0;
  while (s <= path.size()) {
    size_t c = path.find(':', s);
    std::string dir = path.substr(s, c == std::string::npos ? std::string::npos : c - s);
    if (dir.empty()) dir = ".";
    std::string p = dir + "/" + cmd;
    if (usable(p)) return p;
    if (c == std::string::npos) break;
    s = c + 1;
  }
  return std::nullopt;
}

void Server::Impl::start(Conn& c, const json& req, const CallContext& ctx) {
  Stream s(c);
  const json* proc = field(req, "process");
  if (!proc || !proc->is_object()) return s.finish(rpc_error(Code::kInvalidArgument, "request needs process"));
  StartSpec spec;
  spec.user = ctx.user;
  std::string cmd = get_string(*proc, "cmd");
  if (cmd.empty()) return s.finish(rpc_error(Code::kInvalidArgument, "process.cmd is empty"));
  spec.argv.push_back(cmd);
  json config{{"cmd", cmd}, {"args", json::array()}, {"envs", json::object()}};
  if (const json* a = field(*proc, "args"); a && a->is_array())
    for (auto& v : *a)
      if (v.is_string()) {
        spec.argv.push_back(v.get<std::string>());
        config["args"].push_back(v);
      }
  // PATH, HOME, USER, LOGNAME; then the sandbox defaults; then the request.
  std::vector<std::pair<std::string, std::string>> env;
  auto set = [&](const std::string& k, const std::string& v) {
    for (auto& e : env)
      if (e.first == k) {
        e.second = v;
        return;
      }
    env.emplace_back(k, v);
  };
  std::shared_ptr<const Identity> id = identity();
  std::string path = kDefaultPath;
  for (auto& kv : id->default_env)
    if (kv.rfind("PATH=", 0) == 0) path = kv.substr(5);
  set("PATH", path);
  set("HOME", spec.user.home);
  set("USER", spec.user.name);
  set("LOGNAME", spec.user.name);
  for (auto& kv : id->default_env) {
    size_t eq = kv.find('=');
    if (eq != std::string::npos && eq > 0) set(kv.substr(0, eq), kv.substr(eq + 1));
  }
  if (const json* e = field(*proc, "envs"); e && e->is_object())
    for (auto& [k, v] : e->items())
      if (v.is_string() && !k.empty() && k.find('=') == std::string::npos && k.find('\0') == std::string::npos) {
        set(k, v.get<std::string>());
        config["envs"][k] = v;
      }
  for (auto& [k, v] : env) spec.env.push_back(k + "=" + v);
  std::string cwd_req = get_string(*proc, "cwd");
  if (field(*proc, "cwd")) config["cwd"] = cwd_req;
  spec.cwd = cwd_req.empty() ? spec.user.home : resolve_path(spec.user.home, cwd_req);
  struct stat st;
  if (::stat(spec.cwd.c_str(), &st) < 0 || !S_ISDIR(st.st_mode))
    return s.finish(rpc_error(Code::kInvalidArgument, "cwd '" + spec.cwd + "' does not exist"));
  auto exe = find_executable(cmd, spec.env, spec.cwd);
  if (!exe) return s.finish(rpc_error(Code::kInvalidArgument, "exec: \"" + cmd + "\": executable file not found"));
  spec.exe = *exe;
  spec.config = config;
  if (const json* t = field(req, "tag"); t && t->is_string()) spec.tag = t->get<std::string>();
  spec.stdin_pipe = get_bool(req, "stdin");
  if (const json* pty = field(req, "pty"); pty && pty->is_object()) {
    spec.pty = true;
    if (const json* size = field(*pty, "size"); size && size->is_object()) {
      auto cols = get_int(*size, "cols"), rows = get_int(*size, "rows");
      spec.cols = static_cast<uint16_t>(cols && *cols > 0 && *cols < 65536 ? *cols : 80);
      spec.rows = static_cast<uint16_t>(rows && *rows > 0 && *rows < 65536 ? *rows : 24);
    }
  }
  spec.timeout = ctx.timeout;
  auto sub = procs.start(spec);
  if (!sub) return s.finish(sub.error());
  if (!s.send(json{{"event", {{"start", {{"pid", (*sub)->pid()}}}}}})) return;
  stream_process(s, **sub, ctx, true);
}

void Server::Impl::connect(Conn& c, const json& req, const CallContext& ctx) {
  Stream s(c);
  auto sel = selector(req);
  if (!sel) return s.finish(bad_selector());
  auto sub = procs.connect(sel->first, sel->second);
  if (!sub) return s.finish(sub.error());
  if (!s.send(json{{"event", {{"start", {{"pid", (*sub)->pid()}}}}}})) return;
  stream_process(s, **sub, ctx, false);
}

void Server::Impl::stream_process(Stream& s, Subscription& sub, const CallContext& ctx, bool is_start) {
  auto next_keepalive = Clock::now() + ctx.keepalive;
  // On Start the deadline is the process's lifetime, enforced by its pump
  // (the end event says so); on Connect it bounds only this stream.
  std::optional<Clock::time_point> stream_deadline;
  if (!is_start && ctx.timeout.count() > 0) stream_deadline = Clock::now() + ctx.timeout;
  for (;;) {
    auto wake = next_keepalive;
    if (stream_deadline && *stream_deadline < wake) wake = *stream_deadline;
    auto ev = sub.next(wake);
    if (!ev) {
      if (stopping) return s.finish(rpc_error(Code::kUnavailable, "envd is shutting down"));
      if (stream_deadline && Clock::now() >= *stream_deadline)
        return s.finish(rpc_error(Code::kDeadlineExceeded, "context deadline exceeded"));
      if (!s.send(json{{"event", {{"keepalive", json::object()}}}})) return;
      next_keepalive = Clock::now() + ctx.keepalive;
      continue;
    }
    if (ev->kind == ProcEvent::kEnd) {
      if (ev->timed_out) return s.finish(rpc_error(Code::kDeadlineExceeded, "context deadline exceeded"));
      if (!s.send(json{{"event", {{"end", end_event_json(ev->wait_status)}}}})) return;
      return s.finish(std::nullopt);
    }
    const char* key = ev->kind == ProcEvent::kStdout ? "stdout" : ev->kind == ProcEvent::kStderr ? "stderr" : "pty";
    if (!s.send(json{{"event", {{"data", {{key, base64_encode(ev->data)}}}}}})) return;
    next_keepalive = Clock::now() + ctx.keepalive;
  }
}

RpcResult<json> Server::Impl::unary_process(const std::string& method, const json& req) {
  if (method == "List") {
    json list = json::array();
    for (auto& p : procs.list()) {
      json e{{"config", p.config}, {"pid", p.pid}};
      if (p.tag) e["tag"] = *p.tag;
      list.push_back(std::move(e));
    }
    return json{{"processes", std::move(list)}};
  }
  auto sel = selector(req);
  if (method == "SendInput") {
    if (!sel) return bad_selector();
    auto in = process_input(req);
    if (!in) return in.error();
    auto st = procs.send_input(sel->first, sel->second, in->first, in->second);
    if (!st) return st.error();
    return json::object();
  }
  if (method == "SendSignal") {
    if (!sel) return bad_selector();
    auto sig = get_enum(req, "signal", {{"SIGNAL_UNSPECIFIED", 0}, {"SIGNAL_SIGTERM", 15}, {"SIGNAL_SIGKILL", 9}});
    if (!sig || (*sig != 9 && *sig != 15)) return rpc_error(Code::kInvalidArgument, "signal must be SIGNAL_SIGTERM or SIGNAL_SIGKILL");
    auto st = procs.signal(sel->first, sel->second, static_cast<int>(*sig));
    if (!st) return st.error();
    return json::object();
  }
  if (method == "CloseStdin") {
    if (!sel) return bad_selector();
    auto st = procs.close_stdin(sel->first, sel->second);
    if (!st) return st.error();
    return json::object();
  }
  if (method == "Update") {
    if (!sel) return bad_selector();
    const json* pty = field(req, "pty");
    if (!pty) return json::object();
    const json* size = pty->is_object() ? field(*pty, "size") : nullptr;
    auto cols = size ? get_int(*size, "cols") : std::optional<int64_t>(0);
    auto rows = size ? get_int(*size, "rows") : std::optional<int64_t>(0);
    if (!cols || !rows || *cols <= 0 || *rows <= 0 || *cols > 65535 || *rows > 65535)
      return rpc_error(Code::kInvalidArgument, "pty.size needs cols and rows between 1 and 65535");
    auto st = procs.resize(sel->first, sel->second, static_cast<uint16_t>(*cols), static_cast<uint16_t>(*rows));
    if (!st) return st.error();
    return json::object();
  }
  return rpc_error(Code::kUnimplemented, "process.Process/" + method + " is not implemented");
}

// StreamInput (client streaming): envelopes are parsed as they arrive and
// each data message is written to the process before the next is read, so
// memory is one envelope (kMaxUnaryBody) plus one read buffer. The reply is
// a Content-Length 200: message {} and end-of-stream {}, or just the
// end-of-stream error.
void Server::Impl::stream_input(Conn& c, const CallContext& ctx) {
  if (ctx.timeout.count() > 0) c.set_body_deadline(Clock::now() + ctx.timeout);
  std::optional<RpcError> err = read_input_stream(c);
  c.set_body_deadline(std::nullopt);
  std::string body = err ? end_stream(err) : envelope(0, "{}") + end_stream(std::nullopt);
  // On an error the rest of the body is discarded after the reply (up to
  // 1 MiB) so the client sees the reply, not a reset; beyond that: close.
  c.send_response(200, {{"Content-Type", "application/connect+json"}}, body);
}

std::optional<RpcError> Server::Impl::read_input_stream(Conn& c) {
  std::string pend;
  std::string chunk(64 << 10, '\0');
  std::optional<pid_t> pid;
  bool eof = false;
  for (;;) {
    size_t off = 0;
    while (pend.size() - off >= 5) {
      auto b = reinterpret_cast<const uint8_t*>(pend.data() + off);
      uint32_t n = (uint32_t(b[1]) << 24) | (uint32_t(b[2]) << 16) | (uint32_t(b[3]) << 8) | uint32_t(b[4]);
      uint8_t flags = b[0];
      if (n > kMaxUnaryBody) {
        c.set_close();
        return rpc_error(Code::kResourceExhausted, "request message of " + std::to_string(n) +
                                                       " bytes is larger than 16 MiB");
      }
      if (pend.size() - off - 5 < n) break;
      std::string_view payload(pend.data() + off + 5, n);
      off += 5 + n;
      if (flags & kFlagCompressed)
        return rpc_error(Code::kUnimplemented, "request body: compressed envelopes are not supported");
      if (flags & kFlagEndStream) {  // the client's end of stream: nothing may follow
        if (!pid) return rpc_error(Code::kInvalidArgument, "stream ended before the start message");
        return std::nullopt;
      }
      if (auto e = input_message(payload, &pid)) return e;
    }
    pend.erase(0, off);
    if (eof) break;
    if (stopping) return rpc_error(Code::kUnavailable, "envd is shutting down");
    HttpError herr;
    long k = c.read_body(chunk.data(), chunk.size(), &herr);
    if (k < 0) {
      c.set_close();
      if (c.body_deadline_passed()) return rpc_error(Code::kDeadlineExceeded, "context deadline exceeded");
      if (herr.status) return rpc_error(Code::kInvalidArgument, "request body: " + herr.message);
      return rpc_error(Code::kCanceled, "request body: " + herr.message);
    }
    if (k == 0) eof = true;
    else pend.append(chunk.data(), static_cast<size_t>(k));
  }
  if (!pend.empty()) return rpc_error(Code::kInvalidArgument, "request body: truncated envelope");
  if (!pid) return rpc_error(Code::kInvalidArgument, "stream ended before the start message");
  return std::nullopt;
}

// One StreamInputRequest: {"start":{"process":...}}, {"data":{"input":...}}
// or {"keepalive":{}}.
std::optional<RpcError> Server::Impl::input_message(std::string_view payload, std::optional<pid_t>* pid) {
  json m = json::parse(payload.empty() ? std::string_view("{}") : payload, nullptr, false);
  if (m.is_discarded() || !m.is_object()) return rpc_error(Code::kInvalidArgument, "request message is not a JSON object");
  if (const json* st = field(m, "start")) {
    if (*pid) return rpc_error(Code::kInvalidArgument, "start message sent twice");
    if (!st->is_object()) return bad_selector();
    auto sel = selector(*st);
    if (!sel) return bad_selector();
    auto p = procs.lookup(sel->first, sel->second);
    if (!p) return p.error();
    *pid = *p;
    return std::nullopt;
  }
  if (const json* d = field(m, "data")) {
    if (!*pid) return rpc_error(Code::kInvalidArgument, "the first message must be start");
    if (!d->is_object()) return rpc_error(Code::kInvalidArgument, "data needs input.stdin or input.pty");
    auto in = process_input(*d);
    if (!in) return in.error();
    auto s = procs.send_input(**pid, "", in->first, in->second);
    if (!s) return s.error();
    return std::nullopt;
  }
  if (field(m, "keepalive")) return std::nullopt;
  return rpc_error(Code::kInvalidArgument, "request message needs start, data or keepalive");
}

// ---- filesystem.Filesystem ----

void Server::Impl::watch_dir(Conn& c, const json& req, const CallContext& ctx) {
  Stream s(c);
  std::string path = resolve_path(ctx.user.home, get_string(req, "path"));
  auto w = hub.watch(path, get_bool(req, "recursive"), get_bool(req, "includeEntry", "include_entry"));
  if (!w) return s.finish(w.error());
  if (!s.send(json{{"start", json::object()}})) return;
  std::optional<Clock::time_point> deadline;
  if (ctx.timeout.count() > 0) deadline = Clock::now() + ctx.timeout;
  auto next_keepalive = Clock::now() + ctx.keepalive;
  for (;;) {
    auto wake = next_keepalive;
    if (deadline && *deadline < wake) wake = *deadline;
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(wake - Clock::now()).count();
    // The client's socket too, so a client that goes away from a quiet
    // stream releases its watches now, not at the next keepalive write.
    struct pollfd pf[2] = {{(*w)->event_fd(), POLLIN, 0}, {c.fd(), POLLRDHUP, 0}};
    int r = ::poll(pf, 2, ms < 0 ? 0 : static_cast<int>(std::min<long long>(ms, 3600000)));
    if (r < 0 && errno != EINTR) return s.finish(rpc_errno("poll watcher of", path, errno));
    if (pf[1].revents & (POLLRDHUP | POLLHUP | POLLERR)) return;  // client gone
    if (stopping) return s.finish(rpc_error(Code::kUnavailable, "envd is shutting down"));
    if (pf[0].revents & POLLIN) {
      std::vector<json> evs;
      auto st = (*w)->take(&evs, 4096);
      if (!st) return s.finish(st.error());
      for (auto& e : evs)
        if (!s.send(json{{"filesystem", e}})) return;
      if (!evs.empty()) next_keepalive = Clock::now() + ctx.keepalive;
    }
    auto now = Clock::now();
    if (deadline && now >= *deadline) return s.finish(rpc_error(Code::kDeadlineExceeded, "context deadline exceeded"));
    if (now >= next_keepalive) {
      if (!s.send(json{{"keepalive", json::object()}})) return;
      next_keepalive = now + ctx.keepalive;
    }
  }
}

RpcResult<json> Server::Impl::unary_fs(const std::string& method, const json& req, const CallContext& ctx) {
  const std::string& home = ctx.user.home;
  if (method == "Stat") return fs_stat(resolve_path(home, get_string(req, "path")), users);
  if (method == "MakeDir") return fs_make_dir(resolve_path(home, get_string(req, "path")), ctx.user, users);
  if (method == "Move") {
    std::string src = get_string(req, "source"), dst = get_string(req, "destination");
    if (src.empty() || dst.empty()) return rpc_error(Code::kInvalidArgument, "Move needs source and destination");
    return fs_move(resolve_path(home, src), resolve_path(home, dst), ctx.user, users);
  }
  if (method == "ListDir") {
    auto depth = get_int(req, "depth", {}, 1);
    if (!depth || *depth < 0 || *depth > 1000) return rpc_error(Code::kInvalidArgument, "depth must be between 1 and 1000");
    return fs_list_dir(resolve_path(home, get_string(req, "path")), static_cast<int>(*depth ? *depth : 1), users);
  }
  if (method == "Remove") {
    auto st = fs_remove(resolve_path(home, get_string(req, "path")));
    if (!st) return st.error();
    return json::object();
  }
  if (method == "CreateWatcher") {
    std::string path = resolve_path(home, get_string(req, "path"));
    // The hub bounds watchers per sandbox, streams included.
    auto w = hub.watch(path, get_bool(req, "recursive"), get_bool(req, "includeEntry", "include_entry"));
    if (!w) return w.error();
    std::lock_guard<std::mutex> g(watch_mu);
    std::string id = sys::random_hex(16);
    watchers[id] = std::move(*w);
    return json{{"watcherId", id}};
  }
  if (method == "GetWatcherEvents" || method == "RemoveWatcher") {
    std::string id = get_string(req, "watcherId", "watcher_id");
    std::lock_guard<std::mutex> g(watch_mu);
    auto it = watchers.find(id);
    if (it == watchers.end()) return rpc_error(Code::kNotFound, "watcher '" + id + "' not found");
    if (method == "RemoveWatcher") {
      watchers.erase(it);
      return json::object();
    }
    std::vector<json> evs;
    auto st = it->second->take(&evs, 65536);
    if (!st) return st.error();
    json out = json::object();
    if (!evs.empty()) out["events"] = evs;
    return out;
  }
  return rpc_error(Code::kUnimplemented, "filesystem.Filesystem/" + method + " is not implemented");
}

}  // namespace sg::envd
