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

ControlPlane::ControlPlane(tenancy::Tenants& tenants, storage::Store& store, SandboxService& sandboxes,
                           builds::BuildService* builds, tenancy::RateLimiter& requests, tenancy::RateLimiter& creates,
                           ControlPlaneConfig cfg)
    : tenants_(tenants), store_(store), sandboxes_(sandboxes), builds_(builds), requests_(requests), creates_(creates),
      cfg_(std::move(cfg)) {}

namespace {
// The first segments of every path E2B's API has (the SDKs' OpenAPI
// schema); a path under one of them that no route serves is E2B's, and
// answered here (404 or 405), never passed on as envd traffic.
constexpr const char* kApiRoots[] = {"sandboxes", "v2", "v3", "templates", "snapshots", "secrets",
                                     "volumes",   "teams", "health"};
}  // namespace

bool ControlPlane::owns(const HttpRequest& req) {
  std::vector<std::string> seg = path_segments(req.path);
  if (seg.empty()) return false;
  for (const char* root : kApiRoots)
    if (seg[0] == root) return true;
  return false;
}

std::string ControlPlane::sandbox_id_of(const HttpRequest& req) {
  std::vector<std::string> seg = path_segments(req.path);
  size_t at = !seg.empty() && seg[0] == "v2" ? 1 : 0;
  if (seg.size() < at + 2 || seg[at] != "sandboxes") return {};
  // "/sandboxes/metrics" is E2B's list of metrics, not a sandbox.
  if (seg.size() == at + 2 && seg[at + 1] == "metrics") return {};
  return seg[at + 1];
}

// The routes: one row each, matched on method and path pattern ("{}"
// matches one non-empty segment, captured in order). Rows are tried in
// order, so a literal segment is listed before a capture in the same
// place. A path some row serves with another method is a 405 with Allow.
struct ControlPlane::Route {
  const char* method;
  const char* pattern;
  HttpResponse (ControlPlane::*serve)(const Call&);
};

const ControlPlane::Route ControlPlane::kRoutes[] = {
    {"POST", "/sandboxes", &ControlPlane::create},
    {"GET", "/sandboxes", &ControlPlane::list},
    {"POST", "/v2/sandboxes", &ControlPlane::create},
    {"GET", "/v2/sandboxes", &ControlPlane::list},
    {"GET", "/sandboxes/metrics", &ControlPlane::unsupported},
    {"GET", "/sandboxes/{}", &ControlPlane::get},
    {"DELETE", "/sandboxes/{}", &ControlPlane::kill},
    {"POST", "/sandboxes/{}/connect", &ControlPlane::connect},
    {"POST", "/v2/sandboxes/{}/connect", &ControlPlane::connect},
    // Deprecated in E2B's API (connect resumes); kept for old clients.
    {"POST", "/sandboxes/{}/resume", &ControlPlane::resume},
    {"POST", "/sandboxes/{}/pause", &ControlPlane::pause},
    {"PUT", "/sandboxes/{}/network", &ControlPlane::update_network},
    {"POST", "/sandboxes/{}/timeout", &ControlPlane::set_timeout},
    {"GET", "/sandboxes/{}/metrics", &ControlPlane::metrics},
    {"POST", "/sandboxes/{}/fork", &ControlPlane::fork},
    {"POST", "/sandboxes/{}/snapshots", &ControlPlane::snapshot},
    {"POST", "/sandboxes/{}/refreshes", &ControlPlane::unsupported},
    {"GET", "/sandboxes/{}/logs", &ControlPlane::unsupported},
    {"GET", "/v2/sandboxes/{}/logs", &ControlPlane::unsupported},
    {"GET", "/snapshots", &ControlPlane::list_snapshots},
    // Templates (api-e2b/templates.cpp).
    {"GET", "/templates", &ControlPlane::list_templates},
    {"GET", "/v2/templates", &ControlPlane::list_templates},
    {"POST", "/templates/tags", &ControlPlane::assign_tags},
    {"DELETE", "/templates/tags", &ControlPlane::remove_tags},
    {"GET", "/templates/aliases/{}", &ControlPlane::template_alias},
    {"GET", "/templates/{}", &ControlPlane::get_template},
    {"DELETE", "/templates/{}", &ControlPlane::delete_template},
    {"PATCH", "/templates/{}", &ControlPlane::update_template},
    {"PATCH", "/v2/templates/{}", &ControlPlane::update_template},
    {"GET", "/templates/{}/tags", &ControlPlane::template_tags},
    {"POST", "/v3/templates", &ControlPlane::request_build},
    {"GET", "/templates/{}/files/{}", &ControlPlane::file_link},
    {"POST", "/v2/templates/{}/builds/{}", &ControlPlane::start_build},
    {"GET", "/templates/{}/builds/{}/status", &ControlPlane::build_status},
    {"GET", "/templates/{}/builds/{}/logs", &ControlPlane::build_logs},
    // Upload links: authenticated by their signature (handle()).
    {"PUT", "/templates/uploads/{}/{}", &ControlPlane::unsupported},
    // The rest of E2B's API, not served by this server.
    {"GET", "/secrets", &ControlPlane::unsupported},
    {"POST", "/secrets", &ControlPlane::unsupported},
    {"GET", "/secrets/{}", &ControlPlane::unsupported},
    {"POST", "/secrets/{}", &ControlPlane::unsupported},
    {"DELETE", "/secrets/{}", &ControlPlane::unsupported},
    {"GET", "/volumes", &ControlPlane::unsupported},
    {"POST", "/volumes", &ControlPlane::unsupported},
    {"GET", "/volumes/{}", &ControlPlane::unsupported},
    {"DELETE", "/volumes/{}", &ControlPlane::unsupported},
    {"GET", "/teams", &ControlPlane::unsupported},
    {"GET", "/teams/{}/metrics", &ControlPlane::unsupported},
    {"GET", "/teams/{}/metrics/max", &ControlPlane::unsupported},
};

