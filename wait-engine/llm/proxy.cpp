// ModelProxy: routing, checks, the upstream exchange, held delivery.
#include "wait-engine/llm/proxy.h"

#include <poll.h>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/connect.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http/buffer_body.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/string_body.hpp>
#include <boost/beast/http/write.hpp>
#include <boost/beast/ssl/ssl_stream.hpp>
#include <nlohmann/json.hpp>

#include <array>
#include <deque>
#include <map>
#include <mutex>

#include "wait-engine/coordinator/coordinator.h"
#include "wait-engine/metrics/histogram.h"
#include "base/log.h"
#include "base/sys.h"

namespace sg::llm {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using tcp = asio::ip::tcp;
using json = nlohmann::json;

const char* provider_name(Provider p) { return p == Provider::kAnthropic ? "anthropic" : "openai"; }

std::optional<RouteInfo> classify(const http::HttpRequest& head) {
  const std::string& p = head.path;
  const std::string& m = head.method;
  bool post = m == "POST", get = m == "GET";
  if (post) {
    if (p == "/v1/chat/completions" || p == "/v1/responses" || p == "/v1/completions" || p == "/v1/embeddings")
      return RouteInfo{Provider::kOpenAI, p, true};
    if (p == "/v1/messages" || p == "/v1/messages/count_tokens") return RouteInfo{Provider::kAnthropic, p, true};
  }
  if (get && (p == "/v1/models" || p.rfind("/v1/models/", 0) == 0)) {
    std::string id = p.size() > 11 ? p.substr(11) : "";
    if (p.size() > 10 && (id.empty() || id.find('/') != std::string::npos)) return std::nullopt;
    bool anthropic = !head.header("anthropic-version").empty() || !head.header("x-api-key").empty();
    return RouteInfo{anthropic ? Provider::kAnthropic : Provider::kOpenAI, id.empty() ? "/v1/models" : "/v1/models/{id}",
                     false};
  }
  return std::nullopt;
}

namespace {

// SAX handler for inspect_request: notes the top-level "model" and
// "stream" members and checks the rest is well-formed.
class FieldsSax {
 public:
  explicit FieldsSax(RequestFields& f) : f_(f) {}
  bool null() { return value(Kind::kOther); }
  bool boolean(bool b) {
    if (at_top_key("stream")) f_.stream = b;
    return value(Kind::kBool);
  }
  bool number_integer(json::number_integer_t) { return value(Kind::kOther); }
  bool number_unsigned(json::number_unsigned_t) { return value(Kind::kOther); }
  bool number_float(json::number_float_t, const std::string&) { return value(Kind::kOther); }
  bool string(std::string& s) {
    if (at_top_key("model")) f_.model = s;
    return value(Kind::kString);
  }
  bool binary(json::binary_t&) { return value(Kind::kOther); }
  bool start_object(std::size_t) {
    if (depth_ == 0) f_.object = true;
    value(Kind::kOther);
    return ++depth_ <= kMaxDepth;
  }
  bool key(std::string& k) {
    if (depth_ == 1) key_ = k;
    return true;
  }
  bool end_object() {
    --depth_;
    return true;
  }
  bool start_array(std::size_t) {
    value(Kind::kOther);
    return ++depth_ <= kMaxDepth;
  }
  bool end_array() {
    --depth_;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) { return false; }

