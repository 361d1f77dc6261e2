// Runtime: the one interface every sandbox backend implements.
//
// A backend turns a SandboxSpec into a live sandbox whose PID 1 is
// sandgate-agent, reachable over the channel (docs/channel.md). The process
// backend (sandbox-runtime/process) is the first; the KVM backend
// (sandbox-runtime/vmm) comes later behind the same interface.
//
// Thread safety: all methods may block (fork, mounts, cgroup writes, waiting
// for the agent) and must never be called on an io thread. A Runtime and each
// Sandbox are safe to call from several threads at once.
#pragma once

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "base/fd.h"
#include "base/status.h"

namespace sg::sys {
class Os;
}

namespace sg::runtime {

class SwapObserver;

// Serves a stream a sandbox process opened to a gateway service: the agent
// forwards each connection to 127.0.0.1:49982 inside the sandbox as a
// channel stream {"service":"llm"} (docs/channel.md), and the sandbox's
// HostChannel calls this with the sandbox's id and the service name (already
// validated: [a-z0-9-]{1,32}). Return one end of a socketpair whose other
// end the gateway serves (HTTP for "llm"); the channel bridges the stream to
// it and owns it from then on. An Error refuses the stream: its message is
// the RESET reason the agent sees (kNotFound for a service this host does
// not offer). Called on the sandbox's channel thread, so it must not block:
// create the socketpair, hand one end to the gateway's io_context, return.
// Sandbox::kill() joins that thread, so the opener must not take a lock
// that a caller of kill() may hold. It may be called from several
// sandboxes' threads at once.
using ServiceOpener = std::function<Result<UniqueFd>(const std::string& sandbox_id, const std::string& service)>;

// Size-limited writable layers (the process backend, process/disk.h):
// kAuto limits them where loop devices and mkfs.ext4 are available and
// otherwise leaves them unlimited (logged once); kOn fails a create that
// cannot have one; kOff never limits. MicroVMs' writable layer is a guest
// tmpfs, bounded by the guest's memory either way.
enum class DiskLimits { kAuto, kOn, kOff };

// User namespaces (the process backend, process/userns.h): kAuto maps each
// sandbox's root to an unprivileged host uid range where the kernel and the
// template's filesystem allow it and otherwise runs it as host root
// (logged once); kOn fails a create that cannot have one; kOff never.
enum class UserNamespaces { kAuto, kOn, kOff };

// Sandboxes' own networks (network/host_network.h, docs/networking.md),
// made by the server and handed to the backend, which calls reserve()
// before a sandbox's first process is built (the addresses go into its
// agent's environment), attach() once its network namespace exists and
// before that process runs (a microVM: attach_tap() before its VMM starts), and release() when the sandbox is gone (also
// after a failed attach). A sandbox taken back after a restart
// (Runtime::recover) is adopt()ed instead: its link outlived the previous
// server. Thread-safe.
class SandboxNetworks {
 public:
  virtual ~SandboxNetworks() = default;
  struct Link {
    std::string address;  // the sandbox's IPv4 address
    std::string gateway;  // its default route and DNS server
  };
  virtual Result<Link> reserve(const std::string& id) = 0;
  virtual Status attach(const std::string& id, int netns_fd) = 0;
  // The microVM backend's attach: the link as a TAP device, whose fd goes
  // to the sandbox's VMM (its virtio-net); the guest is told its address
  // in "configure".
  virtual Result<UniqueFd> attach_tap(const std::string& id) = 0;
  // kNotFound when the sandbox has no network of this server's.
  virtual Status adopt(const std::string& id, int netns_fd) = 0;
  // The microVM backend's adopt: the sandbox's TAP, which its VMM kept
  // open while no server ran, taken back by the guest address it was
  // given (the runtime's own record of it). kNotFound when its link is gone.
  virtual Status adopt_tap(const std::string& id, const std::string& address) = 0;
  virtual void release(const std::string& id) = 0;
};

struct RuntimeConfig {
  // Directory under which each sandbox gets state_root/<id>/ (overlay upper,
  // work, mount point). Created if missing.
  std::string state_root;
  // Host path of the sandgate-agent binary (static); made visible read-only
  // inside every sandbox at /.sandgate/sandgate-agent.
  std::string agent_path;
  // Name of the cgroup directory that holds all sandboxes of this sandgate
  // instance, e.g. "sandgate" or "sandgate-test-1234". Per-sandbox cgroups
  // are <controller root>/<cgroup_parent>/<sandbox id>.
  std::string cgroup_parent = "sandgate";
  // Gateway services for streams the agent opens; empty: every such stream
  // is refused ("no gateway services on this host").
  ServiceOpener open_service;
  DiskLimits disk_limits = DiskLimits::kAuto;
  UserNamespaces user_namespaces = UserNamespaces::kAuto;
  // Host uids (and gids) of sandboxes: sandbox k of those alive at once
  // gets first_sandbox_uid + k * 65536 .. + 65535. One range per sandgate
  // instance on a host.
  uint32_t first_sandbox_uid = 1u << 30;
  uint32_t sandbox_uid_slots = 16384;
  // The host's syscalls (base/os.h) for every change a sandbox makes to
  // the host; null: the real host. Tests pass one that fails the Nth call.
  sys::Os* os = nullptr;
  // Sandboxes outlive this sandgate (a stop, an upgrade, a crash): the
  // process backend's agents are not tied to it and wait for the next
  // host, which takes them back with Runtime::recover(). Off: they die
  // with it (PR_SET_PDEATHSIG).
  bool sandboxes_outlive_host = false;
  // Offload to swap (process backend, process/swap.h): Sandbox::swap_out
  // and swap_in work; the caller made the swap (a zram device) first.
  bool swap_offload = false;
  // Sees every swap_out's pages (null: none); outlives the runtime.
  SwapObserver* swap_observer = nullptr;
  // Each sandbox's own network link to the host (null: loopback only);
  // outlives the runtime.
  SandboxNetworks* networks = nullptr;
};

inline constexpr size_t kMaxTemplateLayers = 64;

// A layer that is a microVM snapshot (Runtime::snapshots_memory): its
// directory holds "vm.state" (written last) and "memory".
inline bool is_vm_snapshot_layer(const std::string& dir) { return ::access((dir + "/vm.state").c_str(), F_OK) == 0; }

// A built template's start command (its config's startCmd, readyCmd, user,
// workdir and env): run in the background, then the ready command until it
// exits 0, at most ready_timeout.
struct StartCommand {
  std::string script;
  std::string ready;  // "": none (ready once started)
  std::string user = "user";
  std::string cwd;
  std::vector<std::pair<std::string, std::string>> env;
  std::chrono::milliseconds ready_timeout{120000};
  bool operator==(const StartCommand&) const = default;
};

struct SandboxSpec {
  std::string id;      // [a-z0-9]{20}; never contains '/', '-' or '.'
  std::string rootfs;  // template root directory: the read-only overlay lower layer
  // A built template's layers over rootfs, lowest first (directories that
  // export_layer() made); at most kMaxTemplateLayers.
  std::vector<std::string> layers;
  uint32_t cpu_count = 2;
  uint64_t memory_mb = 512;
  uint32_t max_pids = 1024;
  uint64_t disk_mb = 0;  // size of the writable layer; 0: unlimited (see DiskLimits)
  // Default environment of every process in the sandbox (create's envVars).
  std::vector<std::pair<std::string, std::string>> env;
  // envd access token handed to the agent (it checks X-Access-Token).
  std::string envd_access_token;
  std::chrono::milliseconds ready_timeout{15000};
  // The template's start command. A runtime whose runs_start_command() is
  // true has it running in every sandbox it creates (the kvm backend: in
  // the template's snapshot); otherwise the caller runs it after create.
  std::optional<StartCommand> start;
};

// Readings from the sandbox's cgroup and writable layer.
struct Usage {
  uint64_t cpu_usage_ns = 0;     // cumulative CPU time of all its processes
  uint64_t mem_used_bytes = 0;   // memory charged to the cgroup, page cache excluded
  uint64_t mem_cache_bytes = 0;  // page cache charged to the cgroup
  uint64_t mem_limit_bytes = 0;  // the cgroup's memory limit
  uint64_t disk_used_bytes = 0;  // bytes in the writable layer
};

// A microVM's guest RAM as its VMM maps it, for the memory offload engine
// (wait-engine/memory/offload.h). Page i is the 4 KiB at base + i * 4096
// in the VMM's address space (process pid).
struct GuestMemoryInfo {
  int pid = -1;
  uint64_t base = 0;
  uint64_t size = 0;
  std::string backing;          // "memfd", "file", "userfaultfd" (docs/vmm.md)
  std::string template_memory;  // the snapshot memory file a clone started from; "" for a booted VM
};

// What Sandbox::swap_out did (process backend, process/swap.h).
struct SwapOutAccount {
  uint64_t resident_pages = 0;  // private anonymous pages resident before
  uint64_t out_pages = 0;       // of those, in swap after
  uint64_t hot_pages = 0;       // read back before the thaw: resident at this swap-out and the one before
  uint64_t unused_pages = 0;    // read back before the last thaw and not touched since: put back out
};

// A run of resident pages in one mapping of a process (SwapObserver).
struct SwapRun {
  uint64_t start = 0;
  uint64_t pages = 0;
  std::string region;          // the mapping's name in /proc/PID/maps: "[heap]", "[stack]", "" (anonymous)
  uint32_t region_index = 0;   // mappings of that name before it in the process
  uint64_t region_offset = 0;  // start minus the mapping's start
};

// Sees the pages each Sandbox::swap_out pushes out (RuntimeConfig::
// swap_observer; the codec audit, wait-engine/memory/swap_audit.h). One
// swap_out calls begin, then for each process before() (the sandbox is
// frozen, the advice not yet given) and after() (for each run of before(),
// which of its pages are in swap now), then end(), also after an error.
// Called on the swap_out's thread; swap_outs may run at once.
class SwapObserver {
 public:
  virtual ~SwapObserver() = default;
  // cohort: what siblings share (the template's root and layers).
  virtual void begin(const std::string& sandbox_id, const std::string& cohort) = 0;
  // process: the process's name and ordinal among the sandbox's processes
  // of that name ("python3#0"), the same in siblings.
  virtual void before(int pid, const std::string& process, const std::vector<SwapRun>& runs) = 0;
  virtual void after(int pid, const std::vector<std::vector<bool>>& in_swap) = 0;
  virtual void end() = 0;
};

// What release_guest_memory() hands over: on the first release, the
// userfaultfd every missing page now faults to (the caller must serve it
// for as long as the VMM lives), with its features.
struct GuestMemoryRelease {
  UniqueFd uffd;
  uint64_t features = 0;
};

class Sandbox {
 public:
  virtual ~Sandbox() = default;  // does not kill: call kill()
  virtual const std::string& id() const = 0;
  // Host pid of the sandbox's PID 1 (the agent).
  virtual int init_pid() const = 0;
  // Host end of the channel (owned by the Sandbox). The agent has already
  // sent its "ready" control message when create() returns. From then on
  // the Sandbox's own channel Mux reads and writes it: use control() and
  // open_port(); raw I/O on this fd is for tests that play a broken host.
  virtual int channel_fd() const = 0;
  // Freezes every process of the sandbox (cgroup freezer) / thaws them.
  // Idempotent.
  virtual Status pause() = 0;
  virtual Status resume() = 0;
  // Kills every process, waits for them to be gone, removes the cgroups and
  // the sandbox's state directory. Idempotent; safe after the sandbox died.
  virtual Status kill() = 0;
  // False once PID 1 has exited (crash, OOM, or kill()).
  virtual bool alive() = 0;
  virtual Result<Usage> usage() = 0;
  // A byte stream to 127.0.0.1:port inside the sandbox, bridged over the
  // channel (docs/channel.md, "Data streams"): returns the caller's end of
  // a socketpair (SOCK_STREAM, close-on-exec, blocking). Returns at once,
  // before the agent has connected; if the agent refuses (nothing listens
  // on the port) the fd sees EOF. shutdown(SHUT_WR) on it half-closes the
  // stream; close() ends it. kUnavailable once the channel is closed
  // (agent dead, kill()).
  virtual Result<UniqueFd> open_port(uint16_t port) = 0;
  // Sends one control message (a JSON object, docs/channel.md) and returns
  // the agent's reply payload. Replies come in request order; request must
  // expect one (ping, status: not shutdown). kTimeout after timeout (the
  // late reply is then discarded), kUnavailable once the channel is closed.
  virtual Result<std::string> control(std::string request, std::chrono::milliseconds timeout) = 0;

