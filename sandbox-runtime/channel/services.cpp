// Agent OPEN payloads for gateway services (services.h, docs/channel.md).
#include "sandbox-runtime/channel/services.h"

#include <nlohmann/json.hpp>

namespace sg::channel {

namespace {

bool valid_service_name(std::string_view s) {
  if (s.empty() || s.size() > kMaxServiceName) return false;
  for (char c : s)
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-')) return false;
  return true;
}

}  // namespace

std::string service_open_payload(std::string_view name) {
  return nlohmann::json{{"service", std::string(name)}}.dump();
}

Result<std::string> parse_service_open(std::string_view payload) {
  auto msg = nlohmann::json::parse(payload.begin(), payload.end(), nullptr, /*allow_exceptions=*/false);
  if (msg.is_discarded() || !msg.is_object()) return invalid_error("OPEN payload is not a JSON object");
  auto it = msg.find("service");
  if (it == msg.end() || msg.size() != 1) return invalid_error("OPEN payload must be exactly {\"service\":\"name\"}");
  if (!it->is_string() || !valid_service_name(it->get_ref<const std::string&>()))
    return invalid_error("OPEN \"service\" must be 1..32 characters of [a-z0-9-]");
  return it->get<std::string>();
}

}  // namespace sg::channel
