// apply_layer: see oci_layer.h. A streaming tar reader (ustar, GNU long
// names, PAX path and linkpath) over zlib's gzip or zstd's decoder.
#include "sandbox-runtime/builds/oci_layer.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>
#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <cerrno>
#include <optional>
#include <cstring>
#include <string_view>
#include <vector>

#include "base/fd.h"
#include "base/sys.h"

namespace sg::builds {

namespace {

constexpr size_t kBlock = 512;
constexpr size_t kMaxName = 4096;
constexpr size_t kMaxPax = 1 << 20;

// Bytes of the layer, decompressed when it is gzip or zstd (by magic).
class Source {
 public:
  explicit Source(int fd) : fd_(fd) {}
  ~Source() {
    if (gz_) inflateEnd(&z_);
    if (zs_) ZSTD_freeDStream(zs_);
  }
  Source(const Source&) = delete;
  Source& operator=(const Source&) = delete;
  Status open() {
    unsigned char magic[4];
    ssize_t n = ::pread(fd_, magic, 4, 0);
    if (n >= 2 && magic[0] == 0x1f && magic[1] == 0x8b) {
      std::memset(&z_, 0, sizeof z_);
      if (inflateInit2(&z_, 16 + MAX_WBITS) != Z_OK) return internal_error("inflateInit2");
      gz_ = true;
    } else if (n == 4 && magic[0] == 0x28 && magic[1] == 0xb5 && magic[2] == 0x2f && magic[3] == 0xfd) {
      zs_ = ZSTD_createDStream();
      if (!zs_) return internal_error("ZSTD_createDStream");
      // A frame may ask for a window of up to 128 MiB (zstd's default
      // limit, set here so that it stays the bound); more is refused.
      if (ZSTD_isError(ZSTD_DCtx_setParameter(zs_, ZSTD_d_windowLogMax, 27)))
        return internal_error("ZSTD_d_windowLogMax");
    }
    return Status::Ok();
  }
  // Exactly n bytes into out; false at a clean end before any byte.
  Result<bool> read(char* out, size_t n) {
    size_t got = 0;
    while (got < n) {
      Result<size_t> r = some(out + got, n - got);
      if (!r) return r.error();
      if (*r == 0) {
        if (got == 0) return false;
        return invalid_error("layer: the archive ends inside a member");
      }
      got += *r;
    }
    return true;
  }

 private:
  Result<size_t> raw(char* out, size_t n) {
    for (;;) {
      ssize_t r = ::read(fd_, out, n);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) return sys::errno_error("read", "layer");
      return static_cast<size_t>(r);
    }
  }
  Result<size_t> unzstd(char* out, size_t n) {
    ZSTD_outBuffer ob{out, n, 0};
    while (ob.pos == 0) {
      if (zin_.pos == zin_.size && !eof_) {
        Result<size_t> r = raw(in_, sizeof in_);
        if (!r) return r.error();
        if (*r == 0) eof_ = true;
        zin_ = ZSTD_inBuffer{in_, *r, 0};
      }
      size_t rc = ZSTD_decompressStream(zs_, &ob, &zin_);
      if (ZSTD_isError(rc)) return invalid_error(std::string("layer: bad zstd data: ") + ZSTD_getErrorName(rc));
      if (ob.pos == 0 && zin_.pos == zin_.size && eof_) {
        // Frames may follow one another; the input may not end inside one.
        if (rc != 0) return invalid_error("layer: the zstd stream ends inside a frame");
        break;
      }
    }
    return ob.pos;
  }
  Result<size_t> some(char* out, size_t n) {
    if (zs_) return unzstd(out, n);
    if (!gz_) return raw(out, n);
    z_.next_out = reinterpret_cast<Bytef*>(out);
    z_.avail_out = static_cast<uInt>(n);
    while (z_.avail_out == n) {
      if (z_.avail_in == 0 && !eof_) {
        Result<size_t> r = raw(in_, sizeof in_);
        if (!r) return r.error();
        if (*r == 0) eof_ = true;
        z_.next_in = reinterpret_cast<Bytef*>(in_);
        z_.avail_in = static_cast<uInt>(*r);
      }
      if (z_.avail_in == 0 && eof_) break;
      int rc = inflate(&z_, Z_NO_FLUSH);
      if (rc == Z_STREAM_END) {
        // Concatenated gzip members continue; else this is the end.
        if (z_.avail_in == 0 && eof_) break;
        if (inflateReset(&z_) != Z_OK) return invalid_error("layer: bad gzip stream");
        continue;
      }
      if (rc != Z_OK && rc != Z_BUF_ERROR) return invalid_error("layer: bad gzip data");
      if (rc == Z_BUF_ERROR && z_.avail_in == 0 && eof_) break;
    }
    return n - z_.avail_out;
  }

