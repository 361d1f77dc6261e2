// Machine: building the VM, the vCPU threads, pause and stop.
#include "sandbox-runtime/vmm/vm/machine.h"

#include <asm/kvm_para.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include "sandbox-runtime/vmm/boot/cpio.h"
#include "sandbox-runtime/vmm/boot/linux_boot.h"
#include "sandbox-runtime/vmm/boot/acpi.h"
#include "base/log.h"
#include "base/sys.h"
#include "sandbox-runtime/vmm/vm/exit.h"

namespace sg::vmm {

namespace {

constexpr int kKickSignal = SIGUSR1;
constexpr uint64_t kTssAddr = 0xfffbd000, kIdentityMapAddr = 0xfffbc000;
constexpr uint32_t kMsrMtrrDefType = 0x2ff, kMsrMiscEnable = 0x1a0;

void on_kick(int) {}

void install_kick_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa {};
    sa.sa_handler = on_kick;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = 0;  // no SA_RESTART: KVM_RUN must return EINTR
    ::sigaction(kKickSignal, &sa, nullptr);
  });
}

Result<std::string> read_whole(const std::string& path, uint64_t limit) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return sys::errno_error("open", path);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return sys::errno_error("fstat", path);
  if (static_cast<uint64_t>(st.st_size) > limit) return invalid_error(path + " is larger than " + std::to_string(limit >> 20) + " MiB");
  std::string s(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < s.size()) {
    ssize_t n = ::read(fd.get(), s.data() + done, s.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return sys::errno_error("read", path);
    done += static_cast<size_t>(n);
  }
  return s;
}

}  // namespace

Result<std::unique_ptr<EventFdIrq>> EventFdIrq::create(kvm::Vm& vm, uint32_t gsi) {
  std::unique_ptr<EventFdIrq> e(new EventFdIrq());
  e->fd_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!e->fd_) return sys::errno_error("eventfd", "irq " + std::to_string(gsi));
  if (Status s = vm.irqfd(e->fd_.get(), gsi); !s) return s.error();
  return e;
}

void EventFdIrq::trigger() {
  uint64_t one = 1;
  (void)!::write(fd_.get(), &one, sizeof one);
}

const char* state_name(State s) {
  switch (s) {
    case State::kCreated: return "created";
    case State::kRunning: return "running";
    case State::kPaused: return "paused";
    case State::kStopped: return "stopped";
  }
  return "?";
}