namespace {
// Matches path segments against a pattern's; the captures in order.
bool match(const std::vector<std::string>& pat, const std::vector<std::string>& seg, std::vector<std::string>* args) {
  if (pat.size() != seg.size()) return false;
  args->clear();
  for (size_t i = 0; i < pat.size(); ++i) {
    if (pat[i] == "{}") {
      args->push_back(seg[i]);
    } else if (pat[i] != seg[i]) {
      return false;
    }
  }
  return true;
}
}  // namespace

HttpResponse ControlPlane::handle(const HttpRequest& req) {
  std::vector<std::string> seg = path_segments(req.path);
  const std::string& m = req.method;
  if (seg.size() == 1 && seg[0] == "health") {
    if (m != "GET" && m != "HEAD") return http::json_error(405, "method " + m + " not allowed on /health");
    return http::no_content(200);
  }

  // An upload link carries its own signature and no key (the SDKs PUT to
  // it as to a storage bucket).
  if (m == "PUT" && builds::BuildService::is_upload_path(req.path)) return upload(req);

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
  return route(req, seg, *tenant);
}

HttpResponse ControlPlane::handle_as(const HttpRequest& req, const storage::TenantRow& tenant) {
  return route(req, path_segments(req.path), tenant);
}

HttpResponse ControlPlane::route(const HttpRequest& req, const std::vector<std::string>& seg,
                                 const storage::TenantRow& tenant) {
  const std::string& m = req.method;
  // Each route's pattern, split once.
  static const std::vector<std::vector<std::string>> kPatterns = [] {
    std::vector<std::vector<std::string>> p;
    for (const Route& r : kRoutes) p.push_back(path_segments(r.pattern));
    return p;
  }();
  bool v2 = !seg.empty() && seg[0] == "v2";
  std::string allow;
  std::vector<std::string> args;
  for (size_t i = 0; i < std::size(kRoutes); ++i) {
    const Route& r = kRoutes[i];
    if (!match(kPatterns[i], seg, &args)) continue;
    if (m != r.method) {
      if (allow.find(r.method) == std::string::npos) allow += (allow.empty() ? "" : ", ") + std::string(r.method);
      continue;
    }
    for (const std::string& a : args)
      if (a.size() > 256) return http::json_error(404, "no route for " + m + " " + req.path);
    static const std::string kNone;
    const std::string& id = args.empty() ? kNone : args[0];
    const std::string& arg2 = args.size() < 2 ? kNone : args[1];
    if (std::string_view(r.pattern).rfind("/sandboxes/{}", 0) == 0 && (id.empty() || id.size() > 64))
      return http::json_error(404, "sandbox \"" + id + "\" not found");
    return (this->*r.serve)(Call{req, tenant, id, v2, arg2, r.pattern});
  }
  if (allow.empty()) return http::json_error(404, "no route for " + m + " " + req.path);
  HttpResponse r = http::json_error(405, "method " + m + " not allowed on " + req.path);
  r.header("Allow", allow);
  return r;
}

