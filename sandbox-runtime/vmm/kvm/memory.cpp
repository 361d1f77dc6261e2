// GuestMemory: memfd, private-file and anonymous RAM; bounds-checked access.
#include "sandbox-runtime/vmm/kvm/memory.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <linux/userfaultfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <unistd.h>

#include <utility>

#include <cerrno>
#include <cstring>

#include "base/log.h"
#include "base/sys.h"

namespace sg::vmm {

namespace {
constexpr uint64_t kPage = 4096;

Status check_size(uint64_t size) {
  if (size < (1u << 20) || size % kPage != 0) return invalid_error("guest RAM size must be a multiple of 4 KiB and at least 1 MiB");
  if (size > (1ull << 40)) return invalid_error("guest RAM size over 1 TiB");
  return {};
}
}  // namespace

GuestMemory::~GuestMemory() {
  if (base_) ::munmap(base_, size_);
}

GuestMemory::GuestMemory(GuestMemory&& o) noexcept
    : base_(std::exchange(o.base_, nullptr)), size_(std::exchange(o.size_, 0)), fd_(std::move(o.fd_)), memfd_(o.memfd_),
      file_(o.file_), uffd_(o.uffd_) {}

GuestMemory& GuestMemory::operator=(GuestMemory&& o) noexcept {
  if (this != &o) {
    if (base_) ::munmap(base_, size_);
    base_ = std::exchange(o.base_, nullptr);
    size_ = std::exchange(o.size_, 0);
    fd_ = std::move(o.fd_);
    memfd_ = o.memfd_;
    file_ = o.file_;
    uffd_ = o.uffd_;
  }
  return *this;
}

const char* GuestMemory::backing() const {
  if (uffd_) return "userfaultfd";
  if (memfd_) return "memfd";
  if (file_) return "file";
  return "anonymous";
}

namespace {
// UFFD_FEATURE_POISON (Linux 6.6) where the installed headers predate it.
constexpr uint64_t kFeaturePoison = 1ull << 14;

#ifndef USERFAULTFD_IOC_NEW  // Linux 6.1 ABI (include/uapi/linux/userfaultfd.h)
#define USERFAULTFD_IOC_NEW _IO(0xAA, 0x00)
#endif

int g_uffd_device = -1;  // /dev/userfaultfd, opened before the VMM dropped root

Result<UniqueFd> open_uffd() {
  // Not UFFD_USER_MODE_ONLY: KVM's own accesses (vCPUs) must wait too.
  // An unprivileged (jailed) VMM gets that through the device's descriptor.
  if (g_uffd_device >= 0) {
    // SAFETY: USERFAULTFD_IOC_NEW takes its flags by value and returns a new fd.
    UniqueFd fd(::ioctl(g_uffd_device, USERFAULTFD_IOC_NEW, O_CLOEXEC | O_NONBLOCK));
    if (!fd) return sys::errno_error("USERFAULTFD_IOC_NEW", "guest RAM");
    return fd;
  }
  UniqueFd fd(static_cast<int>(::syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK)));
  if (!fd) return sys::errno_error("userfaultfd", "guest RAM");
  return fd;
}

// A new userfaultfd past UFFDIO_API, with UFFD_FEATURE_POISON where the
// kernel offers it (probed on a throwaway fd: UFFDIO_API may be called once
// per fd, and asking for an unknown feature fails it).
Result<UniqueFd> open_uffd_api(uint64_t* features) {
  uint64_t offered = 0;
  {
    auto probe = open_uffd();
    if (!probe) return probe.error();
    uffdio_api api{};
    api.api = UFFD_API;
    if (::ioctl(probe->get(), UFFDIO_API, &api) == 0) offered = api.features;
  }
  auto fd = open_uffd();
  if (!fd) return fd.error();
  uffdio_api api{};
  api.api = UFFD_API;
  api.features = offered & kFeaturePoison;
  if (::ioctl(fd->get(), UFFDIO_API, &api) != 0) return sys::errno_error("UFFDIO_API", "guest RAM");
  *features = api.features;
  return fd;
}

Status register_missing(int uffd, uint8_t* base, uint64_t size) {
  uffdio_register reg{};
  reg.range.start = reinterpret_cast<uint64_t>(base);
  reg.range.len = size;
  reg.mode = UFFDIO_REGISTER_MODE_MISSING;
  if (::ioctl(uffd, UFFDIO_REGISTER, &reg) != 0) return sys::errno_error("UFFDIO_REGISTER", "guest RAM");
  return Status::Ok();
}
}  // namespace

