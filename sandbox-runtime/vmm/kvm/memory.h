// GuestMemory: the guest's physical RAM as one host mapping, and the only
// way devices and the boot loader touch it.
//
// Guest-physical layout: RAM [0, low_size) and, for guests larger than the
// 32-bit hole, [4 GiB, 4 GiB + high_size). The MMIO hole [kMmioStart, 4 GiB)
// holds no RAM. The host mapping is contiguous (low part first), so one
// memfd or snapshot file backs all of it.
//
// Every access goes through span(gpa, len), which checks the whole range
// lies inside one RAM region with overflow-safe arithmetic: the guest is
// hostile and hands devices arbitrary addresses and lengths.
//
// Thread safety: the mapping is fixed for the object's life; concurrent
// accesses to different bytes are fine, to the same bytes are the caller's
// business (as with real DMA).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "base/fd.h"
#include "base/status.h"

namespace sg::vmm {

inline constexpr uint64_t kMmioStart = 0xC000'0000ull;  // 3 GiB: start of the 32-bit hole
inline constexpr uint64_t kHighStart = 0x1'0000'0000ull;

class GuestMemory {
 public:
  GuestMemory() = default;
  ~GuestMemory();
  GuestMemory(GuestMemory&& o) noexcept;
  GuestMemory& operator=(GuestMemory&& o) noexcept;
  GuestMemory(const GuestMemory&) = delete;
  GuestMemory& operator=(const GuestMemory&) = delete;

  // size bytes of RAM in a new memfd, mapped shared. size is a multiple of
  // 4 KiB, at least 1 MiB.
  static Result<GuestMemory> create_memfd(uint64_t size);
  // RAM mapped MAP_PRIVATE from a snapshot's memory file (copy on write:
  // the file is never modified). The file's size is the RAM size.
  static Result<GuestMemory> map_private_file(const std::string& path);
  // Anonymous private RAM, for tests of devices and the boot loader.
  static Result<GuestMemory> create_anonymous(uint64_t size);
  // Userfaultfds from now on come from this /dev/userfaultfd descriptor
  // (borrowed, kept open for the process's life): what a VMM that gave up
  // root uses (the syscall wants privilege for faults KVM takes itself).
  static void use_userfaultfd_device(int fd);
  // The ioctls new_userfaultfd makes (the VMM's seccomp allow list).
  static std::vector<unsigned long> userfaultfd_ioctls();

  uint64_t size() const { return size_; }
  uint64_t low_size() const { return size_ < kMmioStart ? size_ : kMmioStart; }
  uint64_t high_size() const { return size_ - low_size(); }
  uint8_t* host_base() const { return base_; }
  // The memfd (create_memfd) or the snapshot file (map_private_file); -1
  // for anonymous memory.
  int backing_fd() const { return fd_.get(); }
  bool is_memfd() const { return memfd_; }
  // "memfd", "file" (a snapshot's, MAP_PRIVATE), "anonymous", or
  // "userfaultfd" (anonymous, after release_to_userfaultfd).
  const char* backing() const;

  // Memory offload (docs/vmm.md, "Memory offload"). The caller has copied
  // every page it needs out of guest RAM and made sure nothing touches it
  // meanwhile (vCPUs paused, devices quiet). The first call replaces the
  // backing with anonymous private memory (MAP_FIXED at the same address,
  // so device pointers and KVM's memory slots stay valid; the old pages are
  // freed, a memfd's by a hole punch) registered for missing-page faults
  // with a new userfaultfd, and returns that uffd (the caller owns it) and
  // its features in *features. Later calls drop every resident page
  // (MADV_DONTNEED) and return -1. From the first call on, every touch of a
  // page that is not resident waits for whoever reads the uffd.
  // An error before the remap leaves RAM as it was; an error after it
  // (registering the range) leaves RAM unusable and the caller must stop
  // the machine: that is kInternal, everything else kUnavailable.
  Result<int> release_to_userfaultfd(uint64_t* features);
  // A new userfaultfd (features as above) with the RAM as it is mapped now
  // registered for missing faults; the caller owns it. Only memfd (shmem)
  // or anonymous RAM can be registered: a snapshot file's private mapping
  // is refused by the kernel.
  Result<int> new_userfaultfd(uint64_t* features) const;

  // Host pointer to [gpa, gpa+len) or null when any byte of it is outside
  // RAM (or len is 0 and gpa is past the end of its region).
  uint8_t* span(uint64_t gpa, uint64_t len) const;
  bool read(uint64_t gpa, void* out, uint64_t len) const {
    uint8_t* p = span(gpa, len);
    if (!p) return false;
    std::memcpy(out, p, len);
    return true;
  }
  bool write(uint64_t gpa, const void* in, uint64_t len) const {
    uint8_t* p = span(gpa, len);
    if (!p) return false;
    std::memcpy(p, in, len);
    return true;
  }
  template <typename T>
  bool read_obj(uint64_t gpa, T* out) const { return read(gpa, out, sizeof(T)); }
  template <typename T>
  bool write_obj(uint64_t gpa, const T& v) const { return write(gpa, &v, sizeof(T)); }

 private:
  uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
  UniqueFd fd_;
  bool memfd_ = false;
  bool file_ = false;
  bool uffd_ = false;  // anonymous, registered with a userfaultfd
};

}  // namespace sg::vmm
