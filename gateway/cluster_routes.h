// ClusterRoutes: one endpoint over many nodes (docs/cluster.md,
// "Forwarding"). Every node accepts every request; this decides, per
// request, whether it is served here or forwarded to the node the catalog
// names, and places creates.
//
// Forwarding protocol (node to node, over the peers' ordinary HTTP port):
//  - control plane: the same method, path, query and body, with the
//    client's headers less its API key and hop-by-hop headers, plus
//    X-Sandgate-Cluster-Key (the cluster secret) and X-Sandgate-Tenant
//    (the tenant the entry node authenticated). The receiver checks the
//    secret (constant time; a forged request is 401) and serves the
//    request for that tenant, never forwarding it again.
//  - sandbox traffic (envd, any port, WebSocket upgrades, streams):
//    "CONNECT <sandbox>:<port>" with the secret, X-Sandgate-Path (the
//    client's path, for envd's own checks) and the client's credential
//    headers; on 200 the connection is a byte pipe to the sandbox port,
//    through which the entry node relays the client's request as it does
//    to a local sandbox (streaming both ways, no body held whole).
//
// Thread-safe (called from the server's workers).
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>

#include "api-e2b/control_plane.h"
#include "base/fd.h"
#include "base/http/message.h"
#include "base/http/routing.h"
#include "gateway/cluster.h"
#include "storage/store.h"
#include "tenancy/rate_limiter.h"
#include "tenancy/tenants.h"

namespace sg::gateway {

namespace cluster_wire {
// "CONNECT <target>" to a peer with the cluster key, X-Sandgate-Path:
// path and the extra header lines (each ending "\r\n"): the stream once
// the peer answers 200; its refusal as an error (what names the object
// in messages).
Result<UniqueFd> open_tunnel(const NodeInfo& node, const std::string& secret, const std::string& target,
                             const std::string& path, const std::string& headers, const std::string& what);
// The CONNECT target of a template file transfer (X-Sandgate-Path: the
// file's path under the data directory; cluster_templates.h).
inline constexpr const char* kTemplateFilesTarget = "template-files:1";
}  // namespace cluster_wire

class ClusterRoutes {
 public:
  // sandgate's own routes (/sandboxes/{id}/events, /llm/usage) for an
  // authenticated tenant; nullopt for any other path.
  using Extensions = std::function<std::optional<http::HttpResponse>(const http::HttpRequest&, const storage::TenantRow&)>;

  ClusterRoutes(Cluster& cluster, api::ControlPlane& control, tenancy::Tenants& tenants, storage::Store& store,
                lifecycle::SandboxService& sandboxes, tenancy::RateLimiter& requests, Extensions extensions);

  // A control-plane request: the answer when the cluster decides it
  // (forwarded, placed, fanned out, or served here for a forwarding node),
  // nullopt when it is an ordinary local request.
  std::optional<http::HttpResponse> handle(const http::HttpRequest& req);
  // ProxyHooks::connect: a local sandbox's port, or a tunnel to its node.
  Result<UniqueFd> connect(const http::ProxyTarget& t, const http::HttpRequest& head);
  // ProxyHooks::tunnel: a CONNECT from a peer.
  Result<UniqueFd> tunnel(const http::HttpRequest& head);
  // Serves template file transfers (cluster_wire::kTemplateFilesTarget);
  // unset: refused. Set before the server starts.
  void set_template_files(std::function<Result<UniqueFd>(const std::string& path)> serve) {
    template_files_ = std::move(serve);
  }

  // How long a forwarded control-plane call may take (a create runs a
  // template's start command).
  static constexpr std::chrono::milliseconds kForwardTimeout{300000};

 private:
  // forwarded: the tenant was asserted by another node (no key here).
  http::HttpResponse served_here(const http::HttpRequest& req, const storage::TenantRow& tenant, bool forwarded);
  http::HttpResponse create(const http::HttpRequest& req, const storage::TenantRow& tenant);
  http::HttpResponse list(const http::HttpRequest& req, const storage::TenantRow& tenant);
  // /llm/usage: every node's records for the tenant, merged.
  http::HttpResponse usage(const http::HttpRequest& req, const storage::TenantRow& tenant);
  // charge: take a token of the tenant's request budget (once per client
  // request, not per node a fan-out reaches).
  Result<http::HttpResponse> forward(const NodeInfo& node, const http::HttpRequest& req, const storage::TenantRow& tenant,
                                     bool charge = true);
  // The catalog after a request this node served: a create's sandbox is
  // recorded, a killed one forgotten.
  void after(const http::HttpRequest& req, const http::HttpResponse& res, const std::string& tenant);

  Cluster& cluster_;
  api::ControlPlane& control_;
  tenancy::Tenants& tenants_;
  storage::Store& store_;
  lifecycle::SandboxService& sandboxes_;
  tenancy::RateLimiter& requests_;
  Extensions extensions_;
  std::function<Result<UniqueFd>(const std::string& path)> template_files_;
};

}  // namespace sg::gateway