 private:
  enum class Kind { kString, kBool, kOther };
  static constexpr int kMaxDepth = 512;
  bool at_top_key(const char* k) const { return depth_ == 1 && key_ == k; }
  // A value at the top level of the object ends the current key.
  bool value(Kind kind) {
    if (depth_ == 1) {
      if (key_ == "model" && kind != Kind::kString) f_.model_not_string = true;
      if (key_ == "stream" && kind != Kind::kBool) f_.stream_not_bool = true;
      key_.clear();
    }
    return true;
  }
  RequestFields& f_;
  int depth_ = 0;
  std::string key_;
};

}  // namespace

RequestFields inspect_request(std::string_view body) {
  RequestFields f;
  FieldsSax sax(f);
  f.valid_json = json::sax_parse(body.begin(), body.end(), &sax, nlohmann::detail::input_format_t::json, true);
  if (!f.valid_json) f.object = false;
  return f;
}

std::string presented_key(const http::HttpRequest& req) {
  std::string k = req.header("x-api-key");
  if (!k.empty()) return k;
  std::string a = req.header("authorization");
  if (a.size() > 7 && (a.rfind("Bearer ", 0) == 0 || a.rfind("bearer ", 0) == 0)) return a.substr(7);
  return {};
}

http::HttpResponse provider_error(Provider p, int status, const std::string& message) {
  json body;
  if (p == Provider::kAnthropic) {
    const char* type = "api_error";
    switch (status) {
      case 400: case 405: case 505: type = "invalid_request_error"; break;
      case 401: type = "authentication_error"; break;
      case 403: type = "permission_error"; break;
      case 404: type = "not_found_error"; break;
      case 413: type = "request_too_large"; break;
      case 429: type = "rate_limit_error"; break;
      case 529: type = "overloaded_error"; break;
      default: break;
    }
    body = {{"type", "error"}, {"error", {{"type", type}, {"message", message}}}};
  } else {
    // 505 (wrong protocol) is the client's to fix.
    const char* type = status >= 500 && status != 505 ? "server_error" : "invalid_request_error";
    json code = nullptr;
    if (status == 401) code = "invalid_api_key";
    if (status == 404) code = "not_found";
    if (status == 429) {
      type = "rate_limit_exceeded";
      code = "rate_limit_exceeded";
    }
    body = {{"error", {{"message", message}, {"type", type}, {"param", nullptr}, {"code", code}}}};
  }
  http::HttpResponse r;
  r.status = status;
  r.content_type = "application/json";
  // Messages quote client input (a path, a sandbox id cut at 64 bytes) that
  // need not be UTF-8: replace bad bytes rather than throw (dump's default).
  r.body = body.dump(-1, ' ', false, json::error_handler_t::replace);
  return r;
}

namespace {

uint64_t now_ns() { return sys::monotonic_ns(); }

// One connection to an upstream: plain TCP or TLS.
struct UpConn {
  std::string key;
  bool tls = false;
  std::unique_ptr<beast::tcp_stream> plain;
  std::unique_ptr<beast::ssl_stream<beast::tcp_stream>> secure;
  beast::flat_buffer buf;
  uint64_t idle_since = 0;
  beast::tcp_stream& lowest() { return tls ? beast::get_lowest_layer(*secure) : *plain; }
  void close() {
    boost::system::error_code ec;
    lowest().socket().close(ec);
  }
};

bool hop_by_hop(const std::string& lower) {
  static const char* kDrop[] = {"connection", "keep-alive", "proxy-connection", "proxy-authorization",
                                "proxy-authenticate", "te", "trailer", "transfer-encoding", "upgrade",
                                "content-length", "host", "expect"};
  for (const char* d : kDrop)
    if (lower == d) return true;
  return false;
}

// Bytes held for delivery, and the gate that opens once every bound
// sandbox runs. Shared with the coordinator's callbacks.
struct Gate {
  explicit Gate(asio::any_io_executor ex) : timer(ex), ex(ex) {}
  asio::steady_timer timer;
  asio::any_io_executor ex;
  std::atomic<int> remaining{0};
  bool open = false;  // touched on the connection's executor only
};

// A client that goes away while the model thinks: the watch sets gone,
// closes the upstream connection in use and wakes a gate wait.
struct Cancel {
  bool gone = false;
  UpConn* current = nullptr;
  Gate* gate = nullptr;
};

struct Outcome {
  int status = 0;  // sent to the client (0: nothing sent)
  std::string outcome = "completed";
  TokenUsage usage;
  bool stopped = false;        // a bound sandbox was stopped when the response came
  uint64_t head_ns = 0;        // response head from upstream
  uint64_t delivered_ns = 0;   // first byte to the client
  uint64_t sent_ns = 0;        // request written upstream
  bool reusable = false;       // the upstream connection can be pooled
  bool retry = false;          // a pooled connection failed before any response byte
};

}  // namespace

struct ModelProxy::Impl {
  ProxyConfig cfg;
  ProxyDeps deps;
  asio::thread_pool blocking{4};
  asio::ssl::context tls_ctx{asio::ssl::context::tls_client};

  std::mutex pool_mu;
  std::map<std::string, std::deque<std::unique_ptr<UpConn>>> pool;  // GUARDED_BY(pool_mu)

  // Metrics.
  std::mutex m_mu;
  std::map<std::string, uint64_t> requests;  // GUARDED_BY(m_mu): "provider\noutcome\nstatus"
  std::map<std::string, uint64_t> tokens;    // GUARDED_BY(m_mu): "provider\nkind"
  metrics::Histogram upstream_ttfb{metrics::latency_bounds()};
  metrics::Histogram resume_to_delivery{metrics::latency_bounds()};
  metrics::Histogram held_to_delivery_all{metrics::latency_bounds()};
  std::atomic<uint64_t> in_flight{0};