Status Machine::build_common(uint32_t cpus, const IoConfig& io, const std::string& disk, bool disk_ro, bool with_net) {
  if (cpus == 0 || cpus > boot::kMaxCpus) return invalid_error("vCPU count must be 1.." + std::to_string(boot::kMaxCpus));
  if (io.channel_fd < 0) return invalid_error("a channel fd is required");
  install_kick_handler();
  cpus_ = cpus;
  auto kvm = kvm::Kvm::open();
  if (!kvm) return kvm.error();
  kvm_ = std::move(*kvm);
  for (long cap : {KVM_CAP_IRQCHIP, KVM_CAP_IRQFD, KVM_CAP_PIT2, KVM_CAP_USER_MEMORY, KVM_CAP_IMMEDIATE_EXIT})
    if (kvm_.check_extension(cap) <= 0) return internal_error("/dev/kvm lacks KVM capability " + std::to_string(cap));
  auto rs = kvm_.vcpu_mmap_size();
  if (!rs) return rs.error();
  run_size_ = static_cast<size_t>(*rs);
  auto vm = kvm::Vm::create(kvm_);
  if (!vm) return vm.error();
  vm_ = std::move(*vm);
  if (Status s = vm_.set_tss_addr(kTssAddr); !s) return s;
  if (Status s = vm_.set_identity_map_addr(kIdentityMapAddr); !s) return s;
  if (Status s = vm_.create_irqchip(); !s) return s;
  if (Status s = vm_.create_pit2(); !s) return s;
  if (Status s = vm_.set_user_memory_region(0, 0, mem_.low_size(), mem_.host_base()); !s) return s;
  if (mem_.high_size())
    if (Status s = vm_.set_user_memory_region(1, kHighStart, mem_.high_size(), mem_.host_base() + mem_.low_size()); !s) return s;

  for (uint32_t gsi : {Serial::kIrq, kVirtioBlkIrq, kVirtioConsoleIrq, kVirtioNetIrq}) {
    auto irq = EventFdIrq::create(vm_, gsi);
    if (!irq) return irq.error();
    irqs_.push_back(std::move(*irq));
  }
  serial_ = std::make_unique<Serial>(io.serial_fd, irqs_[0].get());
  cmos_ = std::make_unique<Cmos>();
  i8042_ = std::make_unique<I8042>([this] { stop("guest reset (i8042)"); });
  if (Status s = pio_.add(Serial::kPort, Serial::kWindow, serial_.get()); !s) return s;
  if (Status s = pio_.add(Cmos::kPort, Cmos::kWindow, cmos_.get()); !s) return s;
  if (Status s = pio_.add(I8042::kPort, I8042::kWindow, i8042_.get()); !s) return s;

  disk_path_ = disk;
  disk_ro_ = disk_ro;
  disk_fd_.reset(::open(disk.c_str(), (disk_ro ? O_RDONLY : O_RDWR) | O_CLOEXEC));
  if (!disk_fd_) return sys::errno_error("open", disk);
  struct stat st {};
  if (::fstat(disk_fd_.get(), &st) != 0) return sys::errno_error("fstat", disk);
  blk_ = std::make_unique<VirtioBlk>(disk_fd_.get(), static_cast<uint64_t>(st.st_size), disk_ro, "sandgate-root");
  blk_mmio_ = std::make_unique<VirtioMmio>(mem_, *irqs_[1], *blk_);
  if (io.outlive)
    console_ = std::make_unique<VirtioConsole>(io.channel_fd, [](const std::string& why) {
      LOG_INFO("vmm: the host is gone (" << why << "); the machine runs on and waits for the next one");
    });
  else
    console_ = std::make_unique<VirtioConsole>(io.channel_fd, [this](const std::string& why) { stop(why); });
  console_mmio_ = std::make_unique<VirtioMmio>(mem_, *irqs_[2], *console_);
  if (Status s = mmio_.add(kVirtioBlkBase, kVirtioMmioWindow, blk_mmio_.get()); !s) return s;
  if (Status s = mmio_.add(kVirtioConsoleBase, kVirtioMmioWindow, console_mmio_.get()); !s) return s;
  if (with_net) {
    net_ = std::make_unique<VirtioNet>(io.tap_fd, io.mac);
    net_mmio_ = std::make_unique<VirtioMmio>(mem_, *irqs_[3], *net_);
    if (Status s = mmio_.add(kVirtioNetBase, kVirtioMmioWindow, net_mmio_.get()); !s) return s;
  } else if (io.tap_fd >= 0) {
    return invalid_error("this snapshot's machine has no network device (written by an older sandgate-vmm)");
  }

  for (uint32_t i = 0; i < cpus; ++i) {
    auto v = kvm::Vcpu::create(kvm_, vm_, i);
    if (!v) return v.error();
    vcpus_.push_back(std::move(*v));
  }
  return {};
}

