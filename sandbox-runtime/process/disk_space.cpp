// Free-space admission for sandbox disks (disk_space.h).
#include "sandbox-runtime/process/disk_space.h"

#include <sys/stat.h>
#include <sys/statvfs.h>

#include "base/sys.h"

namespace sg::process {

namespace {

std::string mib(uint64_t bytes) { return std::to_string(bytes >> 20) + " MiB"; }

}  // namespace

Status admit_disk(uint64_t free, uint64_t promised, uint64_t need) {
  uint64_t held = promised + kDiskFreeMargin;
  uint64_t available = free > held ? free - held : 0;
  if (free >= held && available >= need) return Status::Ok();
  std::string what = need ? "a " + mib(need) + " sandbox disk does not fit"
                          : "too little free space for a sandbox (its writable layer has no size limit)";
  return Error(ErrorKind::kQuota,
               what + " on the sandboxes' data filesystem: " + mib(free) + " free, " + mib(promised) +
                   " of it promised to running sandboxes' disks, " + mib(kDiskFreeMargin) + " kept free, " +
                   mib(available) + " available; kill sandboxes or free space on the state root's filesystem" +
                   (need ? ", or use a template with a smaller disk" : ""));
}

std::shared_ptr<DiskSpace> DiskSpace::make(std::string root) {
  return std::shared_ptr<DiskSpace>(new DiskSpace(std::move(root)));
}

DiskSpace::Reservation& DiskSpace::Reservation::operator=(Reservation&& o) noexcept {
  if (this != &o) {
    reset();
    owner_ = std::move(o.owner_);
    key_ = o.key_;
    o.key_ = 0;
  }
  return *this;
}

void DiskSpace::Reservation::reset() {
  if (owner_) owner_->release(key_);
  owner_.reset();
  key_ = 0;
}

uint64_t DiskSpace::promised_locked() const {
  uint64_t total = 0;
  for (const auto& [key, d] : disks_) {
    struct stat st {};
    uint64_t held = ::stat(d.image.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_blocks) * 512 : 0;
    if (d.bytes > held) total += d.bytes - held;
  }
  return total;
}

Result<DiskSpace::Reservation> DiskSpace::reserve(uint64_t bytes, std::string image) {
  std::lock_guard<std::mutex> l(mu_);
  struct statvfs vfs {};
  if (::statvfs(root_.c_str(), &vfs) != 0) return sys::errno_error("statvfs", root_);
  uint64_t free = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  if (Status s = admit_disk(free, promised_locked(), bytes); !s) return s.error();
  Reservation r;
  r.owner_ = shared_from_this();
  r.key_ = next_key_++;
  if (bytes > 0) disks_.emplace(r.key_, Disk{bytes, std::move(image)});
  return r;
}

DiskSpace::Reservation DiskSpace::adopt(uint64_t bytes, std::string image) {
  std::lock_guard<std::mutex> l(mu_);
  Reservation r;
  r.owner_ = shared_from_this();
  r.key_ = next_key_++;
  if (bytes > 0) disks_.emplace(r.key_, Disk{bytes, std::move(image)});
  return r;
}

void DiskSpace::release(uint64_t key) {
  std::lock_guard<std::mutex> l(mu_);
  disks_.erase(key);
}

}  // namespace sg::process