  Impl(ProxyConfig c, ProxyDeps d) : cfg(c), deps(std::move(d)) {
    boost::system::error_code ec;
    tls_ctx.set_default_verify_paths(ec);
    if (ec) LOG_WARN("model proxy: system trust store: " << ec.message());
    tls_ctx.set_verify_mode(asio::ssl::verify_peer);
    tls_ctx.set_options(asio::ssl::context::default_workarounds | asio::ssl::context::no_sslv2 |
                        asio::ssl::context::no_sslv3 | asio::ssl::context::no_tlsv1 | asio::ssl::context::no_tlsv1_1);
  }
  ~Impl() { blocking.join(); }

  static std::string pool_key(const Upstream& u) {
    return std::string(u.tls ? "https://" : "http://") + u.host + ":" + std::to_string(u.port);
  }

  std::unique_ptr<UpConn> take(const std::string& key) {
    std::lock_guard<std::mutex> g(pool_mu);
    auto it = pool.find(key);
    if (it == pool.end()) return nullptr;
    uint64_t now = now_ns();
    while (!it->second.empty()) {
      std::unique_ptr<UpConn> c = std::move(it->second.back());
      it->second.pop_back();
      if (now - c->idle_since > static_cast<uint64_t>(cfg.idle_keepalive.count()) * 1000000ull) continue;
      // A kept-alive connection the upstream closed (or wrote to) is readable.
      struct pollfd p = {c->lowest().socket().native_handle(), POLLIN, 0};
      if (::poll(&p, 1, 0) != 0) continue;
      return c;
    }
    return nullptr;
  }

  void put(std::unique_ptr<UpConn> c) {
    if (c->buf.size() != 0) return;  // unexpected bytes after the response
    c->idle_since = now_ns();
    std::lock_guard<std::mutex> g(pool_mu);
    auto& q = pool[c->key];
    if (q.size() >= cfg.max_idle_per_upstream) q.pop_front();
    q.push_back(std::move(c));
  }

  void count(Provider p, const std::string& outcome, int status, const TokenUsage& u) {
    std::lock_guard<std::mutex> g(m_mu);
    ++requests[std::string(provider_name(p)) + "\n" + outcome + "\n" + std::to_string(status)];
    if (u.found) {
      tokens[std::string(provider_name(p)) + "\ninput"] += u.input;
      tokens[std::string(provider_name(p)) + "\noutput"] += u.output;
      tokens[std::string(provider_name(p)) + "\ncache_read"] += u.cache_read;
      tokens[std::string(provider_name(p)) + "\ncache_write"] += u.cache_write;
    }
  }

  asio::awaitable<Result<std::unique_ptr<UpConn>>> connect(const Upstream& u) {
    auto ex = co_await asio::this_coro::executor;
    auto c = std::make_unique<UpConn>();
    c->key = pool_key(u);
    c->tls = u.tls;
    boost::system::error_code ec;
    tcp::resolver resolver(ex);
    auto eps = co_await resolver.async_resolve(u.host, std::to_string(u.port), asio::redirect_error(asio::use_awaitable, ec));
    if (ec) co_return Error(ErrorKind::kUnavailable, "cannot resolve upstream host " + u.host + ": " + ec.message());
    if (u.tls) {
      c->secure = std::make_unique<beast::ssl_stream<beast::tcp_stream>>(ex, tls_ctx);
    } else {
      c->plain = std::make_unique<beast::tcp_stream>(ex);
    }
    beast::tcp_stream& low = c->lowest();
    low.expires_after(cfg.connect_timeout);
    co_await low.async_connect(eps, asio::redirect_error(asio::use_awaitable, ec));
    if (ec)
      co_return Error(ErrorKind::kUnavailable,
                      "cannot connect to upstream " + u.host + ":" + std::to_string(u.port) + ": " + ec.message());
    low.socket().set_option(tcp::no_delay(true), ec);
    if (u.tls) {
      if (!SSL_set_tlsext_host_name(c->secure->native_handle(), u.host.c_str()))
        co_return Error(ErrorKind::kUnavailable, "TLS SNI for " + u.host + " failed");
      c->secure->set_verify_callback(asio::ssl::host_name_verification(u.host));
      co_await c->secure->async_handshake(asio::ssl::stream_base::client, asio::redirect_error(asio::use_awaitable, ec));
      if (ec) co_return Error(ErrorKind::kUnavailable, "TLS handshake with upstream " + u.host + ": " + ec.message());
    }
    co_return c;
  }

