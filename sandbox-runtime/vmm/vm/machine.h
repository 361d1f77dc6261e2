// Machine: one microVM — KVM VM, guest RAM, devices, one thread per vCPU —
// built either by booting a Linux kernel or by restoring a snapshot.
//
// Devices and their place (docs/vmm.md):
//   port 0x3f8 serial (IRQ 4), 0x70 CMOS RTC, 0x60/0x64 i8042 (reset)
//   0xd0000000 virtio-blk (IRQ 5): the root filesystem image
//   0xd0001000 virtio-console (IRQ 6): the channel to the agent (hvc0)
//   0xd0002000 virtio-net (IRQ 7): eth0 on a TAP device (or unplugged)
//   in-kernel: LAPICs, I/O APIC, PIC, PIT; kvmclock
//
// Lifecycle (State): kCreated -> kRunning <-> kPaused -> kStopped. The
// machine stops when the guest resets or shuts down, when the host end
// of the channel closes, on a KVM failure, or on stop(); wait() returns
// then with the reason.
//
// Thread safety: pause(), resume(), snapshot(), stop(), wait() and stats()
// may be called from any thread (the control thread); vCPU threads are
// internal.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "sandbox-runtime/vmm/devices/bus.h"
#include "sandbox-runtime/vmm/devices/cmos.h"
#include "sandbox-runtime/vmm/devices/i8042.h"
#include "sandbox-runtime/vmm/devices/serial.h"
#include "sandbox-runtime/vmm/devices/virtio_blk.h"
#include "sandbox-runtime/vmm/devices/virtio_console.h"
#include "sandbox-runtime/vmm/devices/virtio_mmio.h"
#include "sandbox-runtime/vmm/devices/virtio_net.h"
#include "base/fd.h"
#include "base/status.h"
#include "sandbox-runtime/vmm/kvm/kvm.h"
#include "sandbox-runtime/vmm/kvm/memory.h"

namespace sg::vmm {

inline constexpr uint64_t kVirtioBlkBase = 0xd000'0000, kVirtioConsoleBase = 0xd000'1000, kVirtioNetBase = 0xd000'2000;
inline constexpr uint32_t kVirtioBlkIrq = 5, kVirtioConsoleIrq = 6, kVirtioNetIrq = 7;

struct BootConfig {
  uint32_t cpus = 1;
  uint64_t mem_bytes = 512ull << 20;
  std::string kernel;  // bzImage
  std::string initrd;  // cpio archive(s)
  // Extra files appended to the initramfs as one more cpio archive:
  // (path inside the guest without leading '/', host path), mode 0755.
  std::vector<std::pair<std::string, std::string>> initrd_files;
  std::string cmdline;  // devices are described in ACPI tables, not here
  std::string disk;     // root filesystem image
  bool disk_read_only = true;
};

struct IoConfig {
  int channel_fd = -1;  // host end of the console (borrowed)
  int serial_fd = -1;   // where the guest's serial output goes (borrowed), -1: dropped
  // The host going (channel EOF) does not stop the machine: it runs on
  // and waits for reattach_channel() (sandgate-vmm --outlive).
  bool outlive = false;
  // The host end of eth0 (borrowed; -1: the device is there, unplugged).
  int tap_fd = -1;
  // The guest's MAC at boot (a restored machine keeps the one it had).
  VirtioNet::Mac mac = {0x02, 0x53, 0x47, 0x00, 0x00, 0x01};
};

// The CPUID a vCPU runs with: KVM's supported set with the hypervisor bit
// and this vCPU's APIC ids, less KVM's async page faults. Booted and
// snapshotted vCPUs both use it.
kvm::CpuidEntries vcpu_cpuid(const kvm::CpuidEntries& supported, uint32_t id);

enum class State { kCreated, kRunning, kPaused, kStopped };
const char* state_name(State s);

struct MachineStats {
  State state = State::kCreated;
  uint32_t cpus = 0;
  uint64_t mem_bytes = 0;
  uint64_t exits = 0;
  uint64_t console_to_host = 0, console_to_guest = 0;
  uint64_t blk_requests = 0, blk_errors = 0;
  uint64_t serial_bytes = 0;
  bool net = false;  // the machine has a virtio-net device
  VirtioNet::Counters net_counters{};
};

// An IrqLine backed by an eventfd registered with KVM_IRQFD on one GSI.
class EventFdIrq final : public IrqLine {
 public:
  static Result<std::unique_ptr<EventFdIrq>> create(kvm::Vm& vm, uint32_t gsi);
  void trigger() override;

