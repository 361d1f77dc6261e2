// The plain /files routes of envd (e2b-protocol.md 3.5): download (GET) and
// upload (POST, multipart/form-data or application/octet-stream), both
// streamed: uploads go to a temp file in the destination directory as they
// arrive and are renamed over the target at the end, so a failed upload
// leaves nothing behind. Also the /files URL signature (3.1).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "sandbox-runtime/agent/envd/http.h"
#include "sandbox-runtime/agent/envd/users.h"

namespace sg::envd {

struct FilesContext {
  const UserDb* users;
  std::string access_token;  // empty: no auth
  std::string default_user;
};

// "v1_" + base64-nopad(sha256("path:operation:username:token[:expiration]")).
std::string file_signature(const std::string& path, const std::string& operation, const std::string& username,
                           const std::string& token, std::optional<int64_t> expiration);

// Constant-time string equality (the length is not hidden).
bool constant_time_equal(const std::string& a, const std::string& b);

// Answers one GET, HEAD or POST /files request on c; marks c to close when
// the request body was not consumed (errors mid-upload, auth failures).
void serve_files(Conn& c, const Request& r, const FilesContext& ctx);

// {"code":status,"message":msg} with that status.
void send_http_error(Conn& c, int status, const std::string& msg);

}  // namespace sg::envd
