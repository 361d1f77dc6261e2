// Implementation of the cluster's request routing and node-to-node
// forwarding (cluster_routes.h, docs/cluster.md).
#include "gateway/cluster_routes.h"

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>

#include <nlohmann/json.hpp>

#include "base/blocking_http.h"
#include "base/log.h"
#include "tenancy/api_key.h"

namespace sg::gateway {

using nlohmann::json;
namespace wire = cluster_wire;

namespace {

using Clock = std::chrono::steady_clock;

// Headers that belong to one connection, or to the cluster itself, and
// never cross a hop as the client sent them.
bool hop_header(const std::string& k) {
  return k == "host" || k == "connection" || k == "keep-alive" || k == "transfer-encoding" || k == "te" ||
         k == "trailer" || k == "upgrade" || k == "content-length" || k == "expect" || k == "proxy-connection" ||
         k == "proxy-authorization" || k.rfind("x-sandgate-", 0) == 0;
}

bool is_collection(const http::HttpRequest& req) { return req.path == "/sandboxes" || req.path == "/v2/sandboxes"; }

bool is_fork(const http::HttpRequest& req) {
  return req.method == "POST" && req.path.size() > 5 && req.path.compare(req.path.size() - 5, 5, "/fork") == 0;
}

// A create a node declined (full, draining, no such template there, its
// runtime down): the next node is tried.
bool refused(int status) { return status == 503 || status == 507 || status == 404; }

http::HttpResponse retry_later(const std::string& msg) {
  http::HttpResponse r = http::json_error(503, msg);
  r.header("Retry-After", "1");
  return r;
}

// The tunnel's answer, when it is not 200: its status and message.
Error tunnel_refused(const NodeInfo& node, int fd, const net::Response& head, Clock::time_point deadline) {
  std::string message = "node " + node.id + " answered " + std::to_string(head.status);
  std::string cl = head.header("content-length");
  size_t n = 0;
  std::from_chars(cl.data(), cl.data() + cl.size(), n);
  if (n > 0 && n <= 8192) {
    std::string body(n, '\0');
    size_t got = 0;
    while (got < n) {
      pollfd p{fd, POLLIN, 0};
      int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count());
      if (left <= 0 || ::poll(&p, 1, left) <= 0) break;
      ssize_t r = ::read(fd, body.data() + got, n - got);
      if (r <= 0) break;
      got += static_cast<size_t>(r);
    }
    json j = json::parse(body.substr(0, got), nullptr, false);
    if (j.is_object() && j.contains("message") && j["message"].is_string()) message = j["message"].get<std::string>();
  }
  switch (head.status) {
    case 401: return Error(ErrorKind::kUnauthorized, message);
    case 404: return not_found_error(message);
    case 400: return invalid_error(message);
    default: return Error(ErrorKind::kUnavailable, message);
  }
}

Result<UniqueFd> open_tunnel(const NodeInfo& node, const std::string& secret, const http::ProxyTarget& t,
                             const http::HttpRequest& head) {
  std::string headers;
  for (const auto& [k, v] : head.headers)
    if (!hop_header(k)) headers += k + ": " + v + "\r\n";
  return cluster_wire::open_tunnel(node, secret, t.sandbox_id + ":" + std::to_string(t.port), head.path, headers,
                                   "sandbox " + t.sandbox_id);
}

}  // namespace

Result<UniqueFd> cluster_wire::open_tunnel(const NodeInfo& node, const std::string& secret, const std::string& target,
                                         const std::string& path, const std::string& headers, const std::string& what) {
  Result<net::Endpoint> ep = net::parse_endpoint(node.address);
  if (!ep) return ep.error().with_context("node " + node.id);
  Result<UniqueFd> fd = net::connect_tcp(*ep, std::chrono::seconds(5));
  if (!fd) return Error(ErrorKind::kUnavailable, "node " + node.id + " holding " + what + ": " + fd.error().message());
  std::string msg = "CONNECT " + target + " HTTP/1.1\r\nHost: " + ep->str() + "\r\nX-Sandgate-Cluster-Key: " + secret +
                    "\r\nX-Sandgate-Path: " + path + "\r\n" + headers + "\r\n";
  // Long enough for the peer to resume a paused sandbox first.
  Clock::time_point deadline = Clock::now() + std::chrono::seconds(120);
  if (Status s = net::write_all(fd->get(), msg, deadline); !s)
    return Error(ErrorKind::kUnavailable, "tunnel to node " + node.id + ": " + s.error().message());
  Result<net::Response> answer = net::read_head_exact(fd->get(), deadline);
  if (!answer) return Error(ErrorKind::kUnavailable, "tunnel to node " + node.id + ": " + answer.error().message());
  if (answer->status != 200) return tunnel_refused(node, fd->get(), *answer, deadline);
  return fd;
}