 private:
  UniqueFd fd_;
};

class Machine {
 public:
  static Result<std::unique_ptr<Machine>> boot(const BootConfig& cfg, const IoConfig& io);
  // Restores <dir>/vm.state and maps <dir>/memory MAP_PRIVATE.
  static Result<std::unique_ptr<Machine>> restore(const std::string& dir, const IoConfig& io);
  ~Machine();  // stops and joins

  // Starts the console's I/O thread and the vCPU threads (kCreated ->
  // kRunning); boot() and restore() start none.
  Status start();
  // The one directory this VMM may write a snapshot to: host_dir, which a
  // jailed VMM (vm/confine.h) sees at jail_dir (unjailed: the same path).
  // snapshot() then takes only host_dir.
  void set_snapshot_alias(std::string host_dir, std::string jail_dir) {
    snapshot_host_dir_ = std::move(host_dir);
    snapshot_jail_dir_ = std::move(jail_dir);
  }
  // Run first on each vCPU thread, before the guest's first instruction
  // there (sandgate-vmm: the vCPU threads' own seccomp filter,
  // vm/confine.h); a failure stops the machine. Set before start().
  void set_vcpu_thread_init(std::function<Status()> init) { vcpu_thread_init_ = std::move(init); }
  // Stops the vCPUs at an instruction boundary (all pending I/O completed)
  // and the console's data movement. Idempotent.
  Status pause();
  Status resume();
  // Writes <dir>/vm.state and <dir>/memory (sparse: zero pages are holes).
  // The machine must be paused. dir is created; files appear atomically.
  Status snapshot(const std::string& dir);
  // The same into two files sandgate opened (a VMM that may open none):
  // the RAM into memory_fd (sparse), the state into state_fd; both
  // truncated first and synced. Paused machines only.
  Status snapshot_to(int memory_fd, int state_fd);
  // Memory offload: GuestMemory::release_to_userfaultfd on a paused
  // machine (the console is quiet while paused). Returns the new uffd or
  // -1. A failure after the remap stops the machine: its RAM is gone.
  Result<int> release_memory(uint64_t* features);
  void stop(const std::string& why);
  // A new host's end of the console after the old host went (IoConfig::outlive).
  Status reattach_channel(UniqueFd fd);
  // Blocks until kStopped; returns why it stopped.
  std::string wait();
  State state();
  MachineStats stats();
  // Registers of every vCPU, one line each, for diagnosing a stuck guest
  // (paused machines only).
  std::string describe_vcpus();
  const GuestMemory& memory() const { return mem_; }

 private:
  Machine() = default;
  // with_net: the machine has the virtio-net device (every booted one;
  // restored ones from snapshots written before it existed do not).
  Status build_common(uint32_t cpus, const IoConfig& io, const std::string& disk, bool disk_ro, bool with_net);
  Status setup_boot_vcpus(uint64_t entry);
  void vcpu_loop(size_t i);
  void kick_all();
  Status save_state(const std::string& path);
  Result<std::vector<uint8_t>> state_bytes();

  kvm::Kvm kvm_;
  kvm::Vm vm_;
  GuestMemory mem_;
  size_t run_size_ = 0;
  uint32_t cpus_ = 0;
  std::string disk_path_;
  bool disk_ro_ = true;
  UniqueFd disk_fd_;
  Bus pio_, mmio_;
  std::vector<std::unique_ptr<EventFdIrq>> irqs_;
  std::unique_ptr<Serial> serial_;
  std::unique_ptr<Cmos> cmos_;
  std::unique_ptr<I8042> i8042_;
  std::unique_ptr<VirtioBlk> blk_;
  std::unique_ptr<VirtioMmio> blk_mmio_;
  std::unique_ptr<VirtioConsole> console_;
  std::unique_ptr<VirtioMmio> console_mmio_;
  std::unique_ptr<VirtioNet> net_;  // null only in machines restored from version-1 snapshots
  std::unique_ptr<VirtioMmio> net_mmio_;
  std::vector<std::unique_ptr<kvm::Vcpu>> vcpus_;
  std::vector<std::thread> threads_;
  std::string snapshot_host_dir_, snapshot_jail_dir_;  // set before start(), then read only
  std::function<Status()> vcpu_thread_init_;            // the same
  std::atomic<uint64_t> exits_{0};

  std::mutex mu_;
  std::condition_variable cv_;
  State state_ = State::kCreated;  // GUARDED_BY(mu_)
  bool pause_requested_ = false;   // GUARDED_BY(mu_)
  bool stop_requested_ = false;    // GUARDED_BY(mu_)
  size_t parked_ = 0;              // GUARDED_BY(mu_)
  size_t exited_ = 0;              // GUARDED_BY(mu_)
  std::string stop_reason_;        // GUARDED_BY(mu_)
};

}  // namespace sg::vmm