kvm::CpuidEntries vcpu_cpuid(const kvm::CpuidEntries& supported, uint32_t id) {
  kvm::CpuidEntries c = supported;
  for (auto& e : c.entries) {
    if (e.function == 1) {
      e.ebx = (e.ebx & 0x00ffffff) | (id << 24);  // initial APIC id
      e.ecx |= 1u << 31;                          // hypervisor present: the guest looks for KVM's leaves
    }
    if (e.function == 0xb || e.function == 0x1f) e.edx = id;  // x2APIC id
    // No asynchronous page faults. A missing page of offloaded RAM is a
    // userfaultfd fault the memory engine serves in microseconds; with
    // async PF each became a "not present" event in the guest, a kworker
    // fault and a "page ready" event. In the KVM-in-TCG harness guests
    // died of it (a triple fault within a few offload rounds; docs/vmm.md).
    if (e.function == KVM_CPUID_FEATURES)
      e.eax &= ~((1u << KVM_FEATURE_ASYNC_PF) | (1u << KVM_FEATURE_ASYNC_PF_VMEXIT) | (1u << KVM_FEATURE_ASYNC_PF_INT));
  }
  return c;
}

Status Machine::setup_boot_vcpus(uint64_t entry) {
  auto cpuid = kvm_.supported_cpuid();
  if (!cpuid) return cpuid.error();
  for (auto& v : vcpus_) {
    if (Status s = v->set_cpuid(vcpu_cpuid(*cpuid, v->index())); !s) return s;
    if (Status s = v->set_msrs({{kMsrMtrrDefType, (1u << 11) | 6}}); !s) return s;
    (void)v->set_msrs({{kMsrMiscEnable, 1}});  // fast strings; not every host allows it
    auto lapic = v->get_lapic();
    if (!lapic) return lapic.error();
    auto lvt = [&](size_t off, uint32_t mode) {
      uint32_t x;
      std::memcpy(&x, lapic->regs + off, 4);
      x = (x & ~0x700u) | (mode << 8);
      std::memcpy(lapic->regs + off, &x, 4);
    };
    lvt(0x350, 7);  // LINT0: ExtINT (the PIC)
    lvt(0x360, 4);  // LINT1: NMI
    if (Status s = v->set_lapic(*lapic); !s) return s;
  }
  kvm::Vcpu& bsp = *vcpus_[0];
  auto sregs = bsp.get_sregs();
  if (!sregs) return sregs.error();
  boot::boot_sregs(&*sregs);
  if (Status s = bsp.set_sregs(*sregs); !s) return s;
  if (Status s = bsp.set_regs(boot::boot_regs(entry)); !s) return s;
  kvm_fpu fpu{};
  fpu.fcw = 0x37f;
  fpu.mxcsr = 0x1f80;
  return bsp.set_fpu(fpu);
}

Result<std::unique_ptr<Machine>> Machine::boot(const BootConfig& cfg, const IoConfig& io) {
  std::unique_ptr<Machine> m(new Machine());
  auto mem = GuestMemory::create_memfd(cfg.mem_bytes);
  if (!mem) return mem.error();
  m->mem_ = std::move(*mem);
  if (Status s = m->build_common(cfg.cpus, io, cfg.disk, cfg.disk_read_only, true); !s) return s.error();

  auto kernel = read_whole(cfg.kernel, 256ull << 20);
  if (!kernel) return kernel.error();
  std::string initrd;
  if (!cfg.initrd.empty()) {
    auto i = read_whole(cfg.initrd, 1ull << 30);
    if (!i) return i.error();
    initrd = std::move(*i);
  }
  if (!cfg.initrd_files.empty()) {
    while (initrd.size() % 4) initrd.push_back('\0');
    boot::CpioWriter w;
    for (const auto& [name, host] : cfg.initrd_files) {
      auto data = read_whole(host, 256ull << 20);
      if (!data) return data.error();
      w.add_file(name, 0755, *data);
    }
    initrd += w.finish();
  }
  auto k = boot::load_linux(m->mem_, *kernel, initrd, cfg.cmdline);
  if (!k) return k.error();
  if (Status s = boot::write_long_mode_tables(m->mem_); !s) return s.error();
  std::vector<boot::MmioDeviceInfo> devs = {{kVirtioBlkBase, kVirtioMmioWindow, kVirtioBlkIrq},
                                            {kVirtioConsoleBase, kVirtioMmioWindow, kVirtioConsoleIrq},
                                            {kVirtioNetBase, kVirtioMmioWindow, kVirtioNetIrq}};
  if (Status s = boot::write_acpi_tables(m->mem_, cfg.cpus, devs); !s) return s.error();
  if (Status s = m->setup_boot_vcpus(k->entry); !s) return s.error();
  return m;
}

