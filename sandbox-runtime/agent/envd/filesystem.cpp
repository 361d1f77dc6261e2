// Filesystem operations.
#include "sandbox-runtime/agent/envd/filesystem.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <ctime>
#include <filesystem>

#include "base/sys.h"

namespace sg::envd {

std::string resolve_path(const std::string& home, const std::string& path) {
  std::string p = path;
  if (p == "~") p = home;
  else if (p.rfind("~/", 0) == 0) p = home + p.substr(1);
  else if (p.empty() || p[0] != '/') p = home + "/" + p;
  std::string out = std::filesystem::path(p).lexically_normal().string();
  while (out.size() > 1 && out.back() == '/') out.pop_back();
  return out;
}

std::string permissions_string(mode_t m) {
  std::string s;
  if (S_ISDIR(m)) s += 'd';
  if (S_ISLNK(m)) s += 'L';
  if (S_ISBLK(m) || S_ISCHR(m)) s += 'D';
  if (S_ISFIFO(m)) s += 'p';
  if (S_ISSOCK(m)) s += 'S';
  if (m & S_ISUID) s += 'u';
  if (m & S_ISGID) s += 'g';
  if (S_ISCHR(m)) s += 'c';
  if (m & S_ISVTX) s += 't';
  if (s.empty()) s += '-';
  const char* rwx = "rwxrwxrwx";
  for (int i = 0; i < 9; ++i) s += (m & (1 << (8 - i))) ? rwx[i] : '-';
  return s;
}

std::string rfc3339_nanos(const struct timespec& ts) {
  struct tm tm;
  time_t t = ts.tv_sec;
  gmtime_r(&t, &tm);
  char buf[64];
  size_t n = std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S", &tm);
  std::string out(buf, n);
  long ns = ts.tv_nsec;
  if (ns != 0) {
    char f[32];
    if (ns % 1000000 == 0) std::snprintf(f, sizeof f, ".%03ld", ns / 1000000);
    else if (ns % 1000 == 0) std::snprintf(f, sizeof f, ".%06ld", ns / 1000);
    else std::snprintf(f, sizeof f, ".%09ld", ns);
    out += f;
  }
  return out + "Z";
}

static const char* file_type_name(mode_t m) {
  if (S_ISREG(m)) return "FILE_TYPE_FILE";
  if (S_ISDIR(m)) return "FILE_TYPE_DIRECTORY";
  if (S_ISLNK(m)) return "FILE_TYPE_SYMLINK";
  return nullptr;
}

static json metadata_of(const std::string& path) {
  json md = json::object();
  char names[4096];
  ssize_t n = ::llistxattr(path.c_str(), names, sizeof names);
  for (ssize_t i = 0; n > 0 && i < n;) {
    std::string name(names + i);
    i += static_cast<ssize_t>(name.size()) + 1;
    if (name.rfind("user.e2b.", 0) != 0) continue;
    char val[4096];
    ssize_t k = ::lgetxattr(path.c_str(), name.c_str(), val, sizeof val);
    if (k >= 0) md[name.substr(9)] = std::string(val, static_cast<size_t>(k));
  }
  return md;
}

static json entry_from_stat(const std::string& path, const struct stat& st, const UserDb& users) {
  json e = json::object();
  std::string name = std::filesystem::path(path).filename().string();
  if (path == "/") name = "/";
  e["name"] = name;
  if (const char* t = file_type_name(st.st_mode)) e["type"] = t;
  e["path"] = path;
  if (st.st_size != 0) e["size"] = std::to_string(st.st_size);
  if ((st.st_mode & 0777) != 0) e["mode"] = st.st_mode & 0777;
  e["permissions"] = permissions_string(st.st_mode);
  e["owner"] = users.user_name(st.st_uid);
  e["group"] = users.group_name(st.st_gid);
  e["modifiedTime"] = rfc3339_nanos(st.st_mtim);
  if (S_ISLNK(st.st_mode)) {
    char* real = ::realpath(path.c_str(), nullptr);
    if (real) {
      e["symlinkTarget"] = std::string(real);
      ::free(real);
    } else {
      char buf[PATH_MAX];
      ssize_t n = ::readlink(path.c_str(), buf, sizeof buf);
      if (n > 0) e["symlinkTarget"] = std::string(buf, static_cast<size_t>(n));
    }
  }
  json md = metadata_of(path);
  if (!md.empty()) e["metadata"] = md;
  return e;
}

RpcResult<json> entry_info(const std::string& path, const UserDb& users) {
  struct stat st;
  if (::lstat(path.c_str(), &st) < 0) {
    int e = errno;
    if (e == ENOENT) return rpc_error(Code::kNotFound, "file not found: " + path);
    return rpc_errno("stat", path, e);
  }
  return entry_from_stat(path, st, users);
}

RpcResult<json> fs_stat(const std::string& path, const UserDb& users) {
  auto e = entry_info(path, users);
  if (!e) return e.error();
  return json{{"entry", std::move(*e)}};
}

RpcStatus make_parents(const std::string& dir, const User& owner) {
  std::vector<std::string> created;
  std::string cur;
  std::filesystem::path p(dir);
  for (auto& part : p) {
    std::string s = part.string();
    if (s == "/") {
      cur = "/";
      continue;
    }
    cur = cur == "/" ? "/" + s : (cur.empty() ? s : cur + "/" + s);
    struct stat st;
    if (::stat(cur.c_str(), &st) == 0) {
      if (!S_ISDIR(st.st_mode))
        return rpc_error(Code::kInvalidArgument, "path " + cur + " exists but is not a directory");
      continue;
    }
    if (::mkdir(cur.c_str(), 0755) < 0 && errno != EEXIST) return rpc_errno("mkdir", cur, errno);
    if (::lchown(cur.c_str(), owner.uid, owner.gid) < 0) return rpc_errno("chown", cur, errno);
  }
  return rpc_ok();
}

RpcResult<json> fs_make_dir(const std::string& path, const User& owner, const UserDb& users) {
  struct stat st;
  if (::lstat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) return rpc_error(Code::kAlreadyExists, "directory already exists: " + path);
    return rpc_error(Code::kInvalidArgument, "path already exists but is not a directory: " + path);
  }
  auto s = make_parents(path, owner);
  if (!s) return s.error();
  return fs_stat(path, users);
}