  int fd_;
  bool gz_ = false;
  bool eof_ = false;
  z_stream z_{};
  ZSTD_DStream* zs_ = nullptr;
  ZSTD_inBuffer zin_{nullptr, 0, 0};
  char in_[1 << 16];
};

uint64_t octal(const char* p, size_t n) {
  // base-256 (GNU) for large values
  if (n > 0 && (static_cast<unsigned char>(p[0]) & 0x80)) {
    uint64_t v = static_cast<unsigned char>(p[0]) & 0x7f;
    for (size_t i = 1; i < n; ++i) v = (v << 8) | static_cast<unsigned char>(p[i]);
    return v;
  }
  uint64_t v = 0;
  size_t i = 0;
  while (i < n && (p[i] == ' ' || p[i] == '\0')) ++i;
  for (; i < n && p[i] >= '0' && p[i] <= '7'; ++i) v = v * 8 + static_cast<uint64_t>(p[i] - '0');
  return v;
}

std::string field(const char* p, size_t n) { return std::string(p, strnlen(p, n)); }

// "a/./b//c/" -> "a/b/c"; nullopt for ".." components or an empty name.
std::optional<std::string> clean(std::string_view name) {
  std::string out;
  size_t i = 0;
  while (i <= name.size()) {
    size_t j = name.find('/', i);
    if (j == std::string_view::npos) j = name.size();
    std::string_view c = name.substr(i, j - i);
    if (c == "..") return std::nullopt;
    if (!c.empty() && c != ".") {
      if (!out.empty()) out += '/';
      out += c;
    }
    i = j + 1;
  }
  return out;
}

int open_in_root(int root, const std::string& path, int flags) {
  struct open_how how {};
  how.flags = static_cast<uint64_t>(flags) | O_CLOEXEC;
  how.resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS;
  return static_cast<int>(::syscall(SYS_openat2, root, path.empty() ? "." : path.c_str(), &how, sizeof how));
}

struct Applier {
  int root;
  const LayerLimits& lim;
  AppliedLayer stats;

  // The parent directory of path (made, as root 0755, where missing).
  Result<UniqueFd> parent(const std::string& path, std::string* base) {
    size_t slash = path.rfind('/');
    std::string dir = slash == std::string::npos ? "" : path.substr(0, slash);
    *base = slash == std::string::npos ? path : path.substr(slash + 1);
    UniqueFd d(open_in_root(root, dir, O_RDONLY | O_DIRECTORY));
    if (d) return d;
    if (errno != ENOENT) return sys::errno_error("open", "layer directory " + dir);
    // Make the missing directories one by one, each inside the root.
    std::string cur;
    UniqueFd at(open_in_root(root, "", O_RDONLY | O_DIRECTORY));
    size_t i = 0;
    while (i < dir.size()) {
      size_t j = dir.find('/', i);
      if (j == std::string::npos) j = dir.size();
      std::string c = dir.substr(i, j - i);
      cur += (cur.empty() ? "" : "/") + c;
      UniqueFd next(open_in_root(root, cur, O_RDONLY | O_DIRECTORY));
      if (!next) {
        if (::mkdirat(at.get(), c.c_str(), 0755) != 0 && errno != EEXIST) return sys::errno_error("mkdir", "layer " + cur);
        next.reset(open_in_root(root, cur, O_RDONLY | O_DIRECTORY));
        if (!next) return sys::errno_error("open", "layer " + cur);
      }
      at = std::move(next);
      i = j + 1;
    }
    return at;
  }