  // Takes the request's body (no second copy of a large body).
  bhttp::request<bhttp::string_body> upstream_request(http::HttpRequest& req, const Upstream& u) {
    bhttp::request<bhttp::string_body> r;
    r.method_string(req.method);
    r.target(u.path_prefix + req.target);
    r.version(11);
    for (const auto& [k, v] : req.headers) {
      if (hop_by_hop(k) || k == "authorization" || k == "x-api-key" || k == "accept-encoding" ||
          k.rfind("x-sandgate-", 0) == 0)
        continue;
      r.insert(k, v);
    }
    bool v6 = u.host.find(':') != std::string::npos;
    std::string host = v6 ? "[" + u.host + "]" : u.host;
    if ((u.tls && u.port != 443) || (!u.tls && u.port != 80)) host += ":" + std::to_string(u.port);
    r.set(bhttp::field::host, host);
    r.set(bhttp::field::accept_encoding, "identity");
    if (u.provider == Provider::kAnthropic)
      r.set("x-api-key", u.api_key);
    else
      r.set(bhttp::field::authorization, "Bearer " + u.api_key);
    r.keep_alive(true);
    r.body() = std::move(req.body);
    r.prepare_payload();
    return r;
  }

  // The response is coming: starts resuming every bound sandbox and returns
  // the gate that opens once all of them run (open at once when none is
  // bound). *stopped: whether one of them was stopped.
  std::shared_ptr<Gate> open_gate(asio::any_io_executor ex, const std::vector<wait::WaitCoordinator::Ticket>& tickets,
                                  bool* stopped) {
    auto gate = std::make_shared<Gate>(ex);
    if (deps.coordinator && !tickets.empty()) {
      for (const auto& t : tickets) *stopped |= deps.coordinator->response_started(t);
      gate->remaining = static_cast<int>(tickets.size());
      for (const auto& t : tickets)
        deps.coordinator->when_deliverable(t, [gate] {
          if (--gate->remaining == 0) asio::post(gate->ex, [gate] { gate->timer.cancel(); });
        });
    }
    if (gate->remaining.load() == 0) gate->open = true;
    return gate;
  }

  // Waits until the gate opens (or the delivery timeout passes).
  asio::awaitable<void> await_gate(const std::shared_ptr<Gate>& gate, Cancel& cx) {
    const bool& client_gone = cx.gone;
    cx.gate = gate.get();
    uint64_t deadline = now_ns() + static_cast<uint64_t>(cfg.delivery_timeout.count()) * 1000000ull;
    while (!gate->open && !client_gone) {
      if (gate->remaining.load() == 0) {
        gate->open = true;
        break;
      }
      uint64_t now = now_ns();
      if (now >= deadline) {
        LOG_WARN("model proxy: a bound sandbox did not resume within " << cfg.delivery_timeout.count()
                                                                        << " ms; delivering anyway");
        gate->open = true;
        break;
      }
      gate->timer.expires_after(std::chrono::nanoseconds(deadline - now));
      boost::system::error_code ec;
      co_await gate->timer.async_wait(asio::redirect_error(asio::use_awaitable, ec));
    }
    cx.gate = nullptr;
  }

  // The request upstream and its answer to the client: a pooled
  // connection first, a fresh one when that fails before any response byte.
  asio::awaitable<Outcome> forward(http::HttpRequest& req, const Upstream& up, Provider prov,
                                   const std::vector<wait::WaitCoordinator::Ticket>& tickets,
                                   http::ResponseWriter& out) {
    // A client that leaves while the model thinks cancels the upstream call.
    Cancel cx;
    out.watch_closed([&cx] {
      cx.gone = true;
      if (cx.current) cx.current->close();
      if (cx.gate) cx.gate->timer.cancel();
    });
    bhttp::request<bhttp::string_body> ureq = upstream_request(req, up);
    Outcome o;
    for (int attempt = 0; attempt < 2; ++attempt) {
      std::unique_ptr<UpConn> c = attempt == 0 ? take(pool_key(up)) : nullptr;
      bool pooled = c != nullptr;
      if (!c) {
        Result<std::unique_ptr<UpConn>> fresh = co_await connect(up);
        if (!fresh) {
          o = Outcome{};
          o.outcome = cx.gone ? "client_gone" : "upstream_error";
          o.status = cx.gone ? 0 : -1;
          LOG_INFO("model proxy: " << fresh.error().message());
          break;
        }
        c = std::move(*fresh);
      }
      cx.current = c.get();
      if (c->tls)
        o = co_await exchange(*c->secure, *c, pooled, ureq, prov, tickets, out, cx);
      else
        o = co_await exchange(*c->plain, *c, pooled, ureq, prov, tickets, out, cx);
      cx.current = nullptr;
      if (o.reusable && !cx.gone) put(std::move(c));
      if (!o.retry) break;
    }
    out.unwatch_closed();
    // A failure before any response byte: answer 502, but only once the
    // bound sandboxes run again.
    if (o.status == -1) {
      co_await await_gate(open_gate(co_await asio::this_coro::executor, tickets, &o.stopped), cx);
      co_await out.respond(provider_error(prov, 502, std::string("the ") + provider_name(prov) +
                                                         " upstream could not be reached or broke off the response"));
      o.status = 502;
      o.outcome = "upstream_error";
    }
    if (o.stopped && o.delivered_ns && o.head_ns)
      resume_to_delivery.observe(static_cast<double>(o.delivered_ns - o.head_ns) / 1e9);
    if (o.delivered_ns && o.head_ns) held_to_delivery_all.observe(static_cast<double>(o.delivered_ns - o.head_ns) / 1e9);
    co_return o;
  }

