// Error and Result: the one error vocabulary of sandgate.
//
// Data-plane and library code never throws; it returns Status or Result<T>
// (LevelDB's Status, a small stand-in for C++23 std::expected, which the
// toolchain here lacks in C++20 mode). An Error carries a message that says
// what failed on which object, and a kind that callers map to HTTP statuses.
#pragma once

#include <cassert>
#include <string>
#include <utility>
#include <variant>

namespace sg {

enum class ErrorKind {
  kInternal,      // broken environment or bug: 500
  kInvalid,       // bad input from a client: 400
  kNotFound,      // 404
  kConflict,      // 409 (already paused, wrong state)
  kUnauthorized,  // 401
  kQuota,         // 429 (quota or rate limit)
  kUnavailable,   // 503 (backend cannot serve now)
  kTimeout,       // 504
};

class Error {
 public:
  Error(ErrorKind kind, std::string message) : kind_(kind), message_(std::move(message)) {}
  ErrorKind kind() const { return kind_; }
  const std::string& message() const { return message_; }
  // Prefixes context ("create sandbox abc: " + message), keeping the kind.
  Error with_context(const std::string& ctx) const { return Error(kind_, ctx + ": " + message_); }

 private:
  ErrorKind kind_;
  std::string message_;
};

inline Error internal_error(std::string m) { return Error(ErrorKind::kInternal, std::move(m)); }
inline Error invalid_error(std::string m) { return Error(ErrorKind::kInvalid, std::move(m)); }
inline Error not_found_error(std::string m) { return Error(ErrorKind::kNotFound, std::move(m)); }
inline Error conflict_error(std::string m) { return Error(ErrorKind::kConflict, std::move(m)); }

// Result<T>: either a value or an Error. Checked access asserts.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::in_place_index<0>, std::move(value)) {}
  Result(Error error) : v_(std::in_place_index<1>, std::move(error)) {}
  bool ok() const { return v_.index() == 0; }
  explicit operator bool() const { return ok(); }
  T& value() & { assert(ok()); return std::get<0>(v_); }
  const T& value() const& { assert(ok()); return std::get<0>(v_); }
  T&& value() && { assert(ok()); return std::get<0>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  const Error& error() const { assert(!ok()); return std::get<1>(v_); }

 private:
  std::variant<T, Error> v_;
};

// Status: success or an Error.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Error e) : err_(std::move(e)), ok_(false) {}
  static Status Ok() { return Status(); }
  bool ok() const { return ok_; }
  explicit operator bool() const { return ok_; }
  const Error& error() const { assert(!ok_); return err_; }

 private:
  Error err_{ErrorKind::kInternal, ""};
  bool ok_ = true;
};

}  // namespace sg