Machine::~Machine() {
  stop("machine destroyed");
  for (auto& t : threads_)
    if (t.joinable()) t.join();
  if (console_) console_->stop();
  if (net_) net_->stop();
}

Status Machine::start() {
  std::lock_guard lock(mu_);
  if (state_ != State::kCreated) return conflict_error(std::string("machine is ") + state_name(state_));
  // The first threads: boot and restore make none, so the VMM can be
  // jailed and filtered between them and this (main.cpp).
  if (Status s = console_->start(*console_mmio_); !s) return s.error();
  if (net_)
    if (Status s = net_->start(*net_mmio_); !s) return s.error();
  state_ = State::kRunning;
  for (size_t i = 0; i < vcpus_.size(); ++i) threads_.emplace_back([this, i] { vcpu_loop(i); });
  return {};
}

void Machine::kick_all() {
  // threads_ is filled by start() under mu_; callers never hold mu_.
  std::lock_guard lock(mu_);
  for (size_t i = 0; i < vcpus_.size(); ++i) {
    vcpus_[i]->run_state()->immediate_exit = 1;
    if (i < threads_.size()) ::pthread_kill(threads_[i].native_handle(), kKickSignal);
  }
}

void Machine::vcpu_loop(size_t i) {
  kvm::Vcpu& v = *vcpus_[i];
  kvm_run* run = v.run_state();
  std::string why;
  // A failure stops the machine: the loop ends at its first check.
  if (vcpu_thread_init_)
    if (Status s = vcpu_thread_init_(); !s) stop("vcpu " + std::to_string(i) + ": " + s.error().message());
  for (;;) {
    {
      std::unique_lock lock(mu_);
      if (stop_requested_) break;
      if (pause_requested_) {
        // Complete the exit we just handled (an MMIO read's data, say) so
        // the saved registers are whole, then park.
        run->immediate_exit = 1;
        lock.unlock();
        (void)v.run();
        lock.lock();
        ++parked_;
        cv_.notify_all();
        cv_.wait(lock, [&] { return !pause_requested_ || stop_requested_; });
        --parked_;
        if (stop_requested_) break;
      }
      run->immediate_exit = 0;
    }
    Status s = v.run();
    if (!s) {
      if (s.error().kind() == ErrorKind::kUnavailable) continue;  // kicked
      stop("vcpu " + std::to_string(i) + ": " + s.error().message());
      break;
    }
    uint64_t n_exit = exits_.fetch_add(1, std::memory_order_relaxed);
    if (n_exit < 64 && log::enabled(log::Level::kDebug)) {
      if (run->exit_reason == KVM_EXIT_IO)
        LOG_DEBUG("vmm: vcpu " << i << " exit io port 0x" << std::hex << run->io.port << " dir " << int(run->io.direction));
      else if (run->exit_reason == KVM_EXIT_MMIO)
        LOG_DEBUG("vmm: vcpu " << i << " exit mmio 0x" << std::hex << run->mmio.phys_addr << " write " << int(run->mmio.is_write));
      else
        LOG_DEBUG("vmm: vcpu " << i << " exit reason " << run->exit_reason);
    }
    ExitAction a = handle_exit(*run, run_size_, pio_, mmio_, &why);
    if (a == ExitAction::kContinue) continue;
    stop("vcpu " + std::to_string(i) + ": " + why);
    break;
  }
  std::lock_guard lock(mu_);
  if (++exited_ == vcpus_.size()) {
    state_ = State::kStopped;
  }
  cv_.notify_all();
}

