// Control-plane routes and their JSON mapping (docs/api.md).
#include "api-e2b/control_plane.h"

#include <nlohmann/json.hpp>

#include "api-e2b/requests.h"
#include "sys/log.h"
#include "sys/sys.h"

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
  const std::string& tid = tenant->id;

  auto sandbox_json = [&](const storage::SandboxRow& r) {
    json j = {{"sandboxID", r.id},
              {"templateID", r.template_id},
              {"clientID", cfg_.client_id},
              {"envdVersion", r.envd_version},
              {"envdAccessToken", r.envd_token},
              {"trafficAccessToken", r.traffic_token ? json(*r.traffic_token) : json(nullptr)},
              {"domain", cfg_.domain ? json(*cfg_.domain) : json(nullptr)}};
    if (r.alias) j["alias"] = *r.alias;
    return j;
  };
  auto listed_json = [&](const storage::SandboxRow& r) {
    json j = {{"sandboxID", r.id},
              {"templateID", r.template_id},
              {"clientID", cfg_.client_id},
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
  };

  bool v2 = !seg.empty() && seg[0] == "v2";
  size_t base = v2 ? 1 : 0;
  if (seg.size() <= base || seg[base] != "sandboxes") return http::json_error(404, "no route for " + req.path);
  size_t n = seg.size() - base;  // segments from "sandboxes" on

  // /sandboxes, /v2/sandboxes
  if (n == 1) {
    if (m == "POST") {
      if (int64_t wait = creates_.acquire(tid); wait > 0) {
        HttpResponse r = http::json_error(429, "rate limit exceeded: too many sandbox creates; retry later");
        r.header("Retry-After", std::to_string(wait));
        return r;
      }
      Result<CreateParams> p = parse_create_request(req, v2);
      if (!p) return error_response(p.error());
      Result<storage::SandboxRow> row = sandboxes_.create(*tenant, *p);
      if (!row) return error_response(row.error());
      return http::json_body(201, dump(sandbox_json(*row)));
    }
    if (m == "GET") {
      Result<storage::SandboxQuery> parsed = parse_list_query(req.query, v2);
      if (!parsed) return error_response(parsed.error());
      storage::SandboxQuery sq = std::move(*parsed);
      sq.tenant_id = tid;
      int64_t want = sq.limit;
      sq.limit = want + 1;
      Result<std::vector<storage::SandboxRow>> rows = sandboxes_.list(sq);
      if (!rows) return error_response(rows.error());
      HttpResponse r;
      bool more = static_cast<int64_t>(rows->size()) > want;
      if (more) rows->resize(static_cast<size_t>(want));
      json arr = json::array();
      for (const auto& row : *rows) arr.push_back(listed_json(row));
      r = http::json_body(200, dump(arr));
      if (v2 && more) r.header("X-Next-Token", std::to_string(rows->back().seq));
      return r;
    }
    return http::json_error(405, "method " + m + " not allowed on " + req.path);
  }

  const std::string& id = seg[base + 1];
  if (id.empty() || id.size() > 64) return http::json_error(404, "sandbox \"" + id + "\" not found");

  // /sandboxes/{id}
  if (n == 2 && !v2) {
    if (m == "GET") {
      Result<storage::SandboxRow> row = sandboxes_.get(tid, id);
      if (!row) return error_response(row.error());
      json j = listed_json(*row);
      j["envdAccessToken"] = row->envd_token;
      j["domain"] = cfg_.domain ? json(*cfg_.domain) : json(nullptr);
      j["allowInternetAccess"] = row->allow_internet ? json(*row->allow_internet) : json(nullptr);
      j["lifecycle"] = {{"onTimeout", row->on_timeout}, {"autoResume", row->auto_resume}};
      if (std::optional<NetworkParams> net = sandboxes_.network(id); net && (!net->allow_out.empty() || !net->deny_out.empty()))
        j["network"] = {{"allowOut", net->allow_out}, {"denyOut", net->deny_out}};
      return http::json_body(200, dump(j));
    }
    if (m == "DELETE") {
      if (Status s = sandboxes_.kill(tid, id); !s) return error_response(s.error());
      return http::no_content(204);
    }
    return http::json_error(405, "method " + m + " not allowed on " + req.path);
  }

  if (n == 3) {
    const std::string& action = seg[base + 2];
    if (action == "connect" && m == "POST") {
      Result<std::optional<int64_t>> timeout = parse_connect_request(req);
      if (!timeout) return error_response(timeout.error());
      Result<SandboxService::Connected> c = sandboxes_.connect(tid, id, timeout->value_or(300));
      if (!c) return error_response(c.error());
      return http::json_body(c->resumed ? 201 : 200, dump(sandbox_json(c->row)));
    }
    if (v2) return http::json_error(404, "no route for " + req.path);
    if (action == "resume" && m == "POST") {
      // Deprecated in E2B's API (connect resumes); kept for old clients.
      Result<std::optional<int64_t>> timeout = parse_resume_request(req);
      if (!timeout) return error_response(timeout.error());
      Result<storage::SandboxRow> row = sandboxes_.get(tid, id);
      if (!row) return error_response(row.error());
      if (row->state != storage::kStatePaused)
        return http::json_error(409, "sandbox \"" + id + "\" is already running");
      Result<SandboxService::Connected> c = sandboxes_.connect(tid, id, timeout->value_or(15));
      if (!c) return error_response(c.error());
      return http::json_body(201, dump(sandbox_json(c->row)));
    }
    if (action == "pause" && m == "POST") {
      if (Status s = parse_pause_request(req); !s) return error_response(s.error());
      if (Status s = sandboxes_.pause(tid, id); !s) return error_response(s.error());
      return http::no_content(204);
    }
    if (action == "network" && m == "PUT") {
      Result<NetworkParams> net = parse_network_update(req);
      if (!net) return error_response(net.error());
      if (Status s = sandboxes_.update_network(tid, id, *net); !s) return error_response(s.error());
      return http::no_content(204);
    }
    if (action == "timeout" && m == "POST") {
      Result<int64_t> timeout = parse_timeout_request(req);
      if (!timeout) return error_response(timeout.error());
      if (Status s = sandboxes_.set_timeout(tid, id, *timeout); !s) return error_response(s.error());
      return http::no_content(204);
    }
    if (action == "metrics" && m == "GET") {
      Result<MetricsRange> range = parse_metrics_query(req.query);
      if (!range) return error_response(range.error());
      Result<std::vector<MetricSample>> ms = sandboxes_.metrics(tid, id, range->start, range->end);
      if (!ms) return error_response(ms.error());
      Result<storage::SandboxRow> row = sandboxes_.get(tid, id);
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
    return http::json_error(404, "no route for " + m + " " + req.path);
  }
  return http::json_error(404, "no route for " + m + " " + req.path);
}

}  // namespace sg::api
