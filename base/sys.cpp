// Implementation of the syscall layer helpers.
#include "base/sys.h"

#include <dirent.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <ctime>

#include "base/fd.h"

namespace sg::sys {

Error errno_error(std::string_view op, std::string_view object) { return errno_error(op, object, errno); }

Error errno_error(std::string_view op, std::string_view object, int err) {
  std::string m(op);
  if (!object.empty()) {
    m += ' ';
    m += object;
  }
  m += ": ";
  m += std::strerror(err);
  return internal_error(std::move(m));
}

Result<uint64_t> process_start_ticks(int pid) {
  Result<std::string> stat = read_file("/proc/" + std::to_string(pid) + "/stat", 4096);
  if (!stat) return not_found_error("process " + std::to_string(pid) + ": " + stat.error().message());
  // "pid (comm) state ppid ...": comm may hold spaces and ')', so count
  // fields from the last ')'; the state is field 3, the start time 22.
  size_t rp = stat->rfind(')');
  if (rp == std::string::npos) return internal_error("/proc/" + std::to_string(pid) + "/stat: malformed");
  size_t pos = rp + 1;
  for (int field = 3; field <= 22; ++field) {
    while (pos < stat->size() && (*stat)[pos] == ' ') ++pos;
    size_t end = stat->find(' ', pos);
    if (end == std::string::npos) end = stat->size();
    if (field == 22) {
      uint64_t v = 0;
      auto [p, ec] = std::from_chars(stat->data() + pos, stat->data() + end, v);
      if (ec != std::errc() || p != stat->data() + end || pos == end)
        return internal_error("/proc/" + std::to_string(pid) + "/stat: malformed start time");
      return v;
    }
    pos = end;
  }
  return internal_error("/proc/" + std::to_string(pid) + "/stat: too few fields");
}

Result<std::string> read_file(const std::string& path, size_t limit) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return errno_error("open", path);
  std::string out;
  char buf[8192];
  for (;;) {
    ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno_error("read", path);
    }
    if (n == 0) break;
    if (out.size() + static_cast<size_t>(n) > limit) return internal_error("read " + path + ": larger than limit");
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

static Status write_all(Os& os, int fd, std::string_view data, const std::string& path) {
  while (!data.empty()) {
    ssize_t n = os.write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno_error("write", path);
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  return Status::Ok();
}

Status write_file(const std::string& path, std::string_view data, Os& os) {
  UniqueFd fd(os.open(path.c_str(), O_WRONLY | O_CLOEXEC | O_CREAT | O_TRUNC, 0644));
  if (!fd) return errno_error("open", path);
  return write_all(os, fd.get(), data, path);
}

Status write_file_atomic(const std::string& path, std::string_view data, Os& os) {
  std::string tmp = path + ".tmp." + random_hex(4);
  {
    UniqueFd fd(os.open(tmp.c_str(), O_WRONLY | O_CLOEXEC | O_CREAT | O_EXCL, 0600));
    if (!fd) return errno_error("open", tmp);
    Status s = write_all(os, fd.get(), data, tmp);
    if (s && os.fsync(fd.get()) != 0) s = errno_error("fsync", tmp);
    if (!s) {
      ::unlink(tmp.c_str());
      return s;
    }
  }
  if (os.rename(tmp.c_str(), path.c_str()) != 0) {
    Error e = errno_error("rename", tmp);
    ::unlink(tmp.c_str());
    return e;
  }
  return Status::Ok();
}

Result<UniqueFd> lock_file(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!fd) return errno_error("open", path);
  if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK) return errno_error("flock", path);
    std::string holder;
    char buf[32];
    ssize_t n = ::pread(fd.get(), buf, sizeof buf - 1, 0);
    if (n > 0) {
      buf[n] = 0;
      long pid = std::strtol(buf, nullptr, 10);
      if (pid > 0) holder = " by pid " + std::to_string(pid);
    }
    return Error(ErrorKind::kConflict, path + " is locked" + holder);
  }
  std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd.get(), 0) != 0) return errno_error("ftruncate", path);
  if (::pwrite(fd.get(), pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) return errno_error("write", path);
  return fd;
}

Status make_dirs(const std::string& path, unsigned mode, Os& os) {
  if (path.empty()) return invalid_error("make_dirs: empty path");
  std::string cur;
  size_t i = 0;
  while (i <= path.size()) {
    size_t j = path.find('/', i);
    if (j == std::string::npos) j = path.size();
    cur = path.substr(0, j);
    if (!cur.empty() && os.mkdir(cur.c_str(), mode) != 0 && errno != EEXIST) return errno_error("mkdir", cur);
    i = j + 1;
  }
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return errno_error("stat", path);
  if (!S_ISDIR(st.st_mode)) return internal_error("mkdir " + path + ": exists and is not a directory");
  return Status::Ok();
}

