// What a device sees of the machine: a register window it is read and
// written through, an interrupt line, and (for virtio devices) guest memory.
// Devices never call ioctls, so each is tested on plain memory with a fake
// IrqLine (tests/sandbox-runtime/vmm/).
//
// State of every device can be saved into and restored from bytes
// (snapshot.h): save() is called only while all vCPUs are parked.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "base/status.h"

namespace sg::vmm {

// An edge-triggered interrupt line (a GSI behind an irqfd in the VMM).
class IrqLine {
 public:
  virtual ~IrqLine() = default;
  virtual void trigger() = 0;
};

// A device on the port-I/O or MMIO bus. offset is relative to the start of
// the device's window; len is 1, 2, 4 or 8 and offset+len lies inside the
// window (the bus checks). read() must fill all len bytes.
class BusDevice {
 public:
  virtual ~BusDevice() = default;
  virtual void read(uint64_t offset, uint8_t* data, size_t len) = 0;
  virtual void write(uint64_t offset, const uint8_t* data, size_t len) = 0;
};

// Little-endian helpers for register values.
inline uint64_t le_load(const uint8_t* p, size_t len) {
  uint64_t v = 0;
  for (size_t i = 0; i < len && i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}
inline void le_store(uint8_t* p, size_t len, uint64_t v) {
  for (size_t i = 0; i < len; ++i) p[i] = i < 8 ? static_cast<uint8_t>(v >> (8 * i)) : 0;
}

// Byte buffer helpers for device state (bounds-checked on load).
class StateWriter {
 public:
  template <typename T>
  void put(const T& v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    out_.insert(out_.end(), p, p + sizeof(T));
  }
  void put_bytes(const std::string& s) {
    put(static_cast<uint32_t>(s.size()));
    out_.insert(out_.end(), s.begin(), s.end());
  }
  std::vector<uint8_t>& bytes() { return out_; }

 private:
  std::vector<uint8_t> out_;
};

class StateReader {
 public:
  StateReader(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  template <typename T>
  bool get(T* v) {
    if (n_ - off_ < sizeof(T)) return ok_ = false;
    std::memcpy(v, p_ + off_, sizeof(T));
    off_ += sizeof(T);
    return true;
  }
  bool get_bytes(std::string* s, size_t max) {
    uint32_t len = 0;
    if (!get(&len) || len > max || n_ - off_ < len) return ok_ = false;
    s->assign(reinterpret_cast<const char*>(p_ + off_), len);
    off_ += len;
    return true;
  }
  bool ok() const { return ok_; }
  bool done() const { return ok_ && off_ == n_; }

 private:
  const uint8_t* p_;
  size_t n_;
  size_t off_ = 0;
  bool ok_ = true;
};

}  // namespace sg::vmm
