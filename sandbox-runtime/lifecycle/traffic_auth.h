// What a request must carry before it may wake a paused sandbox, or reach
// a sandbox whose ports are private (E2B's allowPublicTraffic false).
//
// A paused sandbox resumes only for traffic that would be served: envd
// requests with the sandbox's access token (X-Access-Token, or a /files URL
// signed with it), and user ports with the traffic access token where the
// sandbox has one. The checks are pure (constant-time comparisons) except
// port_listening(), which reads procfs.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "base/http/message.h"

namespace sg::lifecycle {

// X-Access-Token equal to envd_token, or a /files request whose signature
// query parameter is E2B's v1 signature of (path, operation, username,
// envd_token[, expiration]) and not expired at now (unix seconds).
bool envd_credentials_ok(const http::HttpRequest& head, const std::string& envd_token, int64_t now);

// E2B's v1 file URL signature: "v1_" + unpadded base64 of SHA-256 over
// "path:operation:username:token[:expiration]".
std::string file_signature(const std::string& path, const std::string& operation, const std::string& username,
                           const std::string& token, std::optional<int64_t> expiration);

// The e2b-traffic-access-token header equals token.
bool traffic_token_ok(const http::HttpRequest& head, const std::string& token);

// Whether a TCP socket of the network namespace of process pid listens on
// port (/proc/PID/net/tcp and tcp6). Readable while the process is frozen.
// nullopt when neither file can be read.
std::optional<bool> port_listening(int64_t pid, uint16_t port);

}  // namespace sg::lifecycle