void GuestMemory::use_userfaultfd_device(int fd) { g_uffd_device = fd; }

std::vector<unsigned long> GuestMemory::userfaultfd_ioctls() { return {USERFAULTFD_IOC_NEW, UFFDIO_API, UFFDIO_REGISTER}; }

Result<int> GuestMemory::release_to_userfaultfd(uint64_t* features) {
  *features = 0;
  if (!base_) return Error(ErrorKind::kUnavailable, "no guest RAM");
  if (uffd_) {
    // Anonymous private: the pages are freed and the next touch of each
    // is a missing fault on the registered range.
    if (::madvise(base_, size_, MADV_DONTNEED) != 0) {
      Error e = sys::errno_error("madvise MADV_DONTNEED", "guest RAM");
      return Error(ErrorKind::kUnavailable, e.message());
    }
    return -1;
  }
  uint64_t got = 0;
  auto fd = open_uffd_api(&got);
  if (!fd) return Error(ErrorKind::kUnavailable, fd.error().message());
  void* p = ::mmap(base_, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  if (p == MAP_FAILED || p != base_) {
    Error e = sys::errno_error("mmap MAP_FIXED anonymous", "guest RAM");
    return Error(ErrorKind::kInternal, e.message());
  }
  uffd_ = true;
  if (Status r = register_missing(fd->get(), base_, size_); !r) return Error(ErrorKind::kInternal, r.error().message());
  // The old pages: a private file mapping's copies went with the mapping;
  // a memfd keeps its page cache while the fd is open, so punch it out.
  if (memfd_ && ::fallocate(fd_.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(size_)) != 0)
    LOG_WARN("vmm: guest RAM memfd hole punch: " << std::strerror(errno));
  fd_.reset();
  memfd_ = false;
  file_ = false;
  *features = got;
  return fd->release();
}

Result<int> GuestMemory::new_userfaultfd(uint64_t* features) const {
  *features = 0;
  if (!base_) return Error(ErrorKind::kUnavailable, "no guest RAM");
  auto fd = open_uffd_api(features);
  if (!fd) return fd.error();
  if (Status r = register_missing(fd->get(), base_, size_); !r) return r.error();
  return fd->release();
}

Result<GuestMemory> GuestMemory::create_memfd(uint64_t size) {
  if (Status s = check_size(size); !s) return s.error();
  UniqueFd fd(::memfd_create("sandgate-guest-ram", MFD_CLOEXEC));
  if (!fd) return sys::errno_error("memfd_create", "guest RAM");
  if (::ftruncate(fd.get(), static_cast<off_t>(size)) != 0) return sys::errno_error("ftruncate", "guest RAM memfd");
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd.get(), 0);
  if (p == MAP_FAILED) return sys::errno_error("mmap", "guest RAM memfd");
  ::madvise(p, size, MADV_MERGEABLE);  // best effort: KSM across sandboxes where enabled
  GuestMemory m;
  m.base_ = static_cast<uint8_t*>(p);
  m.size_ = size;
  m.fd_ = std::move(fd);
  m.memfd_ = true;
  return m;
}

Result<GuestMemory> GuestMemory::map_private_file(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return sys::errno_error("open", path);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return sys::errno_error("fstat", path);
  uint64_t size = static_cast<uint64_t>(st.st_size);
  if (Status s = check_size(size); !s) return s.error().with_context(path);
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_NORESERVE, fd.get(), 0);
  if (p == MAP_FAILED) return sys::errno_error("mmap MAP_PRIVATE", path);
  GuestMemory m;
  m.base_ = static_cast<uint8_t*>(p);
  m.size_ = size;
  m.fd_ = std::move(fd);
  m.file_ = true;
  return m;
}

Result<GuestMemory> GuestMemory::create_anonymous(uint64_t size) {
  if (Status s = check_size(size); !s) return s.error();
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return sys::errno_error("mmap", "anonymous guest RAM");
  GuestMemory m;
  m.base_ = static_cast<uint8_t*>(p);
  m.size_ = size;
  return m;
}

uint8_t* GuestMemory::span(uint64_t gpa, uint64_t len) const {
  uint64_t low = low_size();
  if (gpa < low) {
    if (len > low - gpa) return nullptr;
    return base_ + gpa;
  }
  if (gpa < kHighStart) return nullptr;
  uint64_t off = gpa - kHighStart;
  uint64_t high = high_size();
  if (off >= high && !(off == high && len == 0)) return nullptr;
  if (len > high - off) return nullptr;
  return base_ + low + off;
}

}  // namespace sg::vmm
