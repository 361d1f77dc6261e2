// copy_layer: see layer_copy.h.
#include "sandbox-runtime/process/layer_copy.h"

#include <fcntl.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <map>
#include <string_view>
#include <utility>
#include <vector>

#include "base/fd.h"
#include "base/sys.h"

namespace sg::process {

namespace {

struct Copier {
  IdShift shift;
  LayerStats stats;
  // (dev, ino) of a multiply linked file -> its path relative to the root.
  std::map<std::pair<dev_t, ino_t>, std::string> links;
  int dst_root = -1;

  uint32_t id(uint32_t host) const {
    if (shift.count == 0) return host;
    if (host >= shift.base && host - shift.base < shift.count) return host - shift.base;
    return 65534;
  }

  // Extended attributes of a file or directory, overlay's opaque mark
  // among them; overlay's bookkeeping of the upper layer it was (origin,
  // impure, nlink, upper) is not carried into a lower layer. Through
  // /proc/self/fd paths: the *at xattr calls only exist from Linux 6.13.
  Status xattrs(int src_fd, const char* src_name, int dst_fd, const char* dst_name, const std::string& what) {
    UniqueFd s(::openat(src_fd, src_name, O_PATH | O_NOFOLLOW | O_CLOEXEC));
    UniqueFd d(::openat(dst_fd, dst_name, O_PATH | O_NOFOLLOW | O_CLOEXEC));
    if (!s || !d) return sys::errno_error("open", what);
    std::string sp = "/proc/self/fd/" + std::to_string(s.get()), dp = "/proc/self/fd/" + std::to_string(d.get());
    ssize_t n = ::listxattr(sp.c_str(), nullptr, 0);
    if (n < 0) {
      if (errno == ENOTSUP || errno == ENODATA) return Status::Ok();
      return sys::errno_error("listxattr", what);
    }
    if (n == 0) return Status::Ok();
    std::string names(static_cast<size_t>(n), '\0');
    n = ::listxattr(sp.c_str(), names.data(), names.size());
    if (n < 0) return sys::errno_error("listxattr", what);
    names.resize(static_cast<size_t>(n));
    for (size_t at = 0; at < names.size();) {
      std::string name(names.c_str() + at);
      at += name.size() + 1;
      if (name.empty()) continue;
      if (name == "trusted.overlay.origin" || name == "trusted.overlay.impure" || name == "trusted.overlay.nlink" ||
          name == "trusted.overlay.upper")
        continue;
      std::string value(65536, '\0');
      ssize_t v = ::getxattr(sp.c_str(), name.c_str(), value.data(), value.size());
      if (v < 0) return sys::errno_error("getxattr " + name, what);
      if (::setxattr(dp.c_str(), name.c_str(), value.data(), static_cast<size_t>(v), 0) != 0)
        return sys::errno_error("setxattr " + name, what);
    }
    return Status::Ok();
  }

  Status attrs(int src_dir, int dst_dir, const char* name, const struct stat& st, const std::string& what) {
    bool link = S_ISLNK(st.st_mode);
    if (::fchownat(dst_dir, name, id(st.st_uid), id(st.st_gid), AT_SYMLINK_NOFOLLOW) != 0)
      return sys::errno_error("chown", what);
    if (!link && ::fchmodat(dst_dir, name, st.st_mode & 07777, 0) != 0) return sys::errno_error("chmod", what);
    if (!link) {
      if (Status s = xattrs(src_dir, name, dst_dir, name, what); !s) return s;
    }
    struct timespec ts[2] = {st.st_atim, st.st_mtim};
    if (::utimensat(dst_dir, name, ts, AT_SYMLINK_NOFOLLOW) != 0) return sys::errno_error("utimensat", what);
    return Status::Ok();
  }