  // Who is calling, and where to: from memory when the caches know, else
  // on the blocking pool (SQLite), back on the connection's executor after.
  asio::awaitable<Resolved> resolve(const http::HttpRequest& req, Provider prov) {
    if (deps.resolve_fast)
      if (std::optional<Resolved> fast = deps.resolve_fast(req, prov)) co_return std::move(*fast);
    auto ex = co_await asio::this_coro::executor;
    co_await asio::post(blocking, asio::use_awaitable);
    Result<Caller> c = deps.authenticate ? deps.authenticate(req, prov) : Result<Caller>(internal_error("no authenticator"));
    Result<std::optional<Upstream>> u = c && deps.upstream ? deps.upstream(c->tenant_id, prov)
                                                           : Result<std::optional<Upstream>>(std::nullopt);
    co_await asio::post(ex, asio::use_awaitable);
    co_return Resolved{std::move(c), std::move(u)};
  }

  // The tenant's budgets: requests per second, then tokens per minute.
  // The 429 to send, or nullopt.
  std::optional<http::HttpResponse> admit(Provider prov, const std::string& tenant_id) {
    int64_t wait_s = deps.admit_request ? deps.admit_request(tenant_id) : 0;
    const char* which = "request";
    if (wait_s <= 0 && deps.admit_tokens) {
      wait_s = deps.admit_tokens(tenant_id);
      which = "token";
    }
    if (wait_s <= 0) return std::nullopt;
    http::HttpResponse r = provider_error(prov, 429, std::string(which) + " rate limit reached for this tenant; retry later");
    r.header("retry-after", std::to_string(wait_s));
    return r;
  }

  // The waits end, with how the request ended; the longest pause of a
  // bound sandbox (ms), for the usage row.
  int64_t end_waits(const Outcome& o, const std::vector<wait::WaitCoordinator::Ticket>& tickets) {
    if (!deps.coordinator) return 0;
    wait::Outcome wo = o.outcome == "completed"     ? wait::Outcome::kCompleted
                       : o.outcome == "client_gone" ? wait::Outcome::kClientGone
                                                    : wait::Outcome::kUpstreamError;
    // An upstream error status is still a completed wait for the sandbox.
    if (o.outcome == "upstream_error" && o.status > 0 && o.status != 502) wo = wait::Outcome::kCompleted;
    int64_t paused_ms = 0;
    for (const auto& t : tickets)
      paused_ms = std::max<int64_t>(paused_ms, static_cast<int64_t>(deps.coordinator->end(t, wo) / 1000000));
    return paused_ms;
  }