// Removes the entries of the directory open at dfd, then nothing else; the
// caller removes the directory itself. Never follows symlinks, never crosses
// into another filesystem (a mount left behind is an error, not a target).
static Status remove_children(Os& os, int dfd, const std::string& path, dev_t dev) {
  int dup = ::dup(dfd);
  if (dup < 0) return errno_error("dup", path);
  DIR* d = ::fdopendir(dup);
  if (!d) {
    ::close(dup);
    return errno_error("fdopendir", path);
  }
  Status result;
  while (struct dirent* e = ::readdir(d)) {
    std::string_view name(e->d_name);
    if (name == "." || name == "..") continue;
    struct stat st;
    if (::fstatat(dfd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno == ENOENT) continue;
      result = errno_error("fstatat", path + "/" + e->d_name);
      break;
    }
    if (S_ISDIR(st.st_mode)) {
      if (st.st_dev != dev) {
        result = internal_error("remove " + path + "/" + e->d_name + ": is a mount point, not removing");
        break;
      }
      UniqueFd child(::openat(dfd, e->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
      if (!child) {
        result = errno_error("openat", path + "/" + e->d_name);
        break;
      }
      if (Status s = remove_children(os, child.get(), path + "/" + e->d_name, dev); !s) {
        result = s;
        break;
      }
      if (os.unlinkat(dfd, e->d_name, AT_REMOVEDIR) != 0 && errno != ENOENT) {
        result = errno_error("rmdir", path + "/" + e->d_name);
        break;
      }
    } else if (os.unlinkat(dfd, e->d_name, 0) != 0 && errno != ENOENT) {
      result = errno_error("unlink", path + "/" + e->d_name);
      break;
    }
  }
  ::closedir(d);
  return result;
}

Status remove_tree(const std::string& path, Os& os) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return Status::Ok();
    return errno_error("lstat", path);
  }
  if (!S_ISDIR(st.st_mode)) {
    if (os.unlinkat(AT_FDCWD, path.c_str(), 0) != 0 && errno != ENOENT) return errno_error("unlink", path);
    return Status::Ok();
  }
  UniqueFd dfd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!dfd) return errno_error("open", path);
  if (Status s = remove_children(os, dfd.get(), path, st.st_dev); !s) return s;
  if (os.rmdir(path.c_str()) != 0 && errno != ENOENT) return errno_error("rmdir", path);
  return Status::Ok();
}

bool path_exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

uint64_t monotonic_ns() {
  struct timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

int64_t unix_seconds() { return static_cast<int64_t>(::time(nullptr)); }

std::string format_rfc3339(int64_t t) {
  time_t tt = static_cast<time_t>(t);
  struct tm tm;
  ::gmtime_r(&tt, &tm);
  char buf[32];
  ::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::string random_hex(size_t n_bytes) {
  static const char kHex[] = "0123456789abcdef";
  std::string raw(n_bytes, '\0');
  size_t got = 0;
  while (got < n_bytes) {
    ssize_t n = ::getrandom(raw.data() + got, n_bytes - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      // getrandom cannot fail on a booted kernel with these flags; treat as fatal invariant.
      assert(false && "getrandom failed");
      return {};
    }
    got += static_cast<size_t>(n);
  }
  std::string out;
  out.reserve(n_bytes * 2);
  for (unsigned char c : raw) {
    out += kHex[c >> 4];
    out += kHex[c & 15];
  }
  return out;
}

std::string read_tail(const std::string& path, size_t n) {
  auto t = read_file(path, 4 << 20);
  if (!t || t->empty()) return "";
  std::string s = t->size() > n ? t->substr(t->size() - n) : *t;
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

Status run_and_wait(const std::vector<std::string>& argv, const std::string& log_path) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  int rc = ::posix_spawnp(&pid, args[0], &fa, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) return errno_error("spawn", argv[0], rc);
  int st = 0;
  while (::waitpid(pid, &st, 0) < 0)
    if (errno != EINTR) return errno_error("waitpid", argv[0]);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
    auto out = read_file(log_path, 4096);
    return internal_error(argv[0] + " failed: " + (out ? *out : std::string("(no output)")));
  }
  return {};
}

namespace {
uint64_t usage_below(int dfd, dev_t dev, int depth) {
  if (depth > 256) return 0;
  int dup = ::dup(dfd);
  if (dup < 0) return 0;
  DIR* d = ::fdopendir(dup);
  if (!d) {
    ::close(dup);
    return 0;
  }
  uint64_t total = 0;
  while (struct dirent* e = ::readdir(d)) {
    std::string_view n(e->d_name);
    if (n == "." || n == "..") continue;
    struct stat st;
    if (::fstatat(dfd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
    total += static_cast<uint64_t>(st.st_blocks) * 512;
    if (S_ISDIR(st.st_mode) && st.st_dev == dev) {
      UniqueFd c(::openat(dfd, e->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
      if (c) total += usage_below(c.get(), dev, depth + 1);
    }
  }
  ::closedir(d);
  return total;
}
}  // namespace

uint64_t disk_usage(int dfd) {
  struct stat root;
  if (::fstat(dfd, &root) != 0) return 0;
  return usage_below(dfd, root.st_dev, 0);
}

uint64_t disk_usage(const std::string& path) {
  UniqueFd d(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!d) {
    struct stat st;
    return ::lstat(path.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_blocks) * 512 : 0;
  }
  return disk_usage(d.get());
}

}  // namespace sg::sys
