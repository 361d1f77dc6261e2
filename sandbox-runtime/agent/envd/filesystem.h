// filesystem.Filesystem for envd (docs/envd.md): path resolution against
// the user's home, EntryInfo as proto3 JSON (e2b-protocol.md 3.4), the
// unary operations (directory watchers: agent/envd/watch.h).
//
// Operations run as root (the agent); directories and files they create are
// chowned to the request's user. Functions are thread-safe.
#pragma once

#include <sys/stat.h>

#include <string>
#include <vector>

#include "sandbox-runtime/agent/envd/rpc.h"
#include "sandbox-runtime/agent/envd/users.h"

namespace sg::envd {

// Absolute, lexically normalised path: relative paths (and "~/...") are
// taken from home. Empty gives home.
std::string resolve_path(const std::string& home, const std::string& path);

// Go's os.FileMode.String() of a stat mode, e.g. "-rw-r--r--", "drwxr-xr-x".
std::string permissions_string(mode_t mode);
// RFC 3339 UTC with 0, 3, 6 or 9 fractional digits.
std::string rfc3339_nanos(const struct timespec& ts);

RpcResult<json> entry_info(const std::string& path, const UserDb& users);

RpcResult<json> fs_stat(const std::string& path, const UserDb& users);
RpcResult<json> fs_make_dir(const std::string& path, const User& owner, const UserDb& users);
RpcResult<json> fs_move(const std::string& src, const std::string& dst, const User& owner, const UserDb& users);
RpcResult<json> fs_list_dir(const std::string& path, int depth, const UserDb& users);
RpcStatus fs_remove(const std::string& path);

// mkdir -p of dir, chowning every directory it creates to owner.
RpcStatus make_parents(const std::string& dir, const User& owner);


}  // namespace sg::envd