  Status remove_all(int dirfd, const std::string& name) {
    UniqueFd d(::openat(dirfd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (d) {
      if (Status s = empty(d.get()); !s) return s;
      if (::unlinkat(dirfd, name.c_str(), AT_REMOVEDIR) != 0 && errno != ENOENT) return sys::errno_error("rmdir", name);
      return Status::Ok();
    }
    if (::unlinkat(dirfd, name.c_str(), 0) != 0 && errno != ENOENT) return sys::errno_error("unlink", name);
    return Status::Ok();
  }

  Status empty(int dirfd) {
    int dup = ::dup(dirfd);
    if (dup < 0) return sys::errno_error("dup", "layer");
    DIR* d = ::fdopendir(dup);
    if (!d) {
      ::close(dup);
      return sys::errno_error("fdopendir", "layer");
    }
    std::vector<std::string> names;
    while (struct dirent* e = ::readdir(d)) {
      std::string_view n(e->d_name);
      if (n != "." && n != "..") names.emplace_back(n);
    }
    ::closedir(d);
    for (const std::string& n : names)
      if (Status s = remove_all(dirfd, n); !s) return s;
    return Status::Ok();
  }

  Status entry(char type, const std::string& path, const std::string& link, uint64_t size, const char* hdr,
               Source& src) {
    if (++stats.entries > lim.max_entries) return invalid_error("layer: more than " + std::to_string(lim.max_entries) + " members");
    std::string base;
    if (path.empty()) return skip(src, size);  // the root itself
    Result<UniqueFd> dir = parent(path, &base);
    if (!dir) return dir.error();
    int d = dir->get();
    // Whiteouts: they act on the layers below and leave nothing.
    if (base == ".wh..wh..opq") {
      ++stats.whiteouts;
      if (Status s = empty(d); !s) return s;
      return skip(src, size);
    }
    if (base.rfind(".wh.", 0) == 0) {
      ++stats.whiteouts;
      if (Status s = remove_all(d, base.substr(4)); !s) return s;
      return skip(src, size);
    }
    uint32_t mode = static_cast<uint32_t>(octal(hdr + 100, 8)) & 07777;
    uid_t uid = static_cast<uid_t>(octal(hdr + 108, 8));
    gid_t gid = static_cast<gid_t>(octal(hdr + 116, 8));
    int64_t mtime = static_cast<int64_t>(octal(hdr + 136, 12));
    // What the member replaces goes first (a directory stays: its
    // contents merge).
    struct stat st;
    bool exists = ::fstatat(d, base.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0;
    if (exists && !(type == '5' && S_ISDIR(st.st_mode)))
      if (Status s = remove_all(d, base); !s) return s;
    switch (type) {
      case '0':
      case '\0':
      case '7': {
        stats.bytes += size;
        if (stats.bytes > lim.max_bytes) return invalid_error("layer: more than " + std::to_string(lim.max_bytes) + " bytes");
        UniqueFd f(::openat(d, base.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
        if (!f) return sys::errno_error("create", "layer " + path);
        if (Status s = copy(src, f.get(), size, path); !s) return s;
        break;
      }
      case '5':
        if (!exists && ::mkdirat(d, base.c_str(), 0700) != 0) return sys::errno_error("mkdir", "layer " + path);
        if (Status s = skip(src, size); !s) return s;
        break;
      case '2':
        if (::symlinkat(link.c_str(), d, base.c_str()) != 0) return sys::errno_error("symlink", "layer " + path);
        break;
      case '1': {
        std::optional<std::string> target = clean(link);
        if (!target) return invalid_error("layer: hard link " + path + " -> " + link + " climbs out");
        UniqueFd t(open_in_root(root, *target, O_PATH | O_NOFOLLOW));
        if (!t) return sys::errno_error("open", "layer hard link target " + *target);
        if (::linkat(t.get(), "", d, base.c_str(), AT_EMPTY_PATH) != 0) return sys::errno_error("link", "layer " + path);
        return skip(src, size);  // a hard link keeps its target's attributes
      }
      case '6':
        if (::mkfifoat(d, base.c_str(), 0600) != 0) return sys::errno_error("mkfifo", "layer " + path);
        break;
      default:
        return skip(src, size);  // devices, sockets, unknown types: nothing a template keeps
    }
    if (::fchownat(d, base.c_str(), uid, gid, AT_SYMLINK_NOFOLLOW) != 0) return sys::errno_error("chown", "layer " + path);
    if (type != '2' && ::fchmodat(d, base.c_str(), mode, 0) != 0) return sys::errno_error("chmod", "layer " + path);
    struct timespec ts[2] = {{mtime, 0}, {mtime, 0}};
    (void)::utimensat(d, base.c_str(), ts, AT_SYMLINK_NOFOLLOW);
    return Status::Ok();
  }

  Status copy(Source& src, int fd, uint64_t size, const std::string& path) {
    std::vector<char> buf(1 << 16);
    uint64_t left = size;
    while (left > 0) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(left, buf.size()));
      Result<bool> r = src.read(buf.data(), n);
      if (!r) return r.error();
      if (!*r) return invalid_error("layer: the archive ends inside " + path);
      for (size_t w = 0; w < n;) {
        ssize_t k = ::write(fd, buf.data() + w, n - w);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) return sys::errno_error("write", "layer " + path);
        w += static_cast<size_t>(k);
      }
      left -= n;
    }
    return skip(src, 0, size);
  }

  // Skips a member's data (size bytes) and its padding; with already,
  // only the padding of already bytes.
  Status skip(Source& src, uint64_t size, uint64_t already = 0) {
    uint64_t total = size + already;
    uint64_t padded = (total + kBlock - 1) / kBlock * kBlock;
    uint64_t left = padded - already;
    char buf[kBlock];
    while (left > 0) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(left, kBlock));
      Result<bool> r = src.read(buf, n);
      if (!r) return r.error();
      if (!*r) return invalid_error("layer: the archive ends inside a member");
      left -= n;
    }
    return Status::Ok();
  }
};

// PAX records "LEN key=value\n".
void pax(const std::string& data, std::string* path, std::string* link, std::optional<uint64_t>* size) {
  size_t at = 0;
  while (at < data.size()) {
    size_t sp = data.find(' ', at);
    if (sp == std::string::npos) return;
    size_t len = std::strtoul(data.c_str() + at, nullptr, 10);
    if (len == 0 || at + len > data.size()) return;
    std::string rec = data.substr(sp + 1, at + len - sp - 2);
    size_t eq = rec.find('=');
    if (eq != std::string::npos) {
      std::string k = rec.substr(0, eq), v = rec.substr(eq + 1);
      if (k == "path") *path = v;
      if (k == "linkpath") *link = v;
      if (k == "size") *size = std::strtoull(v.c_str(), nullptr, 10);
    }
    at += len;
  }
}

}  // namespace

