// Control-plane routes and their JSON mapping (docs/api.md).
#include "api-e2b/control_plane.h"

#include <nlohmann/json.hpp>

#include "api-e2b/requests.h"
#include "base/log.h"
#include "base/sys.h"

namespace sg::api {

using http::HttpRequest;
using http::HttpResponse;
using json = nlohmann::json;

int status_for(const Error& e) {
  switch (e.kind()) {
    case ErrorKind::kInvalid: return 400;
    case ErrorKind::kUnauthorized: return 401;
    case ErrorKind::kNotFound: return 404;
    case ErrorKind::kConflict: return 409;
    case ErrorKind::kQuota: return 429;
    case ErrorKind::kUnavailable: return 503;
    case ErrorKind::kTimeout: return 504;
    case ErrorKind::kInternal: return 500;
  }
  return 500;
}

HttpResponse error_response(const Error& e) {
  // An internal error's message names internals (SQL statements, host
  // paths, syscalls): it goes to the log under a reference the client gets.
  HttpResponse r = http::json_error(status_for(e), http::client_message(e));
  if (e.kind() == ErrorKind::kQuota) r.header("Retry-After", "1");
  if (e.kind() == ErrorKind::kUnavailable) r.header("Retry-After", "5");
  return r;
}

namespace {


std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

json parse_metadata(const std::string& s) {
  json j = json::parse(s, nullptr, false);
  return j.is_object() ? j : json::object();
}

json sandbox_json(const ControlPlaneConfig& cfg, const storage::SandboxRow& r) {
  json j = {{"sandboxID", r.id},
            {"templateID", r.template_id},
            {"clientID", cfg.client_id},
            {"envdVersion", r.envd_version},
            {"envdAccessToken", r.envd_token},
            {"trafficAccessToken", r.traffic_token ? json(*r.traffic_token) : json(nullptr)},
            {"domain", cfg.domain ? json(*cfg.domain) : json(nullptr)}};
  if (r.alias) j["alias"] = *r.alias;
  return j;
}

json listed_json(const ControlPlaneConfig& cfg, const storage::SandboxRow& r) {
  json j = {{"sandboxID", r.id},
            {"templateID", r.template_id},
            {"clientID", cfg.client_id},
            {"startedAt", sys::format_rfc3339(r.started_at)},
            {"endAt", sys::format_rfc3339(r.end_at)},
            {"cpuCount", r.cpu_count},
            {"memoryMB", r.memory_mb},
            {"diskSizeMB", r.disk_size_mb},
            {"envdVersion", r.envd_version},
            {"state", r.state},
            {"metadata", parse_metadata(r.metadata)}};
  if (r.alias) j["alias"] = *r.alias;
  return j;
}

}  // namespace

ControlPlane::ControlPlane(tenancy::Tenants& tenants, SandboxService& sandboxes, tenancy::RateLimiter& requests,
                           tenancy::RateLimiter& creates, ControlPlaneConfig cfg)
    : tenants_(tenants), sandboxes_(sandboxes), requests_(requests), creates_(creates), cfg_(std::move(cfg)) {}

bool ControlPlane::owns(const HttpRequest& req) {
  const std::string& p = req.path;
  auto starts = [&](const char* pre) { return p.rfind(pre, 0) == 0; };
  return p == "/sandboxes" || starts("/sandboxes/") || p == "/v2/sandboxes" || starts("/v2/sandboxes/") ||
         p == "/health";
}

// The routes: one row each, matched on method, version and path shape.
// A path some row serves with another method is a 405 with Allow.
struct ControlPlane::Route {
  enum Shape { kCollection, kSandbox, kAction } shape;
  const char* action;  // kAction: the last segment
  const char* method;
  bool v1, v2;  // served under /sandboxes, under /v2/sandboxes
  HttpResponse (ControlPlane::*serve)(const Call&);
};

const ControlPlane::Route ControlPlane::kRoutes[] = {
    {Route::kCollection, "", "POST", true, true, &ControlPlane::create},
    {Route::kCollection, "", "GET", true, true, &ControlPlane::list},
    {Route::kSandbox, "", "GET", true, false, &ControlPlane::get},
    {Route::kSandbox, "", "DELETE", true, false, &ControlPlane::kill},
    {Route::kAction, "connect", "POST", true, true, &ControlPlane::connect},
    // Deprecated in E2B's API (connect resumes); kept for old clients.
    {Route::kAction, "resume", "POST", true, false, &ControlPlane::resume},
    {Route::kAction, "pause", "POST", true, false, &ControlPlane::pause},
    {Route::kAction, "network", "PUT", true, false, &ControlPlane::update_network},
    {Route::kAction, "timeout", "POST", true, false, &ControlPlane::set_timeout},
    {Route::kAction, "metrics", "GET", true, false, &ControlPlane::metrics},
};

HttpResponse ControlPlane::handle(const HttpRequest& req) {
  std::vector<std::string> seg = path_segments(req.path);
  const std::string& m = req.method;
  if (seg.size() == 1 && seg[0] == "health") {
    if (m != "GET" && m != "HEAD") return http::json_error(405, "method " + m + " not allowed on /health");
    return http::no_content(200);
  }

  // Authentication, then the tenant's request budget.
  std::string key = req.header("x-api-key");
  if (key.empty()) return http::json_error(401, "missing API key: set the X-API-KEY header");
  Result<storage::TenantRow> tenant = tenants_.authenticate(key);
  if (!tenant) return error_response(tenant.error());
  if (int64_t wait = requests_.acquire(tenant->id); wait > 0) {
    HttpResponse r = http::json_error(429, "rate limit exceeded: too many requests for this team; retry later");
    r.header("Retry-After", std::to_string(wait));
    return r;
  }

  bool v2 = !seg.empty() && seg[0] == "v2";
  size_t base = v2 ? 1 : 0;
  if (seg.size() <= base || seg[base] != "sandboxes") return http::json_error(404, "no route for " + req.path);
  size_t n = seg.size() - base;  // segments from "sandboxes" on
  if (n > 3) return http::json_error(404, "no route for " + m + " " + req.path);
  Route::Shape shape = n == 1 ? Route::kCollection : n == 2 ? Route::kSandbox : Route::kAction;
  static const std::string kNone;
  const std::string& id = n >= 2 ? seg[base + 1] : kNone;
  const std::string& action = n == 3 ? seg[base + 2] : kNone;
  if (n >= 2 && (id.empty() || id.size() > 64)) return http::json_error(404, "sandbox \"" + id + "\" not found");

  std::string allow;
  for (const Route& r : kRoutes) {
    if (r.shape != shape || (v2 ? !r.v2 : !r.v1) || action != r.action) continue;
    if (m == r.method) return (this->*r.serve)(Call{req, *tenant, id, v2});
    allow += (allow.empty() ? "" : ", ") + std::string(r.method);
  }
  if (allow.empty()) return http::json_error(404, "no route for " + m + " " + req.path);
  HttpResponse r = http::json_error(405, "method " + m + " not allowed on " + req.path);
  r.header("Allow", allow);
  return r;
}

HttpResponse ControlPlane::create(const Call& c) {
  if (int64_t wait = creates_.acquire(c.tenant.id); wait > 0) {
    HttpResponse r = http::json_error(429, "rate limit exceeded: too many sandbox creates; retry later");
    r.header("Retry-After", std::to_string(wait));
    return r;
  }
  Result<CreateParams> p = parse_create_request(c.req, c.v2);
  if (!p) return error_response(p.error());
  Result<storage::SandboxRow> row = sandboxes_.create(c.tenant, *p);
  if (!row) return error_response(row.error());
  return http::json_body(201, dump(sandbox_json(cfg_, *row)));
}

HttpResponse ControlPlane::list(const Call& c) {
  Result<storage::SandboxQuery> parsed = parse_list_query(c.req.query, c.v2);
  if (!parsed) return error_response(parsed.error());
  storage::SandboxQuery sq = std::move(*parsed);
  sq.tenant_id = c.tenant.id;
  int64_t want = sq.limit;
  sq.limit = want + 1;
  Result<std::vector<storage::SandboxRow>> rows = sandboxes_.list(sq);
  if (!rows) return error_response(rows.error());
  bool more = static_cast<int64_t>(rows->size()) > want;
  if (more) rows->resize(static_cast<size_t>(want));
  json arr = json::array();
  for (const auto& row : *rows) arr.push_back(listed_json(cfg_, row));
  HttpResponse r = http::json_body(200, dump(arr));
  if (c.v2 && more) r.header("X-Next-Token", std::to_string(rows->back().seq));
  return r;
}

HttpResponse ControlPlane::get(const Call& c) {
  Result<storage::SandboxRow> row = sandboxes_.get(c.tenant.id, c.id);
  if (!row) return error_response(row.error());
  json j = listed_json(cfg_, *row);
  j["envdAccessToken"] = row->envd_token;
  j["domain"] = cfg_.domain ? json(*cfg_.domain) : json(nullptr);
  j["allowInternetAccess"] = row->allow_internet ? json(*row->allow_internet) : json(nullptr);
  j["lifecycle"] = {{"onTimeout", row->on_timeout}, {"autoResume", row->auto_resume}};
  if (std::optional<NetworkParams> net = sandboxes_.network(c.id);
      net && (!net->allow_out.empty() || !net->deny_out.empty()))
    j["network"] = {{"allowOut", net->allow_out}, {"denyOut", net->deny_out}};
  return http::json_body(200, dump(j));
}

HttpResponse ControlPlane::kill(const Call& c) {
  if (Status s = sandboxes_.kill(c.tenant.id, c.id); !s) return error_response(s.error());
  return http::no_content(204);
}

HttpResponse ControlPlane::connect(const Call& c) {
  Result<std::optional<int64_t>> timeout = parse_connect_request(c.req);
  if (!timeout) return error_response(timeout.error());
  Result<SandboxService::Connected> done = sandboxes_.connect(c.tenant.id, c.id, timeout->value_or(300));
  if (!done) return error_response(done.error());
  return http::json_body(done->resumed ? 201 : 200, dump(sandbox_json(cfg_, done->row)));
}

HttpResponse ControlPlane::resume(const Call& c) {
  Result<std::optional<int64_t>> timeout = parse_resume_request(c.req);
  if (!timeout) return error_response(timeout.error());
  Result<storage::SandboxRow> row = sandboxes_.get(c.tenant.id, c.id);
  if (!row) return error_response(row.error());
  if (row->state != storage::kStatePaused)
    return http::json_error(409, "sandbox \"" + c.id + "\" is already running");
  Result<SandboxService::Connected> done = sandboxes_.connect(c.tenant.id, c.id, timeout->value_or(15));
  if (!done) return error_response(done.error());
  return http::json_body(201, dump(sandbox_json(cfg_, done->row)));
}

HttpResponse ControlPlane::pause(const Call& c) {
  if (Status s = parse_pause_request(c.req); !s) return error_response(s.error());
  if (Status s = sandboxes_.pause(c.tenant.id, c.id); !s) return error_response(s.error());
  return http::no_content(204);
}

HttpResponse ControlPlane::update_network(const Call& c) {
  Result<NetworkParams> net = parse_network_update(c.req);
  if (!net) return error_response(net.error());
  if (Status s = sandboxes_.update_network(c.tenant.id, c.id, *net); !s) return error_response(s.error());
  return http::no_content(204);
}

HttpResponse ControlPlane::set_timeout(const Call& c) {
  Result<int64_t> timeout = parse_timeout_request(c.req);
  if (!timeout) return error_response(timeout.error());
  if (Status s = sandboxes_.set_timeout(c.tenant.id, c.id, *timeout); !s) return error_response(s.error());
  return http::no_content(204);
}

HttpResponse ControlPlane::metrics(const Call& c) {
  Result<MetricsRange> range = parse_metrics_query(c.req.query);
  if (!range) return error_response(range.error());
  Result<std::vector<MetricSample>> ms = sandboxes_.metrics(c.tenant.id, c.id, range->start, range->end);
  if (!ms) return error_response(ms.error());
  Result<storage::SandboxRow> row = sandboxes_.get(c.tenant.id, c.id);
  int64_t cpus = row ? row->cpu_count : 0;
  json arr = json::array();
  for (const MetricSample& s : *ms)
    arr.push_back({{"timestamp", sys::format_rfc3339(s.unix_s)},
                   {"timestampUnix", s.unix_s},
                   {"cpuCount", cpus},
                   {"cpuUsedPct", s.cpu_used_pct},
                   {"memUsed", s.usage.mem_used_bytes},
                   {"memTotal", s.usage.mem_limit_bytes},
                   {"memCache", s.usage.mem_cache_bytes},
                   {"memPool", s.pool_bytes},
                   {"diskUsed", s.usage.disk_used_bytes},
                   {"diskTotal", row ? static_cast<uint64_t>(row->disk_size_mb) << 20 : 0}});
  return http::json_body(200, dump(arr));
}

}  // namespace sg::api