  Status file(int src_dir, int dst_dir, const char* name, const struct stat& st, const std::string& what) {
    UniqueFd in(::openat(src_dir, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
    if (!in) return sys::errno_error("open", what);
    UniqueFd out(::openat(dst_dir, name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
    if (!out) return sys::errno_error("create", what);
    // copy_file_range shares extents where it can; between filesystems of
    // different types (a size-limited layer's ext4 and the host's) it
    // refuses, and sendfile copies through the page cache. Both move the
    // descriptors' offsets, so one can take over from the other.
    bool in_kernel_copy = true;
    for (off_t left = st.st_size; left > 0;) {
      size_t want = static_cast<size_t>(std::min<off_t>(left, 1 << 30));
      ssize_t n = in_kernel_copy ? ::copy_file_range(in.get(), nullptr, out.get(), nullptr, want, 0)
                                 : ::sendfile(out.get(), in.get(), nullptr, want);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && in_kernel_copy && (errno == EXDEV || errno == EINVAL || errno == EOPNOTSUPP || errno == ENOSYS)) {
        in_kernel_copy = false;
        continue;
      }
      if (n < 0) return sys::errno_error(in_kernel_copy ? "copy_file_range" : "sendfile", what);
      if (n == 0) break;  // shrank meanwhile
      left -= n;
    }
    stats.bytes += static_cast<uint64_t>(st.st_size);
    return Status::Ok();
  }

  Status dir(int src, int dst, const std::string& rel, int depth) {
    if (depth > kMaxLayerDepth) return invalid_error("layer: deeper than " + std::to_string(kMaxLayerDepth) + " levels at " + rel);
    int dup = ::dup(src);
    if (dup < 0) return sys::errno_error("dup", rel);
    DIR* d = ::fdopendir(dup);
    if (!d) {
      ::close(dup);
      return sys::errno_error("fdopendir", rel);
    }
    std::vector<std::string> names;
    while (struct dirent* e = ::readdir(d)) {
      std::string_view n(e->d_name);
      if (n != "." && n != "..") names.emplace_back(n);
    }
    ::closedir(d);
    for (const std::string& n : names) {
      if (++stats.entries > kMaxLayerEntries)
        return invalid_error("layer: more than " + std::to_string(kMaxLayerEntries) + " files");
      std::string what = rel + "/" + n;
      struct stat st;
      if (::fstatat(src, n.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
        if (errno == ENOENT) continue;
        return sys::errno_error("stat", what);
      }
      if (!S_ISDIR(st.st_mode) && st.st_nlink > 1) {
        auto key = std::make_pair(st.st_dev, st.st_ino);
        auto it = links.find(key);
        if (it != links.end()) {
          if (::linkat(dst_root, it->second.c_str(), dst, n.c_str(), 0) != 0) return sys::errno_error("link", what);
          continue;
        }
        links.emplace(key, what.substr(1));
      }
      if (S_ISDIR(st.st_mode)) {
        if (::mkdirat(dst, n.c_str(), 0700) != 0) return sys::errno_error("mkdir", what);
        UniqueFd s(::openat(src, n.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
        UniqueFd t(::openat(dst, n.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
        if (!s || !t) return sys::errno_error("open", what);
        if (Status r = dir(s.get(), t.get(), what, depth + 1); !r) return r;
      } else if (S_ISREG(st.st_mode)) {
        if (Status r = file(src, dst, n.c_str(), st, what); !r) return r;
      } else if (S_ISLNK(st.st_mode)) {
        std::string target(PATH_MAX, '\0');
        ssize_t len = ::readlinkat(src, n.c_str(), target.data(), target.size());
        if (len < 0) return sys::errno_error("readlink", what);
        target.resize(static_cast<size_t>(len));
        if (::symlinkat(target.c_str(), dst, n.c_str()) != 0) return sys::errno_error("symlink", what);
      } else if (S_ISFIFO(st.st_mode)) {
        if (::mkfifoat(dst, n.c_str(), 0600) != 0) return sys::errno_error("mkfifo", what);
      } else if (S_ISCHR(st.st_mode) && st.st_rdev == makedev(0, 0)) {
        // An overlay whiteout: the file is deleted in this layer.
        if (::mknodat(dst, n.c_str(), S_IFCHR | 0600, makedev(0, 0)) != 0) return sys::errno_error("mknod", what);
      } else {
        continue;  // a socket or a device: nothing a layer keeps
      }
      if (Status r = attrs(src, dst, n.c_str(), st, what); !r) return r;
    }
    return Status::Ok();
  }
};

}  // namespace

Result<LayerStats> copy_layer(const std::string& src, const std::string& dst, IdShift shift) {
  if (sys::path_exists(dst)) return conflict_error("layer " + dst + " already exists");
  std::string tmp = dst + ".partial";
  if (Status s = sys::remove_tree(tmp); !s) return s.error();
  UniqueFd s(::open(src.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!s) return sys::errno_error("open", src);
  struct stat st;
  if (::fstat(s.get(), &st) != 0) return sys::errno_error("stat", src);
  if (::mkdir(tmp.c_str(), 0700) != 0) return sys::errno_error("mkdir", tmp);
  Copier c;
  c.shift = shift;
  UniqueFd t(::open(tmp.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  Status r = t ? Status::Ok() : Status(sys::errno_error("open", tmp));
  c.dst_root = t.get();
  if (r) r = c.dir(s.get(), t.get(), "", 0);
  // The root's own owner, mode and attributes (an opaque root among them).
  if (r && ::fchown(t.get(), c.id(st.st_uid), c.id(st.st_gid)) != 0) r = sys::errno_error("chown", tmp);
  if (r && ::fchmod(t.get(), st.st_mode & 07777) != 0) r = sys::errno_error("chmod", tmp);
  if (r) r = c.xattrs(s.get(), ".", t.get(), ".", src);
  if (r && ::rename(tmp.c_str(), dst.c_str()) != 0) r = sys::errno_error("rename", tmp);
  if (!r) {
    t.reset();
    (void)sys::remove_tree(tmp);
    return r.error();
  }
  return c.stats;
}

}  // namespace sg::process
