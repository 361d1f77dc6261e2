// ControlPlane: E2B's control-plane REST API on plain HTTP values.
//
// Wire contract: shared/e2b-protocol.md §2 (and docs/api.md in the project).
// Authenticates X-API-KEY, applies the tenant's request rate limit, parses
// and validates bodies (unknown fields, wrong types: 400), and maps
// SandboxService results to E2B's statuses and JSON shapes. Every error is
// {"code": N, "message": "..."}. Runs on worker threads.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "sandbox-runtime/builds/build_service.h"
#include "sandbox-runtime/lifecycle/sandbox_service.h"
#include "base/http/message.h"
#include "tenancy/rate_limiter.h"
#include "tenancy/tenants.h"

namespace sg::api {

using lifecycle::MetricSample;
using lifecycle::SandboxService;

struct ControlPlaneConfig {
  std::string client_id = "sandgate";  // reported as clientID
  std::optional<std::string> domain;   // reported as domain (null: the client's)
  // The base of URLs handed to clients (template upload links):
  // "https://gw.example:3000"; "": the request's Host, over scheme.
  std::string public_url;
  std::string scheme = "http";
};

class ControlPlane {
 public:
  // builds: template builds, or null where this server has none (the
  // microVM backend): their routes then answer 501.
  ControlPlane(tenancy::Tenants& tenants, storage::Store& store, SandboxService& sandboxes,
               builds::BuildService* builds, tenancy::RateLimiter& requests, tenancy::RateLimiter& creates,
               ControlPlaneConfig cfg);

  // True for the paths of E2B's API (so the gateway can route envd traffic
  // elsewhere): those it serves, and those it answers 501 (not supported
  // here), 404 or 405.
  static bool owns(const http::HttpRequest& req);
  // Health, then authentication and the request budget, then the route
  // table (control_plane.cpp, kRoutes): one handler per route.
  http::HttpResponse handle(const http::HttpRequest& req);
  // The route table for a tenant authenticated elsewhere (a request
  // another cluster node forwarded: that node checked the key and the
  // request budget). The caller has verified the cluster credential.
  http::HttpResponse handle_as(const http::HttpRequest& req, const storage::TenantRow& tenant);
  // The sandbox id a request names ("/sandboxes/{id}...", v2 too), or "".
  static std::string sandbox_id_of(const http::HttpRequest& req);

 private:
  // One authenticated request on its way to a route's handler.
  struct Call {
    const http::HttpRequest& req;
    const storage::TenantRow& tenant;
    const std::string& id;  // the first path capture: a sandbox or template id, an alias ("" for none)
    bool v2;
    const std::string& arg2;  // the second capture (a build id, a files hash), or ""
    const char* pattern;      // the route's pattern
  };
  struct Route;
  static const Route kRoutes[];
  http::HttpResponse route(const http::HttpRequest& req, const std::vector<std::string>& seg,
                           const storage::TenantRow& tenant);

  http::HttpResponse create(const Call& c);
  http::HttpResponse list(const Call& c);
  http::HttpResponse get(const Call& c);
  http::HttpResponse kill(const Call& c);
  http::HttpResponse connect(const Call& c);
  http::HttpResponse resume(const Call& c);
  http::HttpResponse pause(const Call& c);
  http::HttpResponse update_network(const Call& c);
  http::HttpResponse set_timeout(const Call& c);
  http::HttpResponse metrics(const Call& c);
  http::HttpResponse snapshot(const Call& c);
  http::HttpResponse list_snapshots(const Call& c);
  http::HttpResponse fork(const Call& c);
  // A route of E2B's API this server does not serve: 501, so that no SDK
  // reads it as "not found".
  http::HttpResponse unsupported(const Call& c);
  // Templates (api-e2b/templates.cpp).
  http::HttpResponse list_templates(const Call& c);
  http::HttpResponse get_template(const Call& c);
  http::HttpResponse template_alias(const Call& c);
  http::HttpResponse delete_template(const Call& c);
  http::HttpResponse update_template(const Call& c);
  http::HttpResponse template_tags(const Call& c);
  http::HttpResponse assign_tags(const Call& c);
  http::HttpResponse remove_tags(const Call& c);
  http::HttpResponse request_build(const Call& c);
  http::HttpResponse file_link(const Call& c);
  http::HttpResponse start_build(const Call& c);
  http::HttpResponse build_status(const Call& c);
  http::HttpResponse build_logs(const Call& c);
  // PUT of an upload link: authenticated by its signature, not a key.
  http::HttpResponse upload(const http::HttpRequest& req);
  http::HttpResponse no_builds() const;

  tenancy::Tenants& tenants_;
  storage::Store& store_;
  SandboxService& sandboxes_;
  builds::BuildService* builds_;
  tenancy::RateLimiter& requests_;
  tenancy::RateLimiter& creates_;
  ControlPlaneConfig cfg_;
};

// Maps an Error to its HTTP status (kNotFound -> 404, ...).
int status_for(const Error& e);
http::HttpResponse error_response(const Error& e);

}  // namespace sg::api