HttpResponse ControlPlane::unsupported(const Call& c) {
  return http::json_error(501, c.req.method + " " + c.req.path + " is not supported by this server");
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
  j["lifecycle"] = {{"onTimeout", row->on_timeout == storage::kOnTimeoutPauseFiles ? "pause" : row->on_timeout},
                    {"autoResume", row->auto_resume}};
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
  Result<bool> keep_memory = parse_pause_request(c.req);
  if (!keep_memory) return error_response(keep_memory.error());
  if (Status s = sandboxes_.pause(c.tenant.id, c.id, *keep_memory); !s) return error_response(s.error());
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

// A snapshot as E2B names it: its template with the default tag, and
// the tenant's namespace for a named one.
static json snapshot_json(const storage::TenantRow& tenant, const storage::SnapshotRow& s) {
  if (s.name == s.template_id) return {{"snapshotID", s.template_id + ":default"}, {"names", json::array()}};
  std::string full = tenant.name + "/" + s.name + ":default";
  return {{"snapshotID", full}, {"names", json::array({full})}};
}

HttpResponse ControlPlane::snapshot(const Call& c) {
  Result<SnapshotRequest> req = parse_snapshot_request(c.req);
  if (!req) return error_response(req.error());
  Result<storage::SnapshotRow> s = sandboxes_.snapshot(c.tenant.id, c.id, req->name, req->memory);
  if (!s) return error_response(s.error());
  return http::json_body(201, dump(snapshot_json(c.tenant, *s)));
}

HttpResponse ControlPlane::list_snapshots(const Call& c) {
  Result<SnapshotQuery> q = parse_snapshots_query(c.req.query);
  if (!q) return error_response(q.error());
  // A name filter may be given as the snapshot id or its full name.
  std::string name = q->name;
  if (!name.empty())
    if (Result<storage::TemplateRef> r = storage::parse_template_ref(name); r) name = r->name;
  Result<std::vector<storage::SnapshotRow>> rows =
      store_.list_snapshots(c.tenant.id, q->sandbox_id, name, q->after_seq, q->limit + 1);
  if (!rows) return error_response(rows.error());
  bool more = static_cast<int64_t>(rows->size()) > q->limit;
  if (more) rows->resize(static_cast<size_t>(q->limit));
  json arr = json::array();
  for (const storage::SnapshotRow& s : *rows) arr.push_back(snapshot_json(c.tenant, s));
  HttpResponse r = http::json_body(200, dump(arr));
  if (more) r.header("X-Next-Token", std::to_string(rows->back().seq));
  return r;
}

HttpResponse ControlPlane::fork(const Call& c) {
  Result<ForkRequest> req = parse_fork_request(c.req);
  if (!req) return error_response(req.error());
  Result<std::vector<Result<storage::SandboxRow>>> forks =
      sandboxes_.fork(c.tenant, c.id, req->count, req->timeout_s);
  if (!forks) return error_response(forks.error());
  json arr = json::array();
  for (const Result<storage::SandboxRow>& f : *forks) {
    if (f) {
      arr.push_back({{"sandbox", sandbox_json(cfg_, *f)}});
    } else {
      HttpResponse e = error_response(f.error());
      json body = json::parse(e.body, nullptr, false);
      arr.push_back({{"error", body.is_object() ? body : json{{"code", e.status}, {"message", f.error().message()}}}});
    }
  }
  return http::json_body(201, dump(arr));
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
