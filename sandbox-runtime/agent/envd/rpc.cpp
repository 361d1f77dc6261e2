// Connect codes, envelopes and proto3-JSON helpers.
#include "sandbox-runtime/agent/envd/rpc.h"

#include <cerrno>
#include <cstring>

namespace sg::envd {

const char* code_name(Code c) {
  switch (c) {
    case Code::kCanceled: return "canceled";
    case Code::kUnknown: return "unknown";
    case Code::kInvalidArgument: return "invalid_argument";
    case Code::kDeadlineExceeded: return "deadline_exceeded";
    case Code::kNotFound: return "not_found";
    case Code::kAlreadyExists: return "already_exists";
    case Code::kPermissionDenied: return "permission_denied";
    case Code::kResourceExhausted: return "resource_exhausted";
    case Code::kFailedPrecondition: return "failed_precondition";
    case Code::kAborted: return "aborted";
    case Code::kOutOfRange: return "out_of_range";
    case Code::kUnimplemented: return "unimplemented";
    case Code::kInternal: return "internal";
    case Code::kUnavailable: return "unavailable";
    case Code::kDataLoss: return "data_loss";
    case Code::kUnauthenticated: return "unauthenticated";
  }
  return "unknown";
}

int code_http_status(Code c) {
  switch (c) {
    case Code::kCanceled: return 499;
    case Code::kUnknown: return 500;
    case Code::kInvalidArgument: return 400;
    case Code::kDeadlineExceeded: return 504;
    case Code::kNotFound: return 404;
    case Code::kAlreadyExists: return 409;
    case Code::kPermissionDenied: return 403;
    case Code::kResourceExhausted: return 429;
    case Code::kFailedPrecondition: return 400;
    case Code::kAborted: return 409;
    case Code::kOutOfRange: return 400;
    case Code::kUnimplemented: return 501;
    case Code::kInternal: return 500;
    case Code::kUnavailable: return 503;
    case Code::kDataLoss: return 500;
    case Code::kUnauthenticated: return 401;
  }
  return 500;
}

RpcError rpc_errno(std::string_view op, std::string_view path, int err) {
  Code c = Code::kInternal;
  switch (err) {
    case ENOENT: c = Code::kNotFound; break;
    case EEXIST: c = Code::kAlreadyExists; break;
    case ENOTDIR: case EISDIR: case EINVAL: case ENAMETOOLONG: case ENOTEMPTY:
      c = Code::kInvalidArgument; break;
    case EACCES: case EPERM: case EROFS: c = Code::kPermissionDenied; break;
    case ELOOP: c = Code::kFailedPrecondition; break;
    case ENOSPC: case EDQUOT: c = Code::kResourceExhausted; break;
    default: break;
  }
  std::string m(op);
  m += ' ';
  m += path;
  m += ": ";
  m += std::strerror(err);
  return RpcError{c, std::move(m)};
}

json error_json(const RpcError& e) { return json{{"code", code_name(e.code)}, {"message", e.message}}; }

std::string envelope(uint8_t flags, std::string_view payload) {
  std::string out;
  out.reserve(5 + payload.size());
  uint32_t n = static_cast<uint32_t>(payload.size());
  out.push_back(static_cast<char>(flags));
  out.push_back(static_cast<char>(n >> 24));
  out.push_back(static_cast<char>(n >> 16));
  out.push_back(static_cast<char>(n >> 8));
  out.push_back(static_cast<char>(n));
  out.append(payload);
  return out;
}

std::string end_stream(const std::optional<RpcError>& err) {
  json j = json::object();
  if (err) j["error"] = error_json(*err);
  return envelope(kFlagEndStream, j.dump());
}

RpcResult<Envelope> parse_single_envelope(std::string_view body) {
  if (body.size() < 5) return rpc_error(Code::kInvalidArgument, "request body: truncated envelope");
  auto b = reinterpret_cast<const uint8_t*>(body.data());
  uint32_t n = (uint32_t(b[1]) << 24) | (uint32_t(b[2]) << 16) | (uint32_t(b[3]) << 8) | uint32_t(b[4]);
  if (body.size() - 5 < n) return rpc_error(Code::kInvalidArgument, "request body: truncated envelope");
  Envelope e;
  e.flags = b[0];
  if (e.flags & kFlagCompressed)
    return rpc_error(Code::kUnimplemented, "request body: compressed envelopes are not supported");
  e.payload.assign(body.substr(5, n));
  std::string_view rest = body.substr(5 + n);
  // An optional empty end-of-stream envelope may follow; nothing else.
  if (!rest.empty() && !(rest.size() >= 5 && (uint8_t(rest[0]) & kFlagEndStream)))
    return rpc_error(Code::kInvalidArgument, "request body: more than one message on a server-streaming call");
  return e;
}


const json* field(const json& obj, std::string_view camel, std::string_view snake) {
  if (!obj.is_object()) return nullptr;
  auto it = obj.find(camel);
  if (it != obj.end() && !it->is_null()) return &*it;
  if (!snake.empty()) {
    it = obj.find(snake);
    if (it != obj.end() && !it->is_null()) return &*it;
  }
  return nullptr;
}

std::string get_string(const json& obj, std::string_view camel, std::string_view snake) {
  const json* f = field(obj, camel, snake);
  return f && f->is_string() ? f->get<std::string>() : std::string();
}

bool get_bool(const json& obj, std::string_view camel, std::string_view snake) {
  const json* f = field(obj, camel, snake);
  return f && f->is_boolean() && f->get<bool>();
}

std::optional<int64_t> get_int(const json& obj, std::string_view camel, std::string_view snake, int64_t def) {
  const json* f = field(obj, camel, snake);
  if (!f) return def;
  if (f->is_number_integer()) return f->get<int64_t>();
  if (f->is_number_unsigned()) return static_cast<int64_t>(f->get<uint64_t>());
  if (f->is_string()) {
    const std::string& s = f->get_ref<const std::string&>();
    if (s.empty() || s.size() > 20) return std::nullopt;
    size_t i = s[0] == '-' ? 1 : 0;
    if (i == s.size()) return std::nullopt;
    int64_t v = 0;
    for (; i < s.size(); ++i) {
      if (s[i] < '0' || s[i] > '9') return std::nullopt;
      v = v * 10 + (s[i] - '0');
    }
    return s[0] == '-' ? -v : v;
  }
  return std::nullopt;
}

std::optional<int64_t> get_enum(const json& obj, std::string_view camel,
                                std::initializer_list<std::pair<const char*, int64_t>> names) {
  const json* f = field(obj, camel);
  if (!f) return 0;
  if (f->is_number_integer()) return f->get<int64_t>();
  if (f->is_string()) {
    for (auto& [n, v] : names)
      if (f->get_ref<const std::string&>() == n) return v;
  }
  return std::nullopt;
}

}  // namespace sg::envd
