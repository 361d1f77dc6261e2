// GuestMemory: memfd, private-file and anonymous RAM; bounds-checked access.
#include "vmm/kvm/memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <utility>

#include "sys/sys.h"

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
    : base_(std::exchange(o.base_, nullptr)), size_(std::exchange(o.size_, 0)), fd_(std::move(o.fd_)), memfd_(o.memfd_) {}

GuestMemory& GuestMemory::operator=(GuestMemory&& o) noexcept {
  if (this != &o) {
    if (base_) ::munmap(base_, size_);
    base_ = std::exchange(o.base_, nullptr);
    size_ = std::exchange(o.size_, 0);
    fd_ = std::move(o.fd_);
    memfd_ = o.memfd_;
  }
  return *this;
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
