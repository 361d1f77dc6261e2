// VirtioMmio: register decoding, feature negotiation, activation.
#include "sandbox-runtime/vmm/devices/virtio_mmio.h"

namespace sg::vmm {

namespace {
constexpr uint32_t kMagic = 0x74726976;  // "virt"
constexpr uint32_t kVendor = 0x53474154; // "TAGS": sandgate
}  // namespace

VirtioMmio::VirtioMmio(const GuestMemory& mem, IrqLine& irq, VirtioDevice& dev, uint16_t queue_max)
    : mem_(mem), irq_(irq), dev_(dev), queues_(dev.num_queues()) {
  for (auto& q : queues_) q.max_size = queue_max;
}

void VirtioMmio::reset_locked() {
  if (active_) dev_.reset();
  active_ = false;
  status_ = 0;
  driver_features_ = 0;
  device_features_sel_ = driver_features_sel_ = queue_sel_ = 0;
  interrupt_status_ = 0;
  for (auto& q : queues_) q.reset();
}

void VirtioMmio::read(uint64_t offset, uint8_t* data, size_t len) {
  std::lock_guard lock(mu_);
  if (offset >= 0x100) {
    dev_.read_config(offset - 0x100, data, len);
    return;
  }
  if (len != 4) {
    le_store(data, len, ~0ull);
    return;
  }
  uint32_t v = 0;
  Virtqueue* q = queue_sel_ < queues_.size() ? &queues_[queue_sel_] : nullptr;
  switch (offset) {
    case 0x000: v = kMagic; break;
    case 0x004: v = 2; break;
    case 0x008: v = dev_.device_id(); break;
    case 0x00c: v = kVendor; break;
    case 0x010: {
      uint64_t f = dev_.device_features();
      v = device_features_sel_ == 0 ? static_cast<uint32_t>(f) : device_features_sel_ == 1 ? static_cast<uint32_t>(f >> 32) : 0;
      break;
    }
    case 0x034: v = q ? q->max_size : 0; break;
    case 0x044: v = q && q->ready ? 1 : 0; break;
    case 0x060: v = interrupt_status_; break;
    case 0x070: v = status_; break;
    case 0x0fc: v = config_generation_; break;
    default: v = 0; break;
  }
  le_store(data, 4, v);
}

void VirtioMmio::set_status(uint32_t v) {
  if (v == 0) {
    reset_locked();
    return;
  }
  // FEATURES_OK is accepted only for a feature set we offered that
  // includes VERSION_1; otherwise the bit stays clear and the driver gives up.
  if ((v & kVirtioStatusFeaturesOk) && !(status_ & kVirtioStatusFeaturesOk)) {
    uint64_t offered = dev_.device_features();
    if ((driver_features_ & ~offered) || !(driver_features_ & kVirtioFVersion1)) v &= ~kVirtioStatusFeaturesOk;
  }
  status_ = v;
  if ((v & kVirtioStatusDriverOk) && !active_ && (v & kVirtioStatusFeaturesOk) && !(v & kVirtioStatusFailed)) {
    for (auto& q : queues_)
      if (q.ready && !q.valid_config(mem_)) {
        needs_reset();
        return;
      }
    active_ = true;
    dev_.activate(*this);
  }
}

void VirtioMmio::write(uint64_t offset, const uint8_t* data, size_t len) {
  std::lock_guard lock(mu_);
  if (offset >= 0x100) {
    dev_.write_config(offset - 0x100, data, len);
    return;
  }
  if (len != 4) return;
  uint32_t v = static_cast<uint32_t>(le_load(data, 4));
  Virtqueue* q = queue_sel_ < queues_.size() ? &queues_[queue_sel_] : nullptr;
  // Queue configuration may change only while the queue is not ready and
  // the driver has not finished (the spec's rule; we ignore writes otherwise).
  bool q_configurable = q && !q->ready && !active_;
  auto set_lo = [](uint64_t& a, uint32_t x) { a = (a & 0xffffffff00000000ull) | x; };
  auto set_hi = [](uint64_t& a, uint32_t x) { a = (a & 0xffffffffull) | (static_cast<uint64_t>(x) << 32); };
  switch (offset) {
    case 0x014: device_features_sel_ = v; break;
    case 0x020:
      if (status_ & kVirtioStatusFeaturesOk) break;
      if (driver_features_sel_ == 0) set_lo(driver_features_, v);
      else if (driver_features_sel_ == 1) set_hi(driver_features_, v);
      break;
    case 0x024: driver_features_sel_ = v; break;
    case 0x030: queue_sel_ = v; break;
    case 0x038:
      // A size over QueueNumMax is stored as 0, which QueueReady refuses
      // just the same; kept as written it made the device's saved state
      // one that restore() rejects (Virtqueue::restore checks max_size).
      if (q_configurable) q->size = static_cast<uint16_t>(v > q->max_size ? 0 : v);
      break;
    case 0x044:
      if (!q || active_) break;
      if (v == 1) {
        q->ready = q->valid_config(mem_);
        if (!q->ready) needs_reset();
      } else {
        q->ready = false;
      }
      break;
    case 0x050:
      if (active_ && v < queues_.size() && queues_[v].ready) dev_.queue_notify(*this, v);
      break;
    case 0x064: interrupt_status_ &= ~v; break;
    case 0x070: set_status(v); break;
    case 0x080: if (q_configurable) set_lo(q->desc_addr, v); break;
    case 0x084: if (q_configurable) set_hi(q->desc_addr, v); break;
    case 0x090: if (q_configurable) set_lo(q->avail_addr, v); break;
    case 0x094: if (q_configurable) set_hi(q->avail_addr, v); break;
    case 0x0a0: if (q_configurable) set_lo(q->used_addr, v); break;
    case 0x0a4: if (q_configurable) set_hi(q->used_addr, v); break;
    default: break;
  }
}

void VirtioMmio::signal_used(size_t queue) {
  if (queue >= queues_.size() || queues_[queue].interrupt_suppressed(mem_)) return;
  interrupt_status_ |= 1;
  irq_.trigger();
}

void VirtioMmio::needs_reset() {
  status_ |= kVirtioStatusNeedsReset;
  if (status_ & kVirtioStatusDriverOk) {
    interrupt_status_ |= 2;  // configuration change
    irq_.trigger();
  }
}

void VirtioMmio::save(StateWriter& w) {
  std::lock_guard lock(mu_);
  w.put(status_), w.put(device_features_sel_), w.put(driver_features_sel_), w.put(driver_features_);
  w.put(queue_sel_), w.put(interrupt_status_), w.put(config_generation_), w.put(static_cast<uint8_t>(active_));
  w.put(static_cast<uint32_t>(queues_.size()));
  for (const auto& q : queues_) q.save(w);
  dev_.save(w);
}

bool VirtioMmio::restore(StateReader& r) {
  std::lock_guard lock(mu_);
  uint8_t act = 0;
  uint32_t nq = 0;
  if (!(r.get(&status_) && r.get(&device_features_sel_) && r.get(&driver_features_sel_) && r.get(&driver_features_) &&
        r.get(&queue_sel_) && r.get(&interrupt_status_) && r.get(&config_generation_) && r.get(&act) && r.get(&nq)))
    return false;
  if (nq != queues_.size()) return false;
  for (auto& q : queues_)
    if (!q.restore(r) || (q.ready && !q.valid_config(mem_))) return false;
  if (!dev_.restore(r)) return false;
  active_ = act != 0;
  if (active_) dev_.activate(*this);
  return true;
}

}  // namespace sg::vmm
