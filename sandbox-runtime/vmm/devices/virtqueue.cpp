// Virtqueue: bounds-checked split-ring walking.
#include "sandbox-runtime/vmm/devices/virtqueue.h"

#include <atomic>

namespace sg::vmm {

namespace {
struct RawDesc {
  uint64_t addr;
  uint32_t len;
  uint16_t flags;
  uint16_t next;
};
static_assert(sizeof(RawDesc) == 16);

uint16_t load16(const GuestMemory& mem, uint64_t gpa, bool* ok) {
  uint16_t v = 0;
  if (!mem.read_obj(gpa, &v)) *ok = false;
  return v;
}
}  // namespace

uint64_t Chain::readable_bytes() const {
  uint64_t n = 0;
  for (const auto& d : descs)
    if (!d.write) n += d.len;
  return n;
}
uint64_t Chain::writable_bytes() const {
  uint64_t n = 0;
  for (const auto& d : descs)
    if (d.write) n += d.len;
  return n;
}

void Virtqueue::reset() {
  size = 0;
  ready = false;
  desc_addr = avail_addr = used_addr = 0;
  next_avail = next_used = 0;
  broken_ = false;
}

bool Virtqueue::valid_config(const GuestMemory& mem) const {
  if (size == 0 || size > max_size || (size & (size - 1)) != 0) return false;
  if (desc_addr % 16 || avail_addr % 2 || used_addr % 4) return false;
  return mem.span(desc_addr, 16ull * size) && mem.span(avail_addr, 6 + 2ull * size) &&
         mem.span(used_addr, 6 + 8ull * size);
}

bool Virtqueue::has_available(const GuestMemory& mem) const {
  if (!ready || broken_) return false;
  bool ok = true;
  uint16_t idx = load16(mem, avail_addr + 2, &ok);
  return ok && idx != next_avail;
}

std::optional<Chain> Virtqueue::pop(const GuestMemory& mem) {
  if (!ready || broken_) return std::nullopt;
  bool ok = true;
  uint16_t idx = load16(mem, avail_addr + 2, &ok);
  if (!ok) return std::nullopt;
  uint16_t pending = static_cast<uint16_t>(idx - next_avail);
  if (pending == 0) return std::nullopt;
  if (pending > size) {
    broken_ = true;  // the driver claims more buffers than the ring holds
    return std::nullopt;
  }
  // Read ring entries only after the index that published them.
  std::atomic_thread_fence(std::memory_order_acquire);
  Chain c;
  c.head = load16(mem, avail_addr + 4 + 2ull * (next_avail % size), &ok);
  ++next_avail;
  if (!ok || c.head >= size) {
    c.valid = false;
    c.head = c.head >= size ? 0 : c.head;
    c.valid = false;
    return c;
  }
  uint16_t i = c.head;
  for (uint32_t n = 0;; ++n) {
    if (n >= size) {  // a loop in the chain
      c.valid = false;
      break;
    }
    RawDesc d{};
    if (!mem.read_obj(desc_addr + 16ull * i, &d)) {
      c.valid = false;
      break;
    }
    if (d.flags & kDescFlagIndirect) {
      c.valid = false;
      break;
    }
    if (!mem.span(d.addr, d.len)) {
      c.valid = false;
      break;
    }
    c.descs.push_back({d.addr, d.len, (d.flags & kDescFlagWrite) != 0});
    if (!(d.flags & kDescFlagNext)) break;
    if (d.next >= size) {
      c.valid = false;
      break;
    }
    i = d.next;
  }
  return c;
}

void Virtqueue::add_used(const GuestMemory& mem, uint16_t head, uint32_t len) {
  if (!ready || size == 0) return;
  uint64_t elem = used_addr + 4 + 8ull * (next_used % size);
  uint32_t v[2] = {head, len};
  if (!mem.write(elem, v, sizeof v)) return;
  ++next_used;
  // The element must be visible before the index that publishes it.
  std::atomic_thread_fence(std::memory_order_release);
  mem.write_obj(used_addr + 2, next_used);
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

bool Virtqueue::interrupt_suppressed(const GuestMemory& mem) const {
  bool ok = true;
  uint16_t flags = load16(mem, avail_addr, &ok);
  return ok && (flags & kAvailFlagNoInterrupt);
}

void Virtqueue::save(StateWriter& w) const {
  w.put(size), w.put(static_cast<uint8_t>(ready)), w.put(desc_addr), w.put(avail_addr), w.put(used_addr);
  w.put(next_avail), w.put(next_used), w.put(static_cast<uint8_t>(broken_));
}

bool Virtqueue::restore(StateReader& r) {
  uint8_t rdy = 0, brk = 0;
  if (!(r.get(&size) && r.get(&rdy) && r.get(&desc_addr) && r.get(&avail_addr) && r.get(&used_addr) &&
        r.get(&next_avail) && r.get(&next_used) && r.get(&brk)))
    return false;
  if (size > max_size) return false;
  ready = rdy != 0;
  broken_ = brk != 0;
  return true;
}

}  // namespace sg::vmm