ClusterRoutes::ClusterRoutes(Cluster& cluster, api::ControlPlane& control, tenancy::Tenants& tenants,
                             storage::Store& store, lifecycle::SandboxService& sandboxes,
                             tenancy::RateLimiter& requests, Extensions extensions)
    : cluster_(cluster),
      control_(control),
      tenants_(tenants),
      store_(store),
      sandboxes_(sandboxes),
      requests_(requests),
      extensions_(std::move(extensions)) {}

std::optional<http::HttpResponse> ClusterRoutes::handle(const http::HttpRequest& req) {
  if (req.headers.count(wire::kSecretHeader)) {
    if (!tenancy::secrets_equal(req.header(wire::kSecretHeader), cluster_.secret()))
      return http::json_error(401, "forged cluster request: the cluster key (X-Sandgate-Cluster-Key) does not match");
    std::string name = req.header(wire::kTenantHeader);
    Result<std::optional<storage::TenantRow>> t = store_.find_tenant_by_name(name);
    if (!t) return api::error_response(t.error());
    if (!*t) return http::json_error(401, "forwarded request for tenant \"" + name + "\", which node " + cluster_.self().id + " does not know");
    // Revoked since the entry node checked (its mirror may lag this one's).
    if ((*t)->disabled) return http::json_error(401, "tenant \"" + name + "\" is revoked");
    return served_here(req, **t, true);
  }
  bool usage = req.method == "GET" && req.path == "/llm/usage";
  if (!api::ControlPlane::owns(req) && !usage) return std::nullopt;
  bool create = req.method == "POST" && is_collection(req);
  bool list = req.method == "GET" && is_collection(req);
  std::string id = api::ControlPlane::sandbox_id_of(req);
  if (!create && !list && !usage && id.empty()) return std::nullopt;
  // A sandbox of this node, as the mirror says: served as on one host
  // (the control plane authenticates it once), unless the catalog must
  // hear of it (a kill, a fork).
  if (!id.empty() && req.method != "DELETE" && !is_fork(req) && cluster_.mirrored_here(id)) return std::nullopt;
  // Authenticated here as the control plane would; a request that fails
  // is left to it, for its answer.
  std::string key = req.header("x-api-key");
  if (key.empty()) return std::nullopt;
  Result<storage::TenantRow> tenant = tenants_.authenticate(key);
  if (!tenant) return std::nullopt;
  if (create) return this->create(req, *tenant);
  if (list) return this->list(req, *tenant);
  if (usage) return this->usage(req, *tenant);

  Owner o = cluster_.owner_of(id);
  switch (o.where) {
    case Owner::Where::kPeer: {
      Result<http::HttpResponse> r = forward(o.node, req, *tenant);
      if (!r) return retry_later("sandbox " + id + " is on node " + o.node.id + ", which did not answer: " + r.error().message());
      return std::move(*r);
    }
    case Owner::Where::kUnreachable:
      return retry_later("sandbox " + id + " is on node " + o.node.id + ", which is not reachable now; retry shortly");
    case Owner::Where::kLost:
      return http::json_error(404, "sandbox " + id + " was lost: its node " + o.node.id + " left the cluster");
    case Owner::Where::kHere:
    case Owner::Where::kUnknown:
      break;
  }
  // Here: served as on one host, with the catalog told of a kill and of
  // a fork's new sandboxes.
  if (req.method == "DELETE" || is_fork(req)) return served_here(req, *tenant, false);
  return std::nullopt;
}

http::HttpResponse ClusterRoutes::served_here(const http::HttpRequest& req, const storage::TenantRow& tenant,
                                              bool forwarded) {
  std::optional<http::HttpResponse> ext = forwarded && extensions_ ? extensions_(req, tenant) : std::nullopt;
  http::HttpResponse r = ext ? std::move(*ext) : forwarded ? control_.handle_as(req, tenant) : control_.handle(req);
  after(req, r, tenant.name);
  return r;
}

