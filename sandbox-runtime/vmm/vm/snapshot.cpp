// Machine snapshots: vm.state (vCPU, in-kernel irqchip/PIT/clock and device
// state, with the layout sizes it was written with) and memory (the guest
// RAM, sparse). A restored machine maps memory MAP_PRIVATE, so any number
// of clones share the file's page cache and copy only the pages they write.
//
// vm.state layout (native endian, this host's KVM structs):
//   "SGVMSNP1" u32 version, u32 struct sizes (checked on load),
//   u32 cpus, u64 mem_bytes, str disk, u8 disk_ro, u8 has_net (from version 2),
//   irqchip PIC master, PIC slave, IOAPIC; pit2; clock;
//   per vCPU: cpuid, mp_state, regs, sregs, xsave, xcrs, debugregs, lapic,
//   msrs, events; then serial, cmos, virtio-blk and virtio-console
//   transports with their device state, and with has_net the virtio-net
//   transport. Version 1 snapshots restore without a network device.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include "base/log.h"
#include "base/sys.h"
#include "sandbox-runtime/vmm/vm/machine.h"

namespace sg::vmm {

namespace {

constexpr char kMagic[8] = {'S', 'G', 'V', 'M', 'S', 'N', 'P', '1'};
constexpr uint32_t kVersion = 2, kOldestVersion = 1;
constexpr uint64_t kPage = 4096;
constexpr size_t kMaxMsrs = 4096, kMaxCpuid = 4096;

std::vector<uint32_t> layout_sizes() {
  return {sizeof(kvm_regs), sizeof(kvm_sregs), sizeof(kvm::XsaveArea), sizeof(kvm_xcrs), sizeof(kvm_lapic_state),
          sizeof(kvm_vcpu_events), sizeof(kvm_mp_state), sizeof(kvm_debugregs), sizeof(kvm_irqchip),
          sizeof(kvm_pit_state2), sizeof(kvm_clock_data), sizeof(kvm_cpuid_entry2)};
}

Status write_all(int fd, const void* p, size_t n, off_t off, const std::string& what) {
  const auto* b = static_cast<const uint8_t*>(p);
  while (n > 0) {
    ssize_t w = ::pwrite(fd, b, n, off);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return sys::errno_error("write", what);
    b += w, n -= static_cast<size_t>(w), off += w;
  }
  return {};
}

// The RAM into fd from offset 0, sparse: zero pages stay holes.
Status write_memory_to(const GuestMemory& mem, int fd, const std::string& tmp) {
  if (::ftruncate(fd, 0) != 0 || ::ftruncate(fd, static_cast<off_t>(mem.size())) != 0)
    return sys::errno_error("ftruncate", tmp);
  static const uint8_t zero[kPage] = {};
  const uint8_t* base = mem.host_base();
  uint64_t run_start = 0, run_len = 0;
  for (uint64_t off = 0; off < mem.size(); off += kPage) {
    bool z = std::memcmp(base + off, zero, kPage) == 0;
    if (!z) {
      if (run_len == 0) run_start = off;
      run_len += kPage;
    }
    if ((z || off + kPage == mem.size()) && run_len) {
      if (Status s = write_all(fd, base + run_start, run_len, static_cast<off_t>(run_start), tmp); !s) return s;
      run_len = 0;
    }
  }
  if (::fdatasync(fd) != 0) return sys::errno_error("fdatasync", tmp);
  return {};
}

Status write_memory(const GuestMemory& mem, const std::string& path) {
  std::string tmp = path + ".partial";
  UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  if (!fd) return sys::errno_error("open", tmp);
  if (Status s = write_memory_to(mem, fd.get(), tmp); !s) return s;
  if (::rename(tmp.c_str(), path.c_str()) != 0) return sys::errno_error("rename", tmp);
  return {};
}

// Sets MSRs one batch at a time, skipping any the kernel refuses (a
// snapshot from the same host lists only MSRs KVM could read).
Status set_msrs_tolerant(kvm::Vcpu& v, const std::vector<kvm::MsrEntry>& msrs) {
  std::vector<kvm::MsrEntry> rest = msrs;
  while (!rest.empty()) {
    Status s = v.set_msrs(rest);
    if (s) return {};
    // Find how many went in: set one by one until one fails, drop it.
    size_t i = 0;
    for (; i < rest.size(); ++i)
      if (!v.set_msrs({rest[i]})) break;
    if (i < rest.size()) LOG_DEBUG("vmm: restore: MSR 0x" << std::hex << rest[i].index << " refused, skipped");
    rest.erase(rest.begin(), rest.begin() + static_cast<long>(i < rest.size() ? i + 1 : i));
  }
  return {};
}

}  // namespace

Status Machine::snapshot(const std::string& host_dir) {
  if (state() != State::kPaused) return conflict_error("snapshot needs a paused machine");
  std::string dir = host_dir;
  if (!snapshot_host_dir_.empty()) {
    if (host_dir != snapshot_host_dir_)
      return invalid_error("this VMM writes a snapshot to " + snapshot_host_dir_ + " only");
    dir = snapshot_jail_dir_;
  }
  if (Status s = sys::make_dirs(dir, 0700); !s) return s;
  uint64_t t0 = sys::monotonic_ns();
  if (Status s = write_memory(mem_, dir + "/memory"); !s) return s;
  uint64_t t1 = sys::monotonic_ns();
  if (Status s = save_state(dir + "/vm.state"); !s) return s;
  LOG_INFO("vmm: snapshot to " << dir << ": memory " << (t1 - t0) / 1000000 << " ms, state "
                               << (sys::monotonic_ns() - t1) / 1000000 << " ms");
  return {};
}

Status Machine::snapshot_to(int memory_fd, int state_fd) {
  if (state() != State::kPaused) return conflict_error("snapshot needs a paused machine");
  uint64_t t0 = sys::monotonic_ns();
  if (Status s = write_memory_to(mem_, memory_fd, "the memory file"); !s) return s;
  uint64_t t1 = sys::monotonic_ns();
  auto b = state_bytes();
  if (!b) return b.error();
  if (::ftruncate(state_fd, 0) != 0) return sys::errno_error("ftruncate", "the state file");
  if (Status s = write_all(state_fd, b->data(), b->size(), 0, "the state file"); !s) return s;
  if (::fdatasync(state_fd) != 0) return sys::errno_error("fdatasync", "the state file");
  LOG_INFO("vmm: snapshot to descriptors: memory " << (t1 - t0) / 1000000 << " ms, state "
                                                   << (sys::monotonic_ns() - t1) / 1000000 << " ms");
  return {};
}

Status Machine::save_state(const std::string& path) {
  auto b = state_bytes();
  if (!b) return b.error();
  return sys::write_file_atomic(path, std::string_view(reinterpret_cast<const char*>(b->data()), b->size()));
}

Result<std::vector<uint8_t>> Machine::state_bytes() {
  StateWriter w;
  for (char c : kMagic) w.put(c);
  w.put(kVersion);
  for (uint32_t s : layout_sizes()) w.put(s);
  w.put(cpus_);
  w.put(mem_.size());
  w.put_bytes(disk_path_);
  w.put(static_cast<uint8_t>(disk_ro_));
  w.put(static_cast<uint8_t>(net_mmio_ != nullptr));
  for (uint32_t chip = 0; chip < 3; ++chip) {
    auto c = vm_.get_irqchip(chip);
    if (!c) return c.error();
    w.put(*c);
  }
  auto pit = vm_.get_pit2();
  if (!pit) return pit.error();
  w.put(*pit);
  auto clock = vm_.get_clock();
  if (!clock) return clock.error();
  w.put(*clock);
  auto msr_list = kvm_.msr_index_list();
  if (!msr_list) return msr_list.error();
  auto cpuid = kvm_.supported_cpuid();
  if (!cpuid) return cpuid.error();
  for (auto& v : vcpus_) {
    // The cpuid a vCPU runs with is what we set at boot: re-derive it.
    kvm::CpuidEntries c = vcpu_cpuid(*cpuid, v->index());
    w.put(static_cast<uint32_t>(c.entries.size()));
    for (const auto& e : c.entries) w.put(e);
    auto mp = v->get_mp_state();
    if (!mp) return mp.error();
    w.put(*mp);
    auto regs = v->get_regs();
    if (!regs) return regs.error();
    w.put(*regs);
    auto sregs = v->get_sregs();
    if (!sregs) return sregs.error();
    w.put(*sregs);
    auto xsave = v->get_xsave();
    if (!xsave) return xsave.error();
    w.put(*xsave);
    auto xcrs = v->get_xcrs();
    if (!xcrs) return xcrs.error();
    w.put(*xcrs);
    auto dr = v->get_debugregs();
    if (!dr) return dr.error();
    w.put(*dr);
    auto lapic = v->get_lapic();
    if (!lapic) return lapic.error();
    w.put(*lapic);
    auto msrs = v->get_msrs(*msr_list);
    if (!msrs) return msrs.error();
    w.put(static_cast<uint32_t>(msrs->size()));
    for (const auto& m : *msrs) w.put(m);
    auto ev = v->get_vcpu_events();
    if (!ev) return ev.error();
    w.put(*ev);
  }
  serial_->save(w);
  cmos_->save(w);
  blk_mmio_->save(w);
  console_mmio_->save(w);
  if (net_mmio_) net_mmio_->save(w);
  return std::move(w.bytes());
}

Result<std::unique_ptr<Machine>> Machine::restore(const std::string& dir, const IoConfig& io) {
  auto blob = sys::read_file(dir + "/vm.state", 64u << 20);
  if (!blob) return blob.error();
  StateReader r(reinterpret_cast<const uint8_t*>(blob->data()), blob->size());
  auto bad = [&](const std::string& what) { return invalid_error(dir + "/vm.state: " + what); };
  char magic[8];
  for (char& c : magic) r.get(&c);
  uint32_t version = 0;
  r.get(&version);
  if (!r.ok() || std::memcmp(magic, kMagic, 8) != 0) return bad("not a sandgate-vmm snapshot");
  if (version < kOldestVersion || version > kVersion)
    return bad("snapshot version " + std::to_string(version) + ", this VMM reads " + std::to_string(kOldestVersion) +
               " to " + std::to_string(kVersion));
  for (uint32_t want : layout_sizes()) {
    uint32_t got = 0;
    if (!r.get(&got) || got != want) return bad("written by a host with different KVM structures");
  }
  uint32_t cpus = 0;
  uint64_t mem_bytes = 0;
  std::string disk;
  uint8_t disk_ro = 1;
  if (!(r.get(&cpus) && r.get(&mem_bytes) && r.get_bytes(&disk, 4096) && r.get(&disk_ro))) return bad("truncated header");

  uint8_t has_net = 0;
  if (version >= 2 && (!r.get(&has_net) || has_net > 1)) return bad("truncated header");
  std::unique_ptr<Machine> m(new Machine());
  auto mem = GuestMemory::map_private_file(dir + "/memory");
  if (!mem) return mem.error();
  if (mem->size() != mem_bytes) return bad("memory file size does not match the saved RAM size");
  m->mem_ = std::move(*mem);
  if (Status s = m->build_common(cpus, io, disk, disk_ro != 0, has_net != 0); !s) return s.error();

  kvm_irqchip chips[3];
  kvm_pit_state2 pit;
  kvm_clock_data clock;
  for (auto& c : chips)
    if (!r.get(&c)) return bad("truncated irqchip state");
  if (!r.get(&pit) || !r.get(&clock)) return bad("truncated PIT/clock state");
  for (auto& c : chips)
    if (Status s = m->vm_.set_irqchip(c); !s) return s.error();
  if (Status s = m->vm_.set_pit2(pit); !s) return s.error();
  if (Status s = m->vm_.set_clock(clock); !s) return s.error();

  for (auto& v : m->vcpus_) {
    uint32_t n = 0;
    if (!r.get(&n) || n > kMaxCpuid) return bad("bad cpuid count");
    kvm::CpuidEntries c;
    c.entries.resize(n);
    for (auto& e : c.entries)
      if (!r.get(&e)) return bad("truncated cpuid");
    kvm_mp_state mp;
    kvm_regs regs;
    kvm_sregs sregs;
    kvm::XsaveArea xsave;
    kvm_xcrs xcrs;
    kvm_debugregs dr;
    kvm_lapic_state lapic;
    if (!(r.get(&mp) && r.get(&regs) && r.get(&sregs) && r.get(&xsave) && r.get(&xcrs) && r.get(&dr) && r.get(&lapic)))
      return bad("truncated vCPU state");
    uint32_t nm = 0;
    if (!r.get(&nm) || nm > kMaxMsrs) return bad("bad MSR count");
    std::vector<kvm::MsrEntry> msrs(nm);
    for (auto& e : msrs)
      if (!r.get(&e)) return bad("truncated MSRs");
    kvm_vcpu_events ev;
    if (!r.get(&ev)) return bad("truncated vCPU events");
    if (Status s = v->set_cpuid(c); !s) return s.error();
    if (Status s = v->set_mp_state(mp); !s) return s.error();
    if (Status s = v->set_regs(regs); !s) return s.error();
    if (Status s = v->set_sregs(sregs); !s) return s.error();
    if (Status s = v->set_xsave(xsave); !s) return s.error();
    if (Status s = v->set_xcrs(xcrs); !s) return s.error();
    if (Status s = v->set_debugregs(dr); !s) return s.error();
    if (Status s = v->set_lapic(lapic); !s) return s.error();
    if (Status s = set_msrs_tolerant(*v, msrs); !s) return s.error();
    if (Status s = v->set_vcpu_events(ev); !s) return s.error();
  }
  if (!m->serial_->restore(r) || !m->cmos_->restore(r) || !m->blk_mmio_->restore(r) || !m->console_mmio_->restore(r))
    return bad("bad device state");
  if (m->net_mmio_ && !m->net_mmio_->restore(r)) return bad("bad network device state");
  if (!r.done()) return bad("trailing bytes");
  return m;
}

}  // namespace sg::vmm
