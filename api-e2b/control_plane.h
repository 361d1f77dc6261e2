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

#include "api-e2b/sandboxes.h"
#include "gateway/http/message.h"
#include "tenancy/rate_limiter.h"
#include "tenancy/tenants.h"

namespace sg::api {

struct ControlPlaneConfig {
  std::string client_id = "sandgate";  // reported as clientID
  std::optional<std::string> domain;   // reported as domain (null: the client's)
};

class ControlPlane {
 public:
  ControlPlane(tenancy::Tenants& tenants, SandboxService& sandboxes, tenancy::RateLimiter& requests,
               tenancy::RateLimiter& creates, ControlPlaneConfig cfg);

  // True for the paths this class serves (so the gateway can route envd
  // traffic elsewhere).
  static bool owns(const http::HttpRequest& req);
  http::HttpResponse handle(const http::HttpRequest& req);

 private:
  tenancy::Tenants& tenants_;
  SandboxService& sandboxes_;
  tenancy::RateLimiter& requests_;
  tenancy::RateLimiter& creates_;
  ControlPlaneConfig cfg_;
};

// Maps an Error to its HTTP status (kNotFound -> 404, ...).
int status_for(const Error& e);
http::HttpResponse error_response(const Error& e);

}  // namespace sg::api