void ClusterRoutes::after(const http::HttpRequest& req, const http::HttpResponse& res, const std::string& tenant) {
  if (req.method == "POST" && is_collection(req) && res.status == 201) {
    json j = json::parse(res.body, nullptr, false);
    if (j.is_object() && j.contains("sandboxID") && j["sandboxID"].is_string()) {
      std::string id = j["sandboxID"].get<std::string>();
      // Not fatal: the next heartbeat's reconcile records it.
      if (Status s = cluster_.record(id, tenant); !s) LOG_WARN("cluster: record sandbox " << id << ": " << s.error().message());
    }
  } else if (is_fork(req) && res.status == 201) {
    // A fork's sandboxes: [{"sandbox": {...}} | {"error": {...}}, ...].
    json arr = json::parse(res.body, nullptr, false);
    if (!arr.is_array()) return;
    for (const json& item : arr) {
      if (!item.is_object() || !item.contains("sandbox") || !item["sandbox"].is_object()) continue;
      const json& sb = item["sandbox"];
      if (!sb.contains("sandboxID") || !sb["sandboxID"].is_string()) continue;
      std::string id = sb["sandboxID"].get<std::string>();
      if (Status s = cluster_.record(id, tenant); !s) LOG_WARN("cluster: record sandbox " << id << ": " << s.error().message());
    }
  } else if (req.method == "DELETE" && res.status / 100 == 2) {
    std::string id = api::ControlPlane::sandbox_id_of(req);
    if (!id.empty())
      if (Status s = cluster_.forget(id); !s) LOG_WARN("cluster: forget sandbox " << id << ": " << s.error().message());
  }
}

http::HttpResponse ClusterRoutes::create(const http::HttpRequest& req, const storage::TenantRow& tenant) {
  if (!cluster_.member())
    return retry_later("node " + cluster_.self().id +
                       " has lost contact with the cluster (etcd unreachable or its lease expired): it takes no "
                       "creates until it is back; send them to another node");
  std::vector<NodeInfo> order = cluster_.placement(0);
  http::HttpResponse last = retry_later("no node in the cluster has room for a new sandbox");
  for (const NodeInfo& node : order) {
    http::HttpResponse r;
    if (node.id == cluster_.self().id) {
      r = served_here(req, tenant, false);
    } else {
      Result<http::HttpResponse> f = forward(node, req, tenant);
      if (!f) {
        LOG_WARN("cluster: create on node " << node.id << ": " << f.error().message());
        last = retry_later("node " + node.id + " did not answer: " + f.error().message());
        continue;
      }
      r = std::move(*f);
    }
    if (refused(r.status)) {
      last = std::move(r);
      continue;
    }
    return r;
  }
  return last;
}

http::HttpResponse ClusterRoutes::list(const http::HttpRequest& req, const storage::TenantRow& tenant) {
  http::HttpResponse mine = served_here(req, tenant, false);
  if (mine.status != 200) return mine;
  json all = json::parse(mine.body, nullptr, false);
  if (!all.is_array()) return mine;
  std::string missing;
  size_t from_peers = 0;
  for (const NodeInfo& node : cluster_.nodes()) {
    if (node.id == cluster_.self().id) continue;
    Result<http::HttpResponse> r = forward(node, req, tenant, false);
    json theirs = r && r->status == 200 ? json::parse(r->body, nullptr, false) : json();
    if (!theirs.is_array()) {
      missing += (missing.empty() ? "" : ",") + node.id;
      continue;
    }
    from_peers += theirs.size();
    for (json& s : theirs) all.push_back(std::move(s));
  }
  http::HttpResponse out = std::move(mine);
  if (from_peers > 0) {
    // Pages are per node: a merged list is one page (docs/cluster.md).
    std::erase_if(out.headers, [](const auto& h) {
      std::string k = h.first;
      for (char& c : k) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      return k == "x-next-token";
    });
    out.body = all.dump();
  }
  if (!missing.empty()) out.header("X-Sandgate-Missing-Nodes", missing);
  return out;
}

http::HttpResponse ClusterRoutes::usage(const http::HttpRequest& req, const storage::TenantRow& tenant) {
  if (int64_t wait = requests_.acquire(tenant.id); wait > 0) {
    http::HttpResponse r = http::json_error(429, "rate limit exceeded: too many requests for this team; retry later");
    r.header("Retry-After", std::to_string(wait));
    return r;
  }
  std::optional<http::HttpResponse> mine = extensions_ ? extensions_(req, tenant) : std::nullopt;
  if (!mine) return http::json_error(404, "no route for GET /llm/usage");
  if (mine->status != 200) return std::move(*mine);
  json all = json::parse(mine->body, nullptr, false);
  if (!all.is_object() || !all["requests"].is_array() || !all["totals"].is_object()) return std::move(*mine);
  std::string missing;
  for (const NodeInfo& node : cluster_.nodes()) {
    if (node.id == cluster_.self().id) continue;
    Result<http::HttpResponse> r = forward(node, req, tenant, false);
    json theirs = r && r->status == 200 ? json::parse(r->body, nullptr, false) : json();
    if (!theirs.is_object() || !theirs["requests"].is_array() || !theirs["totals"].is_object()) {
      missing += (missing.empty() ? "" : ",") + node.id;
      continue;
    }
    for (json& u : theirs["requests"]) all["requests"].push_back(std::move(u));
    for (auto& [k, v] : theirs["totals"].items())
      if (v.is_number_integer() && all["totals"][k].is_number_integer())
        all["totals"][k] = all["totals"][k].get<int64_t>() + v.get<int64_t>();
  }
  http::HttpResponse out = http::json_body(200, all.dump(-1, ' ', false, json::error_handler_t::replace));
  if (!missing.empty()) out.header("X-Sandgate-Missing-Nodes", missing);
  return out;
}

