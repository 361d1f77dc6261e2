// Connect protocol vocabulary shared by the envd services (docs/envd.md,
// /work/shared/e2b-protocol.md section 3.2): error codes and their HTTP
// statuses, the RpcResult type handlers return, the streaming envelope
// codec, and the proto3-JSON helpers (base64 bytes, int64 as strings, enum
// names or numbers, camelCase or snake_case field names).
#pragma once

#include <nlohmann/json.hpp>

#include "base/base64.h"

#include <cassert>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace sg::envd {

using json = nlohmann::json;

enum class Code {
  kCanceled, kUnknown, kInvalidArgument, kDeadlineExceeded, kNotFound, kAlreadyExists,
  kPermissionDenied, kResourceExhausted, kFailedPrecondition, kAborted, kOutOfRange,
  kUnimplemented, kInternal, kUnavailable, kDataLoss, kUnauthenticated,
};

const char* code_name(Code c);
int code_http_status(Code c);

struct RpcError {
  Code code;
  std::string message;
};

inline RpcError rpc_error(Code c, std::string m) { return RpcError{c, std::move(m)}; }
// "op path: strerror" with the code errno suggests (ENOENT: not_found, ...).
RpcError rpc_errno(std::string_view op, std::string_view path, int err);

// Either a value or an RpcError.
template <typename T>
class [[nodiscard]] RpcResult {
 public:
  RpcResult(T v) : v_(std::in_place_index<0>, std::move(v)) {}
  RpcResult(RpcError e) : v_(std::in_place_index<1>, std::move(e)) {}
  bool ok() const { return v_.index() == 0; }
  explicit operator bool() const { return ok(); }
  T& value() & { assert(ok()); return std::get<0>(v_); }
  T&& value() && { assert(ok()); return std::get<0>(std::move(v_)); }
  T* operator->() { return &value(); }
  T& operator*() & { return value(); }
  const RpcError& error() const { assert(!ok()); return std::get<1>(v_); }

 private:
  std::variant<T, RpcError> v_;
};

struct Unit {};
using RpcStatus = RpcResult<Unit>;
inline RpcStatus rpc_ok() { return Unit{}; }

// JSON error body of a unary call: {"code":"not_found","message":"..."}.
json error_json(const RpcError& e);

// Streaming envelopes: flags byte, u32 big-endian length, payload.
inline constexpr uint8_t kFlagCompressed = 0x01;
inline constexpr uint8_t kFlagEndStream = 0x02;
std::string envelope(uint8_t flags, std::string_view payload);
// The end-of-stream envelope: {} or {"error":{...}}.
std::string end_stream(const std::optional<RpcError>& err);

struct Envelope {
  uint8_t flags = 0;
  std::string payload;
};
// Parses body as exactly one message envelope (what the SDK sends for a
// server-streaming call).
RpcResult<Envelope> parse_single_envelope(std::string_view body);

// Base64 (base/base64.h).
using sg::base64_decode;
using sg::base64_encode;

// proto3-JSON field access: the camelCase name or the snake_case one.
const json* field(const json& obj, std::string_view camel, std::string_view snake = {});
std::string get_string(const json& obj, std::string_view camel, std::string_view snake = {});
bool get_bool(const json& obj, std::string_view camel, std::string_view snake = {});
// Integers as numbers or decimal strings; nullopt for a bad value.
std::optional<int64_t> get_int(const json& obj, std::string_view camel, std::string_view snake = {},
                               int64_t def = 0);
// Enum fields: the name ("SIGNAL_SIGKILL") or the number.
std::optional<int64_t> get_enum(const json& obj, std::string_view camel,
                                std::initializer_list<std::pair<const char*, int64_t>> names);

}  // namespace sg::envd
