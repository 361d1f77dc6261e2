// Routing of envd and sandbox-port traffic: which requests go to a sandbox
// rather than to the control plane, and to which port inside it.
//
// Two ways to name the target (shared e2b-protocol.md §1.2, §3.1):
//   - the E2b-Sandbox-Id / E2b-Sandbox-Port headers, on any origin (what
//     the SDKs send when E2B_SANDBOX_URL points at the gateway);
//   - the Host "{port}-{sandboxID}.{domain}" for hosted use, when a domain
//     is configured.
// Pure functions, unit-tested without sockets.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "base/http/message.h"
#include "base/status.h"

namespace sg::http {

inline constexpr uint16_t kEnvdPort = 49983;

struct ProxyTarget {
  std::string sandbox_id;
  uint16_t port = kEnvdPort;
};

// The target of a request, from its headers (the body is not looked at).
// nullopt: not sandbox traffic. An Error (kInvalid): it names a sandbox but
// badly (a port that is not 1..65535, an id with characters ids never have).
Result<std::optional<ProxyTarget>> route_to_sandbox(const HttpRequest& head, const std::string& domain);

// E2B's proxy answer for an unknown or dead sandbox, or a closed port:
// 502 {"sandboxId": ..., "message": ..., "code": 502}.
HttpResponse sandbox_unavailable(const std::string& sandbox_id, const std::string& message);

// The code interpreter SDKs' port (E2B's Jupyter server).
inline constexpr uint16_t kCodeInterpreterPort = 49999;

// The answer when a port of a live sandbox does not answer: 502 as E2B's,
// except for the code interpreter's port, which is 404 naming the template
// that has it: the SDKs read 502 as "the sandbox timed out", which misleads
// runCode on a sandbox without the interpreter.
HttpResponse port_unanswered(const ProxyTarget& target);

}  // namespace sg::http
