// KVM ioctl wrappers: one errno-capturing call site per ioctl.
#include "sandbox-runtime/vmm/kvm/kvm.h"

#include <fcntl.h>
#include <sys/ioctl.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "base/sys.h"

namespace sg::vmm::kvm {

namespace {

// The KVM structs with flexible arrays (kvm_cpuid2, kvm_msrs, kvm_msr_list,
// kvm_xsave) have a different sizeof in C++ than in C, and the ioctl
// numbers encode that size: spell the C headers out here.
struct CpuidHdr {
  uint32_t nent, padding;
};
struct MsrsHdr {
  uint32_t nmsrs, pad;
};
struct MsrListHdr {
  uint32_t nmsrs;
};
static_assert(sizeof(CpuidHdr) == 8 && sizeof(MsrsHdr) == 8 && sizeof(MsrListHdr) == 4);
constexpr unsigned long kGetSupportedCpuid = _IOWR(KVMIO, 0x05, CpuidHdr);
constexpr unsigned long kSetCpuid2 = _IOW(KVMIO, 0x90, CpuidHdr);
constexpr unsigned long kGetMsrs = _IOWR(KVMIO, 0x88, MsrsHdr);
constexpr unsigned long kSetMsrs = _IOW(KVMIO, 0x89, MsrsHdr);
constexpr unsigned long kGetMsrIndexList = _IOWR(KVMIO, 0x02, MsrListHdr);
constexpr unsigned long kGetXsave = _IOR(KVMIO, 0xa4, XsaveArea);
constexpr unsigned long kSetXsave = _IOW(KVMIO, 0xa5, XsaveArea);

template <typename T>
Status ioctl_in(int fd, unsigned long req, const T& arg, std::string_view op, std::string_view obj) {
  if (::ioctl(fd, req, &arg) < 0) return sys::errno_error(op, obj);
  return {};
}

template <typename T>
Result<T> ioctl_out(int fd, unsigned long req, std::string_view op, std::string_view obj) {
  T v;
  std::memset(&v, 0, sizeof v);
  if (::ioctl(fd, req, &v) < 0) return sys::errno_error(op, obj);
  return v;
}

std::string vcpu_name(uint32_t i) { return "vcpu " + std::to_string(i); }

}  // namespace

Result<Kvm> Kvm::open(const std::string& path) {
  Kvm k;
  k.fd_.reset(::open(path.c_str(), O_RDWR | O_CLOEXEC));
  if (!k.fd_) return sys::errno_error("open", path);
  int v = ::ioctl(k.fd_.get(), KVM_GET_API_VERSION, 0);
  if (v != KVM_API_VERSION)
    return internal_error(path + ": KVM API version " + std::to_string(v) + ", need " + std::to_string(KVM_API_VERSION));
  return k;
}

int Kvm::check_extension(long cap) const { return ::ioctl(fd_.get(), KVM_CHECK_EXTENSION, cap); }

Result<int> Kvm::vcpu_mmap_size() const {
  int n = ::ioctl(fd_.get(), KVM_GET_VCPU_MMAP_SIZE, 0);
  if (n <= 0) return sys::errno_error("KVM_GET_VCPU_MMAP_SIZE", "/dev/kvm");
  return n;
}

Result<CpuidEntries> Kvm::supported_cpuid() const {
  for (uint32_t n = 128; n <= 4096; n *= 2) {
    std::vector<uint8_t> buf(sizeof(CpuidHdr) + n * sizeof(kvm_cpuid_entry2));
    auto* c = reinterpret_cast<CpuidHdr*>(buf.data());
    c->nent = n;
    if (::ioctl(fd_.get(), kGetSupportedCpuid, c) == 0) {
      if (c->nent > n) return internal_error("KVM_GET_SUPPORTED_CPUID: bad entry count");
      CpuidEntries out;
      out.entries.resize(c->nent);
      std::memcpy(out.entries.data(), buf.data() + sizeof(CpuidHdr), c->nent * sizeof(kvm_cpuid_entry2));
      return out;
    }
    if (errno != E2BIG) return sys::errno_error("KVM_GET_SUPPORTED_CPUID", "/dev/kvm");
  }
  return internal_error("KVM_GET_SUPPORTED_CPUID: more than 4096 entries");
}

Result<std::vector<uint32_t>> Kvm::msr_index_list() const {
  MsrListHdr probe{};
  probe.nmsrs = 0;
  if (::ioctl(fd_.get(), kGetMsrIndexList, &probe) < 0 && errno != E2BIG)
    return sys::errno_error("KVM_GET_MSR_INDEX_LIST", "/dev/kvm");
  uint32_t n = probe.nmsrs;
  if (n > 16384) return internal_error("KVM_GET_MSR_INDEX_LIST: implausible count " + std::to_string(n));
  std::vector<uint8_t> buf(sizeof(MsrListHdr) + n * sizeof(uint32_t));
  auto* l = reinterpret_cast<MsrListHdr*>(buf.data());
  l->nmsrs = n;
  if (::ioctl(fd_.get(), kGetMsrIndexList, l) < 0) return sys::errno_error("KVM_GET_MSR_INDEX_LIST", "/dev/kvm");
  if (l->nmsrs > n) return internal_error("KVM_GET_MSR_INDEX_LIST: bad count");
  std::vector<uint32_t> out(l->nmsrs);
  std::memcpy(out.data(), buf.data() + sizeof(MsrListHdr), out.size() * sizeof(uint32_t));
  return out;
}

Result<Vm> Vm::create(const Kvm& kvm) {
  Vm vm;
  int fd = ::ioctl(kvm.fd(), KVM_CREATE_VM, 0);
  if (fd < 0) return sys::errno_error("KVM_CREATE_VM", "/dev/kvm");
  vm.fd_.reset(fd);
  ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  return vm;
}

Status Vm::set_tss_addr(uint64_t addr) {
  if (::ioctl(fd_.get(), KVM_SET_TSS_ADDR, static_cast<unsigned long>(addr)) < 0) return sys::errno_error("KVM_SET_TSS_ADDR", "vm");
  return {};
}
Status Vm::set_identity_map_addr(uint64_t addr) {
  uint64_t a = addr;
  return ioctl_in(fd_.get(), KVM_SET_IDENTITY_MAP_ADDR, a, "KVM_SET_IDENTITY_MAP_ADDR", "vm");
}
Status Vm::create_irqchip() {
  if (::ioctl(fd_.get(), KVM_CREATE_IRQCHIP, 0) < 0) return sys::errno_error("KVM_CREATE_IRQCHIP", "vm");
  return {};
}
Status Vm::create_pit2() {
  kvm_pit_config cfg{};
  cfg.flags = KVM_PIT_SPEAKER_DUMMY;
  return ioctl_in(fd_.get(), KVM_CREATE_PIT2, cfg, "KVM_CREATE_PIT2", "vm");
}
Status Vm::set_user_memory_region(uint32_t slot, uint64_t gpa, uint64_t size, void* host) {
  kvm_userspace_memory_region r{};
  r.slot = slot;
  r.guest_phys_addr = gpa;
  r.memory_size = size;
  r.userspace_addr = reinterpret_cast<uint64_t>(host);
  return ioctl_in(fd_.get(), KVM_SET_USER_MEMORY_REGION, r, "KVM_SET_USER_MEMORY_REGION", "slot " + std::to_string(slot));
}
Status Vm::irqfd(int eventfd, uint32_t gsi) {
  kvm_irqfd f{};
  f.fd = static_cast<uint32_t>(eventfd);
  f.gsi = gsi;
  return ioctl_in(fd_.get(), KVM_IRQFD, f, "KVM_IRQFD", "gsi " + std::to_string(gsi));
}
Status Vm::irq_line(uint32_t irq, bool level) {
  kvm_irq_level l{};
  l.irq = irq;
  l.level = level ? 1 : 0;
  return ioctl_in(fd_.get(), KVM_IRQ_LINE, l, "KVM_IRQ_LINE", "irq " + std::to_string(irq));
}
Result<kvm_irqchip> Vm::get_irqchip(uint32_t chip_id) {
  kvm_irqchip c{};
  c.chip_id = chip_id;
  if (::ioctl(fd_.get(), KVM_GET_IRQCHIP, &c) < 0) return sys::errno_error("KVM_GET_IRQCHIP", "chip " + std::to_string(chip_id));
  return c;
}
Status Vm::set_irqchip(const kvm_irqchip& chip) {
  return ioctl_in(fd_.get(), KVM_SET_IRQCHIP, chip, "KVM_SET_IRQCHIP", "chip " + std::to_string(chip.chip_id));
}
Result<kvm_pit_state2> Vm::get_pit2() { return ioctl_out<kvm_pit_state2>(fd_.get(), KVM_GET_PIT2, "KVM_GET_PIT2", "vm"); }
Status Vm::set_pit2(const kvm_pit_state2& p) { return ioctl_in(fd_.get(), KVM_SET_PIT2, p, "KVM_SET_PIT2", "vm"); }
Result<kvm_clock_data> Vm::get_clock() { return ioctl_out<kvm_clock_data>(fd_.get(), KVM_GET_CLOCK, "KVM_GET_CLOCK", "vm"); }
Status Vm::set_clock(const kvm_clock_data& c) {
  kvm_clock_data d{};
  d.clock = c.clock;  // flags other than the clock are outputs of GET
  return ioctl_in(fd_.get(), KVM_SET_CLOCK, d, "KVM_SET_CLOCK", "vm");
}

Result<std::unique_ptr<Vcpu>> Vcpu::create(const Kvm& kvm, const Vm& vm, uint32_t index) {
  auto size = kvm.vcpu_mmap_size();
  if (!size) return size.error();
  std::unique_ptr<Vcpu> v(new Vcpu());
  v->index_ = index;
  int fd = ::ioctl(vm.fd(), KVM_CREATE_VCPU, static_cast<unsigned long>(index));
  if (fd < 0) return sys::errno_error("KVM_CREATE_VCPU", vcpu_name(index));
  v->fd_.reset(fd);
  ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  void* p = ::mmap(nullptr, static_cast<size_t>(*size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return sys::errno_error("mmap kvm_run", vcpu_name(index));
  v->run_ = static_cast<kvm_run*>(p);
  v->run_size_ = static_cast<size_t>(*size);
  return v;
}

Vcpu::~Vcpu() {
  if (run_) ::munmap(run_, run_size_);
}

Status Vcpu::run() {
  if (::ioctl(fd_.get(), KVM_RUN, 0) < 0) {
    int e = errno;
    if (e == EINTR || e == EAGAIN) return Error(ErrorKind::kUnavailable, "KVM_RUN interrupted");
    return sys::errno_error("KVM_RUN", vcpu_name(index_), e);
  }
  return {};
}

#define SG_VCPU_GETSET(Type, name, GET, SET)                                                             \
  Result<Type> Vcpu::get_##name() { return ioctl_out<Type>(fd_.get(), GET, #GET, vcpu_name(index_)); } \
  Status Vcpu::set_##name(const Type& v) { return ioctl_in(fd_.get(), SET, v, #SET, vcpu_name(index_)); }
SG_VCPU_GETSET(kvm_regs, regs, KVM_GET_REGS, KVM_SET_REGS)
SG_VCPU_GETSET(kvm_sregs, sregs, KVM_GET_SREGS, KVM_SET_SREGS)
SG_VCPU_GETSET(kvm_fpu, fpu, KVM_GET_FPU, KVM_SET_FPU)
SG_VCPU_GETSET(XsaveArea, xsave, kGetXsave, kSetXsave)
SG_VCPU_GETSET(kvm_xcrs, xcrs, KVM_GET_XCRS, KVM_SET_XCRS)
SG_VCPU_GETSET(kvm_lapic_state, lapic, KVM_GET_LAPIC, KVM_SET_LAPIC)
SG_VCPU_GETSET(kvm_vcpu_events, vcpu_events, KVM_GET_VCPU_EVENTS, KVM_SET_VCPU_EVENTS)
SG_VCPU_GETSET(kvm_mp_state, mp_state, KVM_GET_MP_STATE, KVM_SET_MP_STATE)
SG_VCPU_GETSET(kvm_debugregs, debugregs, KVM_GET_DEBUGREGS, KVM_SET_DEBUGREGS)
#undef SG_VCPU_GETSET

Status Vcpu::set_cpuid(const CpuidEntries& c) {
  std::vector<uint8_t> buf(sizeof(CpuidHdr) + c.entries.size() * sizeof(kvm_cpuid_entry2));
  auto* p = reinterpret_cast<CpuidHdr*>(buf.data());
  p->nent = static_cast<uint32_t>(c.entries.size());
  std::memcpy(buf.data() + sizeof(CpuidHdr), c.entries.data(), c.entries.size() * sizeof(kvm_cpuid_entry2));
  if (::ioctl(fd_.get(), kSetCpuid2, p) < 0) return sys::errno_error("KVM_SET_CPUID2", vcpu_name(index_));
  return {};
}

Result<std::vector<MsrEntry>> Vcpu::get_msrs(const std::vector<uint32_t>& indices) {
  std::vector<MsrEntry> out;
  size_t i = 0;
  while (i < indices.size()) {
    size_t n = indices.size() - i;
    std::vector<uint8_t> buf(sizeof(MsrsHdr) + n * sizeof(kvm_msr_entry));
    auto* m = reinterpret_cast<MsrsHdr*>(buf.data());
    auto* e = reinterpret_cast<kvm_msr_entry*>(buf.data() + sizeof(MsrsHdr));
    m->nmsrs = static_cast<uint32_t>(n);
    for (size_t k = 0; k < n; ++k) e[k].index = indices[i + k];
    int got = ::ioctl(fd_.get(), kGetMsrs, m);
    if (got < 0) return sys::errno_error("KVM_GET_MSRS", vcpu_name(index_));
    if (static_cast<size_t>(got) > n) return internal_error("KVM_GET_MSRS: bad count");
    for (int k = 0; k < got; ++k) out.push_back({e[k].index, e[k].data});
    // KVM stops at the first MSR it cannot read: skip that one, go on.
    i += static_cast<size_t>(got) + 1;
  }
  return out;
}

Status Vcpu::set_msrs(const std::vector<MsrEntry>& msrs) {
  std::vector<uint8_t> buf(sizeof(MsrsHdr) + msrs.size() * sizeof(kvm_msr_entry));
  auto* m = reinterpret_cast<MsrsHdr*>(buf.data());
  auto* e = reinterpret_cast<kvm_msr_entry*>(buf.data() + sizeof(MsrsHdr));
  m->nmsrs = static_cast<uint32_t>(msrs.size());
  for (size_t k = 0; k < msrs.size(); ++k) {
    e[k].index = msrs[k].index;
    e[k].data = msrs[k].data;
  }
  int got = ::ioctl(fd_.get(), kSetMsrs, m);
  if (got < 0) return sys::errno_error("KVM_SET_MSRS", vcpu_name(index_));
  if (static_cast<size_t>(got) != msrs.size())
    return internal_error("KVM_SET_MSRS " + vcpu_name(index_) + ": MSR 0x" +
                          [&] { char b[16]; std::snprintf(b, sizeof b, "%x", msrs[got].index); return std::string(b); }() +
                          " refused (" + std::to_string(got) + " of " + std::to_string(msrs.size()) + " set)");
  return {};
}

std::vector<unsigned long> running_ioctls() {
  // KVM_RUN first: the filter tries rules in order, and it is the hot one.
  return {KVM_RUN, KVM_IRQ_LINE, KVM_IRQFD, KVM_KVMCLOCK_CTRL, KVM_SET_USER_MEMORY_REGION, KVM_CHECK_EXTENSION,
          kGetMsrIndexList, kGetSupportedCpuid, KVM_GET_IRQCHIP, KVM_SET_IRQCHIP, KVM_GET_PIT2, KVM_SET_PIT2,
          KVM_GET_CLOCK, KVM_SET_CLOCK, KVM_GET_REGS, KVM_SET_REGS, KVM_GET_SREGS, KVM_SET_SREGS, KVM_GET_FPU,
          KVM_SET_FPU, kGetXsave, kSetXsave, KVM_GET_XCRS, KVM_SET_XCRS, KVM_GET_LAPIC, KVM_SET_LAPIC,
          KVM_GET_VCPU_EVENTS, KVM_SET_VCPU_EVENTS, KVM_GET_MP_STATE, KVM_SET_MP_STATE, KVM_GET_DEBUGREGS,
          KVM_SET_DEBUGREGS, kSetCpuid2, kGetMsrs, kSetMsrs};
}

}  // namespace sg::vmm::kvm