  // Copies the sandbox's writable layer, as it is now, into dest (which
  // must not exist) as a template layer that a later spec.layers can name:
  // the sandbox is frozen meanwhile, and ids are shifted back from its
  // user namespace range (process/layer_copy.h). kUnavailable where the
  // backend cannot (the microVM backend).
  virtual Status export_layer(const std::string& dest) {
    (void)dest;
    return Error(ErrorKind::kUnavailable, "template layers need the process backend");
  }

  // Memory offload (microVM backend; the process backend has no guest RAM
  // and answers kUnavailable). release_guest_memory needs a paused sandbox
  // whose pages the caller has saved: afterwards every page faults to the
  // userfaultfd (docs/vmm.md, "Memory offload").
  virtual Result<GuestMemoryInfo> guest_memory() {
    return Error(ErrorKind::kUnavailable, "memory offload needs the microVM backend");
  }
  virtual Result<GuestMemoryRelease> release_guest_memory() {
    return Error(ErrorKind::kUnavailable, "memory offload needs the microVM backend");
  }

  // Offload to swap (process backend with RuntimeConfig::swap_offload):
  // swap_out pushes a paused sandbox's private memory out to swap
  // (kConflict when cancel was set first: what went out faults back);
  // swap_in, before resume(), reads back what it touched in its previous
  // run and returns the pages asked for. The rest faults back on use.
  // kIdle: the sandbox runs (an idle one, nothing in it using the CPU):
  // its processes fault back whatever they touch, nothing stops.
  enum class SwapOutOf { kPaused, kIdle };
  virtual Result<SwapOutAccount> swap_out(const std::atomic<bool>& cancel, SwapOutOf of) {
    (void)cancel;
    (void)of;
    return Error(ErrorKind::kUnavailable, "offload to swap needs the process backend with a swap device");
  }
  virtual Result<uint64_t> swap_in() {
    return Error(ErrorKind::kUnavailable, "offload to swap needs the process backend with a swap device");
  }
};

class Runtime {
 public:
  virtual ~Runtime() = default;
  virtual std::string name() const = 0;  // "process" or "kvm"
  // Starts a sandbox and waits until its agent reports ready (or fails with
  // a kTimeout error after spec.ready_timeout, leaving nothing behind).
  virtual Result<std::unique_ptr<Sandbox>> create(const SandboxSpec& spec) = 0;
  // Removes what a previous run of sandgate left behind: per-sandbox cgroups
  // (killing any process still in them) and state directories. Called once at
  // start-up, before any create.
  virtual Status cleanup_stale() = 0;
  // Whether sandboxes outlive the sandgate process that made them, for
  // recover() to take back after a restart.
  virtual bool sandboxes_outlive_host() const { return false; }
  // Takes back a sandbox that a previous run of sandgate left running
  // (id from its database): checks that its processes are the ones that
  // run made, re-attaches the channel and returns the sandbox as create()
  // would, in the freezer state it was left in. kNotFound when its
  // processes are gone (what remains of it is then removed); kUnavailable
  // where the backend cannot.
  virtual Result<std::unique_ptr<Sandbox>> recover(const std::string& id) {
    return Error(ErrorKind::kUnavailable, "sandbox " + id + ": this backend's sandboxes do not outlive sandgate");
  }
  // cleanup_stale() for everything but the sandboxes recover() took back.
  virtual Status cleanup_stale_except(const std::set<std::string>& keep) {
    if (!keep.empty()) return Error(ErrorKind::kUnavailable, "this backend cannot keep sandboxes across a restart");
    return cleanup_stale();
  }
  // Readies a template for creates, so that its first one is not slow: the
  // kvm backend builds its root filesystem image and boots it once for the
  // snapshot its clones start from (spec's rootfs, layers, cpu_count and
  // memory_mb; seconds to minutes). The process backend needs nothing.
  virtual Status prepare_template(const SandboxSpec& spec) {
    (void)spec;
    return {};
  }
  // Whether its sandboxes' export_layer() works (the process backend).
  virtual bool exports_layers() const { return false; }
  // Whether its sandboxes' export_layer() writes a whole microVM snapshot
  // (RAM, vCPUs, devices; is_vm_snapshot_layer) instead of files: what is
  // made of it runs on with the sandbox's processes and memory (the kvm
  // backend). Such a layer is the top of a template's layers.
  virtual bool snapshots_memory() const { return false; }
  // Whether create() leaves spec.start running (and ready) in the sandbox.
  virtual bool runs_start_command() const { return false; }
  // Removes what prepare_template made of a template whose top layer (or
  // image root, for one without layers) is `root`, once no sandbox uses it
  // (the template-file collector calls it as it removes root): the bytes
  // freed.
  virtual uint64_t drop_template(const std::string& root) {
    (void)root;
    return 0;
  }
};

}  // namespace sg::runtime