  template <class S>
  asio::awaitable<Outcome> exchange(S& s, UpConn& c, bool pooled, bhttp::request<bhttp::string_body>& ureq,
                                    Provider prov, const std::vector<wait::WaitCoordinator::Ticket>& tickets,
                                    http::ResponseWriter& out, Cancel& cx) {
    const bool& client_gone = cx.gone;
    Outcome o;
    boost::system::error_code ec;
    beast::tcp_stream& low = c.lowest();
    low.expires_after(cfg.idle_timeout);
    co_await bhttp::async_write(s, ureq, asio::redirect_error(asio::use_awaitable, ec));
    if (ec) {
      o.outcome = client_gone ? "client_gone" : "upstream_error";
      o.retry = pooled && !client_gone;
      if (!o.retry && !client_gone) o.status = -1;  // the caller answers 502
      co_return o;
    }
    o.sent_ns = now_ns();
    bhttp::response_parser<bhttp::buffer_body> p;
    p.header_limit(64 * 1024);
    p.body_limit(boost::none);
    low.expires_after(cfg.first_byte_timeout);
    co_await bhttp::async_read_header(s, c.buf, p, asio::redirect_error(asio::use_awaitable, ec));
    if (ec) {
      o.outcome = client_gone ? "client_gone" : "upstream_error";
      o.retry = pooled && !client_gone && c.buf.size() == 0 &&
                (ec == bhttp::error::end_of_stream || ec == asio::error::eof || ec == asio::error::connection_reset);
      if (!o.retry && !client_gone) o.status = -1;  // the caller answers 502
      co_return o;
    }
    o.head_ns = now_ns();
    upstream_ttfb.observe(static_cast<double>(o.head_ns - o.sent_ns) / 1e9);
    // The response is coming: resume whatever was paused, now.
    std::shared_ptr<Gate> gate = open_gate(co_await asio::this_coro::executor, tickets, &o.stopped);

    auto& res = p.get();
    int status = static_cast<int>(res.result_int());
    std::vector<std::pair<std::string, std::string>> headers;
    for (const auto& f : res) {
      std::string name(f.name_string());
      std::string lower = name;
      for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
      if (hop_by_hop(lower)) continue;
      headers.emplace_back(std::move(name), std::string(f.value()));
    }
    std::optional<uint64_t> length;
    if (!res.chunked() && res.has_content_length()) length = *p.content_length();
    bool sse = false;
    if (auto ct = res.find(bhttp::field::content_type); ct != res.end())
      sse = beast::iequals(ct->value().substr(0, 17), "text/event-stream");
    bool success = status / 100 == 2;
    SseUsageScanner scanner(prov);
    std::string json_body;
    bool json_overflow = false;

    std::string pending;
    bool head_sent = false;
    auto deliver = [&](std::string_view piece) -> asio::awaitable<bool> {
      if (!head_sent) {
        head_sent = true;
        o.delivered_ns = now_ns();
        o.status = status;
        if (!co_await out.write_head(status, headers, length)) co_return false;
        if (!pending.empty()) {
          bool ok = co_await out.write_body(pending);
          pending.clear();
          if (!ok) co_return false;
        }
      }
      co_return co_await out.write_body(piece);
    };

    std::array<char, 64 * 1024> buf;
    bool broke = false;
    while (!p.is_done()) {
      if (!gate->open && pending.size() >= cfg.hold_limit) co_await await_gate(gate, cx);
      if (client_gone) break;
      res.body().data = buf.data();
      res.body().size = buf.size();
      low.expires_after(cfg.idle_timeout);
      co_await bhttp::async_read_some(s, c.buf, p, asio::redirect_error(asio::use_awaitable, ec));
      if (ec == bhttp::error::need_buffer) ec = {};
      if (ec) {
        broke = true;
        break;
      }
      size_t n = buf.size() - res.body().size;
      if (n == 0) continue;
      std::string_view piece(buf.data(), n);
      if (success) {
        if (sse) {
          scanner.feed(piece);
        } else if (!json_overflow) {
          if (json_body.size() + n > cfg.usage_json_limit) {
            json_overflow = true;
            json_body.clear();
          } else {
            json_body.append(piece);
          }
        }
      }
      if (gate->open) {
        if (!co_await deliver(piece)) {
          o.outcome = "client_gone";
          co_return o;
        }
      } else {
        pending.append(piece);
      }
    }
    if (client_gone) {
      o.outcome = "client_gone";
      co_return o;
    }
    if (!gate->open) co_await await_gate(gate, cx);
    if (client_gone) {
      o.outcome = "client_gone";
      co_return o;
    }
    if (broke) {
      // The upstream broke off mid-body: pass on what came, then end the
      // connection without completing the framing, so the client sees a
      // truncated response rather than a complete one.
      if (!head_sent) {
        if (pending.empty()) {
          o.status = -1;
          o.outcome = "upstream_error";
          co_return o;
        }
        (void)co_await deliver({});
      } else if (!pending.empty()) {
        (void)co_await out.write_body(pending);
      }
      o.outcome = "upstream_error";
      co_return o;
    }
    if (!head_sent && !co_await deliver({})) {
      o.outcome = "client_gone";
      co_return o;
    }
    if (!co_await out.finish()) {
      o.outcome = "client_gone";
      co_return o;
    }
    if (success) {
      if (sse) {
        scanner.finish();
        o.usage = scanner.usage();
      } else if (!json_overflow) {
        o.usage = usage_from_json(prov, json_body);
      }
    }
    o.outcome = success ? "completed" : "upstream_error";
    o.reusable = res.keep_alive();
    co_return o;
  }
};

ModelProxy::ModelProxy(ProxyConfig cfg, ProxyDeps deps) : impl_(std::make_unique<Impl>(cfg, std::move(deps))) {}
ModelProxy::~ModelProxy() = default;

http::StreamHooks ModelProxy::hooks(size_t body_limit) {
  http::StreamHooks h;
  h.owns = [](const http::HttpRequest& head) { return classify(head).has_value(); };
  h.body_limit = body_limit;
  h.error = [](const http::HttpRequest& head, int status, const std::string& msg) {
    auto ri = classify(head);
    return provider_error(ri ? ri->provider : Provider::kOpenAI, status, msg);
  };
  h.serve = [this](http::HttpRequest req, http::ResponseWriter& out) { return serve(std::move(req), out); };
  // The caller is known before its body is read: an unknown key is refused
  // here and holds none of the body budget; a known one is charged to its
  // tenant's share. serve() finds the caller again in the key cache.
  h.share_budget = std::max<size_t>(body_limit, (h.body_budget / 4));
  h.authorize = [this](const http::HttpRequest& head) -> http::Authorized {
    http::Authorized a;
    auto ri = classify(head);
    Provider p = ri ? ri->provider : Provider::kOpenAI;
    if (!impl_->deps.authenticate) return a;
    Result<Caller> c = impl_->deps.authenticate(head, p);
    if (!c) {
      ErrorKind k = c.error().kind();
      int status = k == ErrorKind::kUnauthorized ? 401 : k == ErrorKind::kNotFound ? 404 : k == ErrorKind::kInvalid ? 400 : 503;
      a.refusal = provider_error(p, status, http::client_message(c.error()));
      return a;
    }
    a.share = c->tenant_id;
    return a;
  };
  h.precheck = [this](const http::HttpRequest& head) -> std::optional<http::HttpResponse> {
    if (!head.bound_sandbox.empty() || !impl_->deps.key_well_formed) return std::nullopt;
    auto ri = classify(head);
    Provider p = ri ? ri->provider : Provider::kOpenAI;
    std::string key = presented_key(head);
    if (key.empty())
      return provider_error(p, 401, "missing API key: pass a sandgate model key (sk-sg-...) as Authorization: Bearer or x-api-key");
    if (!impl_->deps.key_well_formed(key))
      return provider_error(p, 401, "invalid model API key: use a sandgate key (sk-sg-...) from `sandgate llm key create`");
    return std::nullopt;
  };
  return h;
}

namespace {

// The body's fields into rec (model, stream): a JSON object naming the
// model. Returns the 400's message when the body is not one.
std::optional<std::string> read_fields(const http::HttpRequest& req, const RouteInfo& ri, UsageRecord& rec) {
  if (!ri.needs_body) {
    if (ri.route == "/v1/models/{id}") rec.model = req.path.substr(11, 256);
    return std::nullopt;
  }
  RequestFields f = inspect_request(req.body);
  if (!f.valid_json || !f.object)
    return req.body.empty() ? "the request needs a JSON body"
           : !f.valid_json  ? "the request body is not valid JSON (or nests deeper than 512)"
                            : "the request body is not a JSON object";
  if (f.model_not_string || !f.model || f.model->empty()) return "the request body needs a \"model\" string";
  rec.model = f.model->substr(0, 256);
  if (f.stream_not_bool) return "\"stream\" must be a boolean";
  rec.stream = f.stream.value_or(false);
  return std::nullopt;
}

}  // namespace

asio::awaitable<void> ModelProxy::serve(http::HttpRequest req, http::ResponseWriter& out) {
  Impl& m = *impl_;
  uint64_t t0 = now_ns();
  std::optional<RouteInfo> ri = classify(req);
  if (!ri) {
    co_await out.respond(provider_error(Provider::kOpenAI, 404, "unknown model API route " + req.path));
    co_return;
  }
  Provider prov = ri->provider;
  m.in_flight.fetch_add(1);
  struct Dec {
    std::atomic<uint64_t>& n;
    ~Dec() { n.fetch_sub(1); }
  } dec{m.in_flight};

  UsageRecord rec;
  rec.at_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                  std::chrono::system_clock::now().time_since_epoch())
                  .count();
  rec.provider = prov;
  rec.route = ri->route;
  auto finish_rec = [&](int status, const std::string& outcome) {
    rec.status = status;
    rec.outcome = outcome;
    rec.duration_ms = static_cast<int64_t>((now_ns() - t0) / 1000000);
    m.count(prov, outcome, status, rec.usage);
    if (!rec.tenant_id.empty() && m.deps.record) m.deps.record(rec);
  };
  auto refuse = [&](int status, const std::string& msg) -> asio::awaitable<void> {
    co_await out.respond(provider_error(prov, status, msg));
    finish_rec(status, "refused");
  };

