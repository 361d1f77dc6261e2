// ModelProxy: the OpenAI- and Anthropic-compatible model API proxy
// (issue 5, docs/llm-gateway.md).
//
// Routes (HTTP/1.1, on the gateway's listener and on every sandbox's
// in-sandbox address 127.0.0.1:49982):
//   OpenAI:    POST /v1/chat/completions, /v1/responses, /v1/completions,
//              /v1/embeddings; GET /v1/models, /v1/models/{id}
//   Anthropic: POST /v1/messages, /v1/messages/count_tokens;
//              GET /v1/models[/{id}] with anthropic-version or x-api-key
// A request is authenticated (a virtual key, or the sandbox channel it came
// over), checked (JSON object with a "model"), rate limited per tenant
// (requests and tokens), then forwarded to the tenant's upstream for the
// provider with the gateway's provider key; the response — status, headers
// and body, streamed or not — goes back unchanged, piece by piece.
//
// Waits: a request bound to sandboxes (its channel, or the
// X-Sandgate-Sandbox header) is a wait for each of them: the coordinator
// may pause them while it lasts; once the response is coming they are
// resumed and nothing is delivered before they run again. Bytes that arrive
// meanwhile are held (at most hold_limit; then upstream reads stop).
//
// Errors made by the proxy itself are in the provider's shape
// (provider_error()); upstream errors pass through unchanged.
//
// Threads: serve() runs on the client connection's strand. Blocking
// lookups (SQLite) run on the proxy's own small pool.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/http/stream_handler.h"
#include "wait-engine/llm/usage.h"
#include "base/status.h"

namespace sg::wait {
class WaitCoordinator;
}

namespace sg::llm {

inline constexpr const char* kBindHeader = "x-sandgate-sandbox";

const char* provider_name(Provider p);

struct RouteInfo {
  Provider provider;
  std::string route;  // the path template, e.g. "/v1/chat/completions", "/v1/models/{id}"
  bool needs_body;    // POST with a JSON body carrying "model"
};
// Which model API route a request head is, if any (method included).
std::optional<RouteInfo> classify(const http::HttpRequest& head);

// What the proxy needs from a request body, read with a streaming (SAX)
// parse: no document is built, so a large body costs no more than itself;
// nesting deeper than 512 is refused.
struct RequestFields {
  bool valid_json = false;
  bool object = false;          // the top level is an object
  std::optional<std::string> model;  // top-level "model", when a string
  bool model_not_string = false;
  std::optional<bool> stream;   // top-level "stream", when a boolean
  bool stream_not_bool = false;
};
RequestFields inspect_request(std::string_view body);

// The credential a client presents: x-api-key, else Authorization: Bearer.
std::string presented_key(const http::HttpRequest& req);

// The provider's error body and status for an error made by the proxy.
http::HttpResponse provider_error(Provider p, int status, const std::string& message);

struct Upstream {
  Provider provider;
  bool tls = true;
  std::string host;
  uint16_t port = 443;
  std::string path_prefix;  // "" or "/something" (no trailing '/')
  std::string api_key;      // never logged
};

// Who is calling: resolved by Deps::authenticate.
struct Caller {
  std::string tenant_id;
  std::vector<std::string> sandboxes;  // waits are coordinated for these
};

struct UsageRecord {
  int64_t at_ms = 0;
  std::string tenant_id;
  std::optional<std::string> sandbox_id;
  Provider provider = Provider::kOpenAI;
  std::string route, model;
  bool stream = false;
  int status = 0;
  std::string outcome;  // completed | upstream_error | client_gone | cancelled | refused
  TokenUsage usage;
  int64_t duration_ms = 0;
  int64_t wait_paused_ms = 0;
};

struct ProxyConfig {
  std::chrono::milliseconds connect_timeout{10000};
  // From the request sent to the response head (models think for long).
  std::chrono::milliseconds first_byte_timeout{600000};
  // Between two reads of the response body.
  std::chrono::milliseconds idle_timeout{300000};
  size_t hold_limit = 4 << 20;          // bytes held while the sandbox resumes
  size_t usage_json_limit = 16 << 20;   // non-streamed bodies scanned for usage up to this
  std::chrono::milliseconds delivery_timeout{30000};  // at most this long waiting for a resume
  size_t max_idle_per_upstream = 64;   // kept-alive upstream connections
  std::chrono::milliseconds idle_keepalive{30000};
};

struct Resolved {
  Result<Caller> caller;
  Result<std::optional<Upstream>> upstream;
};

struct ProxyDeps {
  // Blocking (SQLite); run on the proxy's pool. Errors: kUnauthorized
  // (missing or wrong key), kNotFound / kInvalid (a binding naming a
  // sandbox the tenant does not have, or malformed).
  std::function<Result<Caller>(const http::HttpRequest& req, Provider p)> authenticate;
  // Blocking. nullopt: no upstream for this tenant and provider.
  std::function<Result<std::optional<Upstream>>(const std::string& tenant_id, Provider p)> upstream;
  // Non-blocking: both answers from memory (caches), or nullopt to take the
  // blocking path above on the pool. Optional.
  std::function<std::optional<Resolved>(const http::HttpRequest& req, Provider p)> resolve_fast;
  // Whether a presented key could be a virtual key at all (its format):
  // checked before the body is read, so malformed credentials cost nothing.
  std::function<bool(std::string_view key)> key_well_formed;
  // Non-blocking: queue the row.
  std::function<void(UsageRecord)> record;
  // Requests per tenant: 0 = allowed, else seconds to wait (Retry-After).
  std::function<int64_t(const std::string& tenant_id)> admit_request;
  // Tokens per tenant: 0 = allowed now; charge() after the response.
  std::function<int64_t(const std::string& tenant_id)> admit_tokens;
  std::function<void(const std::string& tenant_id, uint64_t tokens)> charge_tokens;
  wait::WaitCoordinator* coordinator = nullptr;  // null: no wait management
};

class ModelProxy {
 public:
  ModelProxy(ProxyConfig cfg, ProxyDeps deps);
  ~ModelProxy();
  ModelProxy(const ModelProxy&) = delete;
  ModelProxy& operator=(const ModelProxy&) = delete;

  // The hooks for http::HttpServer.
  http::StreamHooks hooks(size_t body_limit);

  boost::asio::awaitable<void> serve(http::HttpRequest req, http::ResponseWriter& out);

  // Appends the proxy's series in Prometheus text format.
  void render_metrics(std::string& out) const;

  // Closes the kept-alive upstream connections. Call after the HttpServer
  // stopped and before it is destroyed (the sockets belong to its
  // io_context); the proxy itself must outlive the server's destruction,
  // which destroys the suspended request coroutines.
  void shutdown();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace sg::llm