RpcResult<json> fs_move(const std::string& src, const std::string& dst, const User& owner, const UserDb& users) {
  struct stat st;
  if (::lstat(src.c_str(), &st) < 0) {
    if (errno == ENOENT) return rpc_error(Code::kNotFound, "source not found: " + src);
    return rpc_errno("stat", src, errno);
  }
  auto s = make_parents(std::filesystem::path(dst).parent_path().string(), owner);
  if (!s) return s.error();
  if (::rename(src.c_str(), dst.c_str()) < 0) return rpc_errno("rename " + src + " to", dst, errno);
  return fs_stat(dst, users);
}

static RpcStatus list_into(const std::string& dir, int depth, const UserDb& users, json& out, size_t& budget) {
  UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd) return rpc_errno("open directory", dir, errno);
  DIR* d = ::fdopendir(fd.release());
  if (!d) return rpc_errno("opendir", dir, errno);
  std::vector<std::string> names;
  while (struct dirent* de = ::readdir(d)) {
    std::string n = de->d_name;
    if (n != "." && n != "..") names.push_back(std::move(n));
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  for (auto& n : names) {
    if (budget == 0) return rpc_error(Code::kResourceExhausted, "directory listing of " + dir + " too large");
    --budget;
    std::string child = dir == "/" ? "/" + n : dir + "/" + n;
    struct stat st;
    if (::lstat(child.c_str(), &st) < 0) continue;  // removed meanwhile
    out.push_back(entry_from_stat(child, st, users));
    if (depth > 1 && S_ISDIR(st.st_mode)) {
      auto s = list_into(child, depth - 1, users, out, budget);
      if (!s && s.error().code == Code::kResourceExhausted) return s;
    }
  }
  return rpc_ok();
}

RpcResult<json> fs_list_dir(const std::string& path, int depth, const UserDb& users) {
  if (depth < 1) depth = 1;
  struct stat st;
  if (::stat(path.c_str(), &st) < 0) {
    if (errno == ENOENT) return rpc_error(Code::kNotFound, "directory not found: " + path);
    return rpc_errno("stat", path, errno);
  }
  if (!S_ISDIR(st.st_mode)) return rpc_error(Code::kInvalidArgument, "path is not a directory: " + path);
  json entries = json::array();
  size_t budget = 1000000;
  auto s = list_into(path, depth, users, entries, budget);
  if (!s) return s.error();
  return json{{"entries", std::move(entries)}};
}

RpcStatus fs_remove(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) < 0) {
    if (errno == ENOENT) return rpc_error(Code::kNotFound, "file not found: " + path);
    return rpc_errno("stat", path, errno);
  }
  if (S_ISDIR(st.st_mode)) {
    Status s = sys::remove_tree(path);
    if (!s) return rpc_error(Code::kInternal, s.error().message());
    return rpc_ok();
  }
  if (::unlink(path.c_str()) < 0) return rpc_errno("remove", path, errno);
  return rpc_ok();
}

}  // namespace sg::envd