Status Machine::pause() {
  std::unique_lock lock(mu_);
  if (state_ == State::kPaused) return {};
  if (state_ != State::kRunning) return conflict_error(std::string("cannot pause a machine that is ") + state_name(state_));
  pause_requested_ = true;
  lock.unlock();
  kick_all();
  lock.lock();
  cv_.wait(lock, [&] { return parked_ + exited_ == vcpus_.size(); });
  if (stop_requested_) return conflict_error("machine stopped while pausing: " + stop_reason_);
  state_ = State::kPaused;
  lock.unlock();
  console_->set_paused(true);
  if (net_) net_->set_paused(true);
  // Tell the guest's kvmclock it was stopped, so its watchdogs do not fire.
  for (auto& v : vcpus_) (void)::ioctl(v->fd(), KVM_KVMCLOCK_CTRL, 0);
  return {};
}

Status Machine::resume() {
  std::unique_lock lock(mu_);
  if (state_ == State::kRunning) return {};
  if (state_ != State::kPaused) return conflict_error(std::string("cannot resume a machine that is ") + state_name(state_));
  state_ = State::kRunning;
  pause_requested_ = false;
  lock.unlock();
  console_->set_paused(false);
  if (net_) net_->set_paused(false);
  cv_.notify_all();
  return {};
}

Result<int> Machine::release_memory(uint64_t* features) {
  // Held across the release so a resume cannot start the vCPUs halfway.
  std::unique_lock lock(mu_);
  if (state_ != State::kPaused) return conflict_error("release the guest memory of a paused machine only");
  Result<int> r = mem_.release_to_userfaultfd(features);
  lock.unlock();
  if (!r && r.error().kind() == ErrorKind::kInternal) stop("guest RAM lost in a memory release: " + r.error().message());
  return r;
}

Status Machine::reattach_channel(UniqueFd fd) { return console_->reattach(std::move(fd)); }

void Machine::stop(const std::string& why) {
  {
    std::lock_guard lock(mu_);
    if (stop_requested_) return;
    stop_requested_ = true;
    stop_reason_ = why;
    if (threads_.empty()) state_ = State::kStopped;
  }
  LOG_INFO("vmm: stopping: " << why);
  cv_.notify_all();
  kick_all();
}

std::string Machine::wait() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return state_ == State::kStopped; });
  return stop_reason_;
}

State Machine::state() {
  std::lock_guard lock(mu_);
  return state_;
}

std::string Machine::describe_vcpus() {
  if (state() != State::kPaused) return "pause first";
  std::string out;
  for (auto& v : vcpus_) {
    auto r = v->get_regs();
    auto sr = v->get_sregs();
    auto mp = v->get_mp_state();
    if (!r || !sr || !mp) return "cannot read vCPU state";
    char b[256];
    std::snprintf(b, sizeof b, "vcpu %u: rip 0x%llx rsp 0x%llx rflags 0x%llx cr0 0x%llx cr3 0x%llx cr4 0x%llx efer 0x%llx mp %u; ",
                  v->index(), (unsigned long long)r->rip, (unsigned long long)r->rsp, (unsigned long long)r->rflags,
                  (unsigned long long)sr->cr0, (unsigned long long)sr->cr3, (unsigned long long)sr->cr4,
                  (unsigned long long)sr->efer, mp->mp_state);
    out += b;
  }
  return out;
}

MachineStats Machine::stats() {
  MachineStats s;
  s.state = state();
  s.cpus = cpus_;
  s.mem_bytes = mem_.size();
  s.exits = exits_.load(std::memory_order_relaxed);
  s.console_to_host = console_->bytes_to_host();
  s.console_to_guest = console_->bytes_to_guest();
  {
    auto lock = blk_mmio_->lock();
    s.blk_requests = blk_->requests();
    s.blk_errors = blk_->errors();
  }
  s.serial_bytes = serial_->bytes_written();
  if (net_) {
    s.net = true;
    s.net_counters = net_->counters();
  }
  return s;
}

}  // namespace sg::vmm
