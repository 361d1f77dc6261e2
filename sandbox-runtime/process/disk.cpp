// Size-limited writable layers for process sandboxes (disk.h).
#include "sandbox-runtime/process/disk.h"

#include <fcntl.h>
#include <linux/loop.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <vector>

#include "base/sys.h"

namespace sg::process {

namespace {

constexpr int kAttachTries = 16;
constexpr const char* kImageName = "disk.img";

bool find_mkfs() {
  const char* env = std::getenv("PATH");
  std::string path = std::string(env ? env : "") + ":/usr/sbin:/sbin";
  size_t i = 0;
  while (i <= path.size()) {
    size_t j = path.find(':', i);
    if (j == std::string::npos) j = path.size();
    std::string dir = path.substr(i, j - i);
    if (!dir.empty() && ::access((dir + "/mkfs.ext4").c_str(), X_OK) == 0) return true;
    i = j + 1;
  }
  return false;
}

// "7:12\n" from /sys/block/loopN/dev.
Result<dev_t> loop_dev_number(int n) {
  std::string path = "/sys/block/loop" + std::to_string(n) + "/dev";
  auto text = sys::read_file(path, 64);
  if (!text) return text.error();
  unsigned maj = 0, min = 0;
  if (std::sscanf(text->c_str(), "%u:%u", &maj, &min) != 2) return internal_error("parse " + path + ": " + *text);
  return static_cast<dev_t>(makedev(maj, min));
}

}  // namespace

Status writable_disk_available() {
  UniqueFd ctl(::open("/dev/loop-control", O_RDWR | O_CLOEXEC));
  if (!ctl)
    return Error(ErrorKind::kUnavailable,
                 "/dev/loop-control: " + std::string(std::strerror(errno)) +
                     ": size-limited writable layers need loop devices");
  if (!find_mkfs())
    return Error(ErrorKind::kUnavailable,
                 "mkfs.ext4 not found: size-limited writable layers need it (Debian package e2fsprogs)");
  return Status::Ok();
}

namespace {

// The filesystem of size_mb MiB, made once (mkfs.ext4 into a temporary
// name, then renamed, so concurrent first uses each end with a whole one).
// No journal (the layer dies with the sandbox), no blocks reserved for
// root (the sandbox gets the size it asked for), an inode per 8 KiB
// (package trees are many small files), inode tables left unwritten.
Result<std::string> prototype_image(const std::string& cache_dir, uint64_t size_mb, sys::Os& os) {
  std::string path = cache_dir + "/ext4-" + std::to_string(size_mb) + "m.img";
  if (sys::path_exists(path)) return path;
  if (Status s = sys::make_dirs(cache_dir, 0700, os); !s) return s.error();
  std::string tmp = path + ".tmp-" + sys::random_hex(6);
  {
    UniqueFd img(os.open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
    if (!img) return sys::errno_error("create", tmp);
    if (os.ftruncate(img.get(), static_cast<off_t>(size_mb << 20)) != 0) {
      Error e = sys::errno_error("ftruncate", tmp);
      ::unlink(tmp.c_str());
      return e;
    }
  }
  Status s = sys::run_and_wait({"mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-m", "0", "-i", "8192", "-E",
                                "lazy_itable_init=1,nodiscard", "-L", "sandgate-disk", tmp},
                               tmp + ".log");
  ::unlink((tmp + ".log").c_str());
  if (!s) {
    ::unlink(tmp.c_str());
    return s.error().with_context("make the writable layer's filesystem");
  }
  if (os.rename(tmp.c_str(), path.c_str()) != 0) {
    Error e = sys::errno_error("rename", tmp);
    ::unlink(tmp.c_str());
    return e;
  }
  return path;
}

// A sparse copy: only the prototype's data extents (well under 1 MiB of
// metadata for any size) are read, and blocks of zeros in them are left as
// holes, so the copy stays sparse even where the filesystem reports the
// whole file as data (no SEEK_HOLE support).
Status sparse_copy(const std::string& from, const std::string& to, uint64_t size, sys::Os& os) {
  UniqueFd in(::open(from.c_str(), O_RDONLY | O_CLOEXEC));
  if (!in) return sys::errno_error("open", from);
  UniqueFd out(os.open(to.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (!out) return sys::errno_error("create", to);
  if (os.ftruncate(out.get(), static_cast<off_t>(size)) != 0) return sys::errno_error("ftruncate", to);
  constexpr size_t kBlock = 64 << 10;
  static const char kZeros[kBlock] = {};
  std::vector<char> buf(kBlock);
  off_t pos = 0;
  for (;;) {
    off_t data = ::lseek(in.get(), pos, SEEK_DATA);
    if (data < 0) {
      if (errno == ENXIO) break;  // no data after pos
      return sys::errno_error("lseek SEEK_DATA", from);
    }
    off_t hole = ::lseek(in.get(), data, SEEK_HOLE);
    if (hole < 0) return sys::errno_error("lseek SEEK_HOLE", from);
    for (off_t at = data; at < hole;) {
      size_t want = static_cast<size_t>(std::min<off_t>(hole - at, static_cast<off_t>(kBlock)));
      ssize_t n = ::pread(in.get(), buf.data(), want, at);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return sys::errno_error("pread", from);
      if (n == 0) return internal_error("copy " + from + ": ended early");
      if (std::memcmp(buf.data(), kZeros, static_cast<size_t>(n)) != 0) {
        for (ssize_t done = 0; done < n;) {
          ssize_t w = ::pwrite(out.get(), buf.data() + done, static_cast<size_t>(n - done), at + done);
          if (w < 0 && errno == EINTR) continue;
          if (w < 0) return sys::errno_error("pwrite", to);
          done += w;
        }
      }
      at += n;
    }
    pos = hole;
  }
  return Status::Ok();
}

}  // namespace

Result<WritableDisk> make_writable_disk(const std::string& dir, const std::string& cache_dir, uint64_t size_mb,
                                        sys::Os& os) {
  if (size_mb == 0 || size_mb > kMaxWritableDiskMb)
    return invalid_error("disk size " + std::to_string(size_mb) + " MiB");
  WritableDisk d;
  d.image = writable_disk_image(dir);
  d.node = dir + "/disk.dev";
  Result<std::string> proto = prototype_image(cache_dir, size_mb, os);
  if (!proto) return proto.error();
  if (Status s = sparse_copy(*proto, d.image, size_mb << 20, os); !s) return s.error().with_context("make the writable layer");

  // Every reader of /sys/block/loopN/loop/backing_file, sandboxes
  // included, sees the backing file's path as d_path makes it, which stops
  // at the root of a detached mount: opened through a detached clone of
  // dir, it reads "/disk.img" rather than the host's state path.
  UniqueFd dir_tree(os.open_tree(AT_FDCWD, dir.c_str(), OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC));
  if (!dir_tree) return sys::errno_error("open_tree", dir);
  UniqueFd img(os.openat(dir_tree.get(), kImageName, O_RDWR | O_CLOEXEC, 0));
  if (!img) return sys::errno_error("open", d.image);
  UniqueFd ctl(os.open("/dev/loop-control", O_RDWR | O_CLOEXEC, 0));
  if (!ctl) return sys::errno_error("open", "/dev/loop-control");
  for (int attempt = 0; attempt < kAttachTries; ++attempt) {
    int n = os.ioctl(ctl.get(), LOOP_CTL_GET_FREE, 0);
    if (n < 0) return sys::errno_error("ioctl LOOP_CTL_GET_FREE", "/dev/loop-control");
    Result<dev_t> num = loop_dev_number(n);
    if (!num) return num.error();
    ::unlink(d.node.c_str());
    if (os.mknod(d.node.c_str(), S_IFBLK | 0600, *num) != 0) return sys::errno_error("mknod", d.node);
    UniqueFd loop(os.open(d.node.c_str(), O_RDWR | O_CLOEXEC, 0));
    if (!loop) return sys::errno_error("open", d.node + " (loop" + std::to_string(n) + ")");
    loop_config lc{};
    lc.fd = static_cast<__u32>(img.get());
    lc.info.lo_flags = LO_FLAGS_AUTOCLEAR;
    if (os.ioctl(loop.get(), LOOP_CONFIGURE, reinterpret_cast<unsigned long>(&lc)) == 0) {
      d.loop = std::move(loop);
      return d;
    }
    if (errno != EBUSY) return sys::errno_error("ioctl LOOP_CONFIGURE", "loop" + std::to_string(n));
    // Another thread or process took it between GET_FREE and here.
  }
  return internal_error("attach " + d.image + ": no free loop device after " + std::to_string(kAttachTries) +
                        " tries");
}

std::string writable_disk_image(const std::string& dir) { return dir + "/" + kImageName; }

uint64_t writable_disk_used_bytes(const std::string& image) {
  struct stat st {};
  if (::stat(image.c_str(), &st) != 0) return 0;
  return static_cast<uint64_t>(st.st_blocks) * 512;
}

}  // namespace sg::process