  Resolved who = co_await m.resolve(req, prov);
  Result<Caller>& caller = who.caller;
  Result<std::optional<Upstream>>& up = who.upstream;
  if (!caller) {
    ErrorKind k = caller.error().kind();
    int status = k == ErrorKind::kUnauthorized ? 401 : k == ErrorKind::kNotFound ? 404 : k == ErrorKind::kInvalid ? 400 : 500;
    co_await out.respond(provider_error(prov, status, http::client_message(caller.error())));
    m.count(prov, "refused", status, {});
    co_return;
  }
  rec.tenant_id = caller->tenant_id;
  if (!caller->sandboxes.empty()) rec.sandbox_id = caller->sandboxes.front();

  if (std::optional<std::string> bad = read_fields(req, *ri, rec)) {
    co_await refuse(400, *bad);
    co_return;
  }

  if (!up) {
    co_await refuse(500, "upstream configuration: " + http::client_message(up.error()));
    co_return;
  }
  if (!*up) {
    co_await refuse(503, std::string("no ") + provider_name(prov) +
                             " upstream is configured for this tenant (sandgate llm upstream set, or --" +
                             provider_name(prov) + "-base-url)");
    co_return;
  }
  if (std::optional<http::HttpResponse> r = m.admit(prov, caller->tenant_id)) {
    co_await out.respond(std::move(*r));
    finish_rec(429, "refused");
    co_return;
  }

