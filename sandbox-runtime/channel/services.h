// Gateway services that sandbox processes reach through the channel
// (docs/channel.md, "Data streams"): the agent listens on a loopback port
// inside the sandbox and opens one stream {"service":"name"} per accepted
// connection; the host bridges it to the named service. Shared by the
// agent (which opens) and the host (which parses and serves).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "base/status.h"

namespace sg::channel {

// Where sandbox processes reach the model API proxy: 127.0.0.1:kModelProxyPort
// inside the sandbox (next to envd's 49983).
inline constexpr uint16_t kModelProxyPort = 49982;
// The service name of the model API proxy in an agent OPEN.
inline constexpr std::string_view kServiceLlm = "llm";
// Where sandbox processes reach the gateway's egress proxy (an HTTP proxy:
// CONNECT and absolute-form requests), when the server has egress.
inline constexpr uint16_t kEgressProxyPort = 49984;
inline constexpr std::string_view kServiceEgress = "egress";
inline constexpr size_t kMaxServiceName = 32;

// The OPEN payload the agent sends for a connection to service name.
std::string service_open_payload(std::string_view name);

// Parses an agent OPEN payload: a JSON object with exactly one member,
// "service", a string of 1..32 characters from [a-z0-9-]. Returns the name,
// or kInvalid with a message fit for the RESET reason. Pure; the payload
// comes from the sandbox and is hostile.
Result<std::string> parse_service_open(std::string_view payload);

}  // namespace sg::channel
