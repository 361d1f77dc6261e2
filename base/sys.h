// The thin syscall layer: helpers that capture errno at the call and name
// the operation and the object, so every message says what failed on what.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/fd.h"
#include "base/os.h"
#include "base/status.h"

namespace sg::sys {

// "op object: strerror(errno)" as an internal Error. Call right after the
// failing syscall, before anything else can clobber errno.
Error errno_error(std::string_view op, std::string_view object);
Error errno_error(std::string_view op, std::string_view object, int err);

// Whole-file helpers (small control files: cgroup knobs, /proc entries).
// The helpers that change files take the Os to change them through.
Result<std::string> read_file(const std::string& path, size_t limit = 1 << 20);
Status write_file(const std::string& path, std::string_view data, Os& os = Os::real());
// Writes to a temp file beside path, fsyncs and renames over path.
Status write_file_atomic(const std::string& path, std::string_view data, Os& os = Os::real());

// When process pid started, in clock ticks after boot (/proc/PID/stat
// field 22): with the pid, it names one process for as long as the host
// runs. kNotFound when there is no such process.
Result<uint64_t> process_start_ticks(int pid);

// The last n bytes of a (log) file, trailing newlines and spaces trimmed;
// "" if it cannot be read. For error messages that quote a log.
std::string read_tail(const std::string& path, size_t n);

// mkdir -p; ok if it exists.
Status make_dirs(const std::string& path, unsigned mode = 0755, Os& os = Os::real());
// rm -rf that stays on one filesystem and never follows symlinks.
Status remove_tree(const std::string& path, Os& os = Os::real());
// Bytes allocated (st_blocks) to everything under the directory dfd (or
// path), not following symlinks or crossing mounts; a hard link is
// counted per name. Unreadable entries count 0.
uint64_t disk_usage(int dfd);
uint64_t disk_usage(const std::string& path);
bool path_exists(const std::string& path);

// An exclusive advisory lock (flock) on the file at path, created 0600 if
// missing, held for as long as the returned descriptor is open (and so
// released by the kernel when the process dies, however it dies). On
// success the file holds this process's pid. kConflict when another open
// file description holds it: the message names the holder's pid where the
// file says it.
Result<UniqueFd> lock_file(const std::string& path);

// Monotonic clock in nanoseconds and wall clock in unix seconds.
uint64_t monotonic_ns();
int64_t unix_seconds();

// "2026-12-01T08:00:00Z" for unix seconds t.
std::string format_rfc3339(int64_t t);

// n random bytes from the kernel (getrandom), hex-encoded lowercase.
std::string random_hex(size_t n_bytes);

// Runs argv (PATH searched), waits; stdout and stderr go to log_path. An
// error quotes the first 4 KiB of that log when it does not exit 0.
Status run_and_wait(const std::vector<std::string>& argv, const std::string& log_path);

}  // namespace sg::sys