Result<AppliedLayer> apply_layer(const std::string& root, const std::string& layer, const LayerLimits& limits) {
  UniqueFd rootfd(::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!rootfd) return sys::errno_error("open", root);
  UniqueFd in(::open(layer.c_str(), O_RDONLY | O_CLOEXEC));
  if (!in) return sys::errno_error("open", layer);
  Source src(in.get());
  if (Status s = src.open(); !s) return s.error();
  Applier a{rootfd.get(), limits, {}};
  std::string long_name, long_link;
  std::optional<uint64_t> pax_size;
  std::string pax_path, pax_link;
  char hdr[kBlock];
  for (;;) {
    Result<bool> r = src.read(hdr, kBlock);
    if (!r) return r.error();
    if (!*r) break;  // no end blocks: accepted, as tar does
    bool zero = true;
    for (char c : hdr) zero = zero && c == 0;
    if (zero) break;
    uint64_t sum = 0;
    for (size_t i = 0; i < kBlock; ++i) sum += (i >= 148 && i < 156) ? ' ' : static_cast<unsigned char>(hdr[i]);
    if (sum != octal(hdr + 148, 8)) return invalid_error("layer: a member header with a bad checksum");
    char type = hdr[156];
    uint64_t size = octal(hdr + 124, 12);
    if (type == 'L' || type == 'K' || type == 'x' || type == 'g') {
      if (size > (type == 'x' || type == 'g' ? kMaxPax : kMaxName)) return invalid_error("layer: an over-long name or PAX header");
      std::string data(size, '\0');
      Result<bool> d = src.read(data.data(), size);
      if (!d || !*d) return d ? invalid_error("layer: the archive ends in a header") : d.error();
      if (Status s = a.skip(src, 0, size); !s) return s.error();
      if (type == 'L') long_name = field(data.data(), data.size());
      if (type == 'K') long_link = field(data.data(), data.size());
      if (type == 'x') pax(data, &pax_path, &pax_link, &pax_size);
      continue;
    }
    std::string name = !pax_path.empty() ? pax_path : !long_name.empty() ? long_name : [&] {
      std::string prefix = std::memcmp(hdr + 257, "ustar", 5) == 0 ? field(hdr + 345, 155) : "";
      std::string n = field(hdr, 100);
      return prefix.empty() ? n : prefix + "/" + n;
    }();
    std::string link = !pax_link.empty() ? pax_link : !long_link.empty() ? long_link : field(hdr + 157, 100);
    if (pax_size) size = *pax_size;
    long_name.clear();
    long_link.clear();
    pax_path.clear();
    pax_link.clear();
    pax_size.reset();
    std::optional<std::string> path = clean(name);
    if (!path) return invalid_error("layer: member '" + name + "' climbs out with '..'");
    if (Status s = a.entry(type, *path, link, size, hdr, src); !s) return s.error();
  }
  return a.stats;
}

}  // namespace sg::builds