  // The wait begins for every bound sandbox.
  std::vector<wait::WaitCoordinator::Ticket> tickets;
  if (m.deps.coordinator)
    for (const std::string& sb : caller->sandboxes)
      tickets.push_back(m.deps.coordinator->begin(sb, caller->tenant_id + "\n" + rec.model));

  Outcome o = co_await m.forward(req, **up, prov, tickets, out);
  rec.wait_paused_ms = m.end_waits(o, tickets);
  rec.usage = o.usage;
  if (o.usage.found && m.deps.charge_tokens) m.deps.charge_tokens(caller->tenant_id, o.usage.input + o.usage.output);
  finish_rec(o.status, o.outcome);
}

void ModelProxy::shutdown() {
  std::lock_guard<std::mutex> g(impl_->pool_mu);
  impl_->pool.clear();
}

void ModelProxy::render_metrics(std::string& out) const {
  using namespace metrics;
  Impl& m = *impl_;
  std::map<std::string, uint64_t> req, tok;
  {
    std::lock_guard<std::mutex> g(m.m_mu);
    req = m.requests;
    tok = m.tokens;
  }
  render_header(out, "sandgate_llm_requests_total", "counter", "Model API requests, by provider, outcome and status.");
  for (const auto& [k, v] : req) {
    size_t a = k.find('\n'), b = k.find('\n', a + 1);
    render_sample(out, "sandgate_llm_requests_total",
                  "provider=\"" + k.substr(0, a) + "\",outcome=\"" + k.substr(a + 1, b - a - 1) + "\",status=\"" +
                      k.substr(b + 1) + "\"",
                  static_cast<double>(v));
  }
  render_header(out, "sandgate_llm_tokens_total", "counter", "Tokens reported by upstream responses.");
  for (const auto& [k, v] : tok) {
    size_t a = k.find('\n');
    render_sample(out, "sandgate_llm_tokens_total", "provider=\"" + k.substr(0, a) + "\",kind=\"" + k.substr(a + 1) + "\"",
                  static_cast<double>(v));
  }
  render_header(out, "sandgate_llm_in_flight", "gauge", "Model API requests in progress.");
  render_sample(out, "sandgate_llm_in_flight", "", static_cast<double>(m.in_flight.load()));
  m.upstream_ttfb.render(out, "sandgate_llm_upstream_first_byte_seconds", "Request sent upstream to response head.");
  m.resume_to_delivery.render(out, "sandgate_llm_resume_to_delivery_seconds",
                              "Response head from upstream to first byte delivered, for waits that had paused the sandbox.");
  m.held_to_delivery_all.render(out, "sandgate_llm_head_to_delivery_seconds",
                                "Response head from upstream to first byte delivered, all requests.");
}

}  // namespace sg::llm
