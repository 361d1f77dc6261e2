// Sandbox traffic routing rules.
#include "base/http/routing.h"

#include <nlohmann/json.hpp>

namespace sg::http {

namespace {

bool valid_id(const std::string& id) {
  if (id.empty() || id.size() > 64) return false;
  for (char c : id)
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9'))) return false;
  return true;
}

std::optional<uint16_t> parse_port(const std::string& s) {
  if (s.empty() || s.size() > 5) return std::nullopt;
  unsigned v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + static_cast<unsigned>(c - '0');
  }
  if (v == 0 || v > 65535) return std::nullopt;
  return static_cast<uint16_t>(v);
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

Result<std::optional<ProxyTarget>> route_to_sandbox(const HttpRequest& head, const std::string& domain) {
  std::string id = head.header("e2b-sandbox-id");
  if (!id.empty()) {
    if (!valid_id(id)) return invalid_error("invalid E2b-Sandbox-Id '" + id + "'");
    ProxyTarget t;
    t.sandbox_id = id;
    std::string port = head.header("e2b-sandbox-port");
    if (!port.empty()) {
      std::optional<uint16_t> p = parse_port(port);
      if (!p) return invalid_error("invalid E2b-Sandbox-Port '" + port + "': use 1-65535");
      t.port = *p;
    }
    return std::optional<ProxyTarget>(t);
  }
  if (domain.empty()) return std::optional<ProxyTarget>();
  // Host: "{port}-{id}.{domain}[:listen-port]".
  std::string host = lower(head.header("host"));
  if (size_t colon = host.rfind(':'); colon != std::string::npos && host.find(']') == std::string::npos)
    host = host.substr(0, colon);
  std::string suffix = "." + lower(domain);
  if (host.size() <= suffix.size() || host.compare(host.size() - suffix.size(), suffix.size(), suffix) != 0)
    return std::optional<ProxyTarget>();
  std::string label = host.substr(0, host.size() - suffix.size());
  if (label.find('.') != std::string::npos) return std::optional<ProxyTarget>();
  size_t dash = label.find('-');
  if (dash == std::string::npos) return std::optional<ProxyTarget>();
  std::optional<uint16_t> port = parse_port(label.substr(0, dash));
  std::string host_id = label.substr(dash + 1);
  if (!port || !valid_id(host_id)) return invalid_error("invalid sandbox host '" + host + "': use PORT-SANDBOXID." + domain);
  return std::optional<ProxyTarget>(ProxyTarget{host_id, *port});
}

HttpResponse port_unanswered(const ProxyTarget& target) {
  std::string msg = "no answer from port " + std::to_string(target.port) + " in the sandbox (nothing listening?)";
  if (target.port != kCodeInterpreterPort) return sandbox_unavailable(target.sandbox_id, msg);
  msg = "no answer from port 49999 in sandbox " + target.sandbox_id +
        ": nothing serves the code interpreter there (it runs in sandboxes of the template code-interpreter-v1, "
        "the code interpreter SDKs' default)";
  nlohmann::json j = {{"sandboxId", target.sandbox_id}, {"message", msg}, {"code", 404}};
  return json_body(404, j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
}

HttpResponse sandbox_unavailable(const std::string& sandbox_id, const std::string& message) {
  nlohmann::json j = {{"sandboxId", sandbox_id}, {"message", message}, {"code", 502}};
  return json_body(502, j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
}

}  // namespace sg::http