Result<http::HttpResponse> ClusterRoutes::forward(const NodeInfo& node, const http::HttpRequest& req,
                                                  const storage::TenantRow& tenant, bool charge) {
  int64_t wait = charge ? requests_.acquire(tenant.id) : 0;
  if (wait > 0) {
    http::HttpResponse r = http::json_error(429, "rate limit exceeded: too many requests for this team; retry later");
    r.header("Retry-After", std::to_string(wait));
    return r;
  }
  Result<net::Endpoint> ep = net::parse_endpoint(node.address);
  if (!ep) return ep.error().with_context("node " + node.id);
  net::Request out;
  out.method = req.method;
  out.target = req.target;
  for (const auto& [k, v] : req.headers)
    if (!hop_header(k) && k != "x-api-key") out.headers.emplace_back(k, v);
  out.headers.emplace_back("X-Sandgate-Cluster-Key", cluster_.secret());
  out.headers.emplace_back("X-Sandgate-Tenant", tenant.name);
  out.body = req.body;
  Result<net::Response> r = net::request(*ep, out, kForwardTimeout, 64 << 20);
  if (!r) return r.error();
  http::HttpResponse res;
  res.status = r->status;
  res.body = std::move(r->body);
  res.content_type = r->header("content-type");
  if (res.content_type.empty() && !res.body.empty()) res.content_type = "application/octet-stream";
  for (const auto& [k, v] : r->headers)
    if (!hop_header(k) && k != "content-type" && k != "date" && k != "server") res.header(k, v);
  return res;
}

Result<UniqueFd> ClusterRoutes::connect(const http::ProxyTarget& t, const http::HttpRequest& head) {
  Owner o = cluster_.owner_of(t.sandbox_id);
  switch (o.where) {
    case Owner::Where::kPeer:
      return open_tunnel(o.node, cluster_.secret(), t, head);
    case Owner::Where::kUnreachable:
      return Error(ErrorKind::kUnavailable, "its node " + o.node.id + " is not reachable now");
    case Owner::Where::kLost:
      return not_found_error("sandbox " + t.sandbox_id + " was lost: its node " + o.node.id + " left the cluster");
    case Owner::Where::kHere:
    case Owner::Where::kUnknown:
      break;
  }
  return sandboxes_.open_port(t.sandbox_id, t.port, head);
}

Result<UniqueFd> ClusterRoutes::tunnel(const http::HttpRequest& head) {
  if (!tenancy::secrets_equal(head.header(wire::kSecretHeader), cluster_.secret()))
    return Error(ErrorKind::kUnauthorized, "forged cluster tunnel: the cluster key (X-Sandgate-Cluster-Key) does not match");
  if (head.target == wire::kTemplateFilesTarget) {
    if (!template_files_) return not_found_error("this node serves no template files");
    return template_files_(head.header(wire::kPathHeader));
  }
  size_t colon = head.target.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon > 64) return invalid_error("CONNECT target must be <sandbox>:<port>");
  std::string id = head.target.substr(0, colon);
  std::string_view port_s = std::string_view(head.target).substr(colon + 1);
  unsigned port = 0;
  auto [p, ec] = std::from_chars(port_s.data(), port_s.data() + port_s.size(), port);
  if (ec != std::errc() || p != port_s.data() + port_s.size() || port == 0 || port > 65535)
    return invalid_error("CONNECT target has a bad port");
  http::HttpRequest inner = head;
  inner.method = "GET";
  inner.path = head.header(wire::kPathHeader);
  inner.target = inner.path;
  std::erase_if(inner.headers, [](const auto& h) { return h.first.rfind("x-sandgate-", 0) == 0; });
  // Only a sandbox this node holds: the catalog may have moved it.
  Owner o = cluster_.owner_of(id);
  if (o.where == Owner::Where::kPeer) return not_found_error("sandbox " + id + " is on node " + o.node.id + ", not here");
  return sandboxes_.open_port(id, static_cast<uint16_t>(port), inner);
}

}  // namespace sg::gateway
