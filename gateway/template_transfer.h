// A directory tree moved between cluster nodes (docs/cluster.md,
// "Templates between nodes").
//
// The stream is GNU tar's of the directory (owners, modes, extended
// attributes and overlay whiteouts kept) followed by a trailer,
// "\nsandgate-sha256 <64 hex>\n": the SHA-256 of the stream before it,
// written only once tar has ended well. The receiver feeds the bytes to its
// own tar while hashing them, holds the last trailer's worth back, and
// succeeds only when the trailer is there and matches: a sender that dies
// mid-stream, a stream cut at a tar block boundary, or one changed on the
// way, fails, and the caller drops what was unpacked.
//
// Both block; each runs one tar process. A write to a reader that has gone
// is EPIPE: the process ignores SIGPIPE (the gateway does).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "base/status.h"

namespace sg::gateway::transfer {

// Writes dir's stream and trailer to out; tar's errors go to err_path.
// False when tar failed (no trailer is written) or out stopped taking.
bool send_tree(const std::string& dir, int out, const std::string& err_path);

// Unpacks the stream read from in into dir (existing, empty; tar's errors
// to err_path). Returns the bytes read. kUnavailable when the stream is
// cut, changed, ends without its trailer, stalls for `idle`, or tar fails.
Result<uint64_t> receive_tree(int in, const std::string& dir, const std::string& err_path,
                              std::chrono::milliseconds idle);

}  // namespace sg::gateway::transfer
