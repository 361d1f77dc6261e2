// SandboxService: the sandbox lifecycle core, behind the control plane
// (api-e2b), the sandbox traffic proxy and the model gateway (gateway/).
//
// It owns the live runtime handles and keeps SQLite and the runtime in step:
// every state change is a compare-and-set on the row (storage::Store::
// transition/finish) made while holding that sandbox's operation lock, so
// concurrent kill/pause/connect on one sandbox serialise and two sandboxes
// never wait for each other. All methods block (SQLite, runtime) and run on
// worker threads. Errors are sg::Error with the kind the HTTP layer maps.
//
// Lifecycle: each live sandbox holds one State
// (sandbox-runtime/lifecycle/state.h, which has the one table of legal
// transitions); the row's state is written from it (stored_state()):
//   creating -> running            create() after the agent reports ready
//   creating -> failed             the runtime could not start it
//   running  -> paused             pause(), or timeout with on_timeout=pause
//   paused   -> running            connect() (resume), or traffic (autoResume)
//   running  -> wait-paused        wait_pause() (stored: running)
//   wait-paused -> offloading -> offloaded   wait_offload() (stored: running)
//   wait-paused|offloaded -> running         wait_resume()
//   wait-paused|offloaded -> paused          a client's pause during a wait
// An idle offload (idle_offload()) leaves the state running: the sandbox
// runs on with its memory in swap.
//   any live -> killed             kill(), timeout with on_timeout=kill, revoked tenant
//   any live -> lost               its processes died, memory lost, sandgate stopped
//
// Locks: mu_ guards live_ (the map); each sandbox's op_mu serialises its
// lifecycle operations and guards its state and runtime handle; net_mu its
// network policy; samples_mu its metric samples; lost_mu_ the deferred
// lists. Order: op_mu before mu_, lost_mu_, net_mu or samples_mu; never two
// sandboxes' op_mu at once. Hooks (before_traffic, gone, network_changed)
// are called without op_mu held.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "base/http/message.h"
#include "base/thread_annotations.h"
#include "sandbox-runtime/lifecycle/guest_memory.h"
#include "sandbox-runtime/lifecycle/params.h"
#include "sandbox-runtime/lifecycle/state.h"
#include "sandbox-runtime/lifecycle/warm_pool.h"
#include "sandbox-runtime/network/egress_policies.h"
#include "sandbox-runtime/runtime.h"
#include "storage/store.h"
#include "wait-engine/coordinator/coordinator.h"

namespace sg::lifecycle {

struct MetricSample {
  int64_t unix_s = 0;
  uint64_t cpu_usage_ns = 0;
  double cpu_used_pct = 0;
  runtime::Usage usage;
  uint64_t pool_bytes = 0;  // the memory engine's RAM for this sandbox (offloaded pages)
};

struct ServiceConfig {
  int64_t max_timeout_s = 24 * 3600;
  std::chrono::milliseconds ready_timeout{15000};
  // A built template's ready command must succeed within this of its start
  // command (docs/templates.md).
  std::chrono::milliseconds start_ready_timeout{60000};
  uint32_t max_pids = 1024;
  // Set OPENAI_BASE_URL / ANTHROPIC_BASE_URL (and placeholder API keys the
  // SDKs insist on) in every sandbox's default environment, pointing at
  // the in-sandbox model proxy address. Values from envVars win.
  bool model_proxy_env = true;
  // Network egress through the gateway's egress proxy (docs/egress.md):
  // off, every sandbox has none and a create asking for it (a non-empty
  // network.allowOut) is refused; on, each live sandbox's policy is kept
  // in egress_policies (which the proxy reads and listens to) and
  // HTTP(S)_PROXY in its environment point at the proxy.
  bool egress = false;
  network::EgressPolicies* egress_policies = nullptr;  // required with egress; outlives the service
  // With egress: HTTP(S)_PROXY in sandboxes' environment. Off where each
  // sandbox has a network of its own (the policy is enforced on the host's
  // side of its link: network/host_network.h), so nothing needs a proxy.
  bool egress_proxy_env = true;
  // Memory offload (with a memory engine): at most this many offloads at
  // once, the CPU budget of the encoders.
  size_t offload_concurrency = 1;
  // Offload to swap (process backend, runtime::Sandbox::swap_out): with no
  // memory engine, a wait-paused sandbox's memory goes out to swap and
  // what it touched comes back before the thaw. swap_device_metrics adds
  // the device's own lines to render_swap_metrics (may be empty).
  bool swap_offload = false;
  std::function<void(std::string&)> swap_device_metrics;
  // Called after each offload to swap, with no lock held (the device's
  // upkeep: zram compaction). May be empty.
  std::function<void()> swap_after_offload;
  // Idle offload (with swap_offload): a running sandbox with no traffic
  // and under 1 % of a CPU for this long goes out to swap as it runs (no
  // pause: what it touches faults back); its next traffic reads back what
  // it touched before. 0: off. Gated by waits.offload_wanted, as a wait
  // offload is.
  std::chrono::milliseconds idle_offload_after{0};
  // Model-wait pauses: the service owns the wait coordinator
  // (wait-engine/coordinator), whose actions are its own wait_pause,
  // wait_resume, wait_idle, wait_offload and kill_lost. Off unless enabled.
  struct Waits {
    bool enabled = false;
    wait::CoordinatorConfig coordinator;  // offload needs a memory store too
    // Whether offloading is wanted now (host memory pressure, "auto");
    // empty: always.
    std::function<bool()> offload_wanted;
  } waits;
  // Sandboxes of hot templates with a start command started ahead of their
  // creates (warm_pool.h); per_key 0: none.
  WarmPoolConfig warm_pool{0};
  // Snapshots and forks (process backend): where their layers go (the
  // template builds' layers directory); "": they are refused. A tenant's
  // template files, snapshots' included, stay within template_max_bytes
  // (0: no limit).
  std::string snapshot_dir;
  int64_t template_max_bytes = 0;
  // Pauses to disk of microVMs keep their RAM packed against the memory
  // the sandbox was restored from (guest_memory.h); null: kept as the VMM
  // wrote it. Must outlive the service.
  PauseMemoryPacker* pause_packer = nullptr;
  // Wait transitions as event rows (kind "wait"), for a batched writer
  // (storage/batch_writer.h); empty: not recorded. Called on the
  // coordinator's threads: must not block.
  std::function<void(storage::EventRow)> record_event;
  // Cluster mode: reserves a new sandbox against its tenant's limits
  // across every node (gateway/cluster.h), before the local row goes in;
  // kQuota when over them. Empty: the local quota only.
  std::function<Status(const storage::TenantRow& tenant, const storage::SandboxRow& row)> reserve;
  // Cluster mode: before a create resolves its template, makes this
  // node's copy of a template another node built current (pulls it).
  std::function<Status(const storage::TenantRow& tenant, const std::string& ref)> ensure_template;
};

// The in-sandbox model proxy address (the agent forwards it over the channel).
std::vector<std::pair<std::string, std::string>> model_proxy_env();
// The in-sandbox egress proxy address, as the proxy variables tools read.
std::vector<std::pair<std::string, std::string>> egress_proxy_env();

class SandboxService {
 public:
  using Clock = std::function<int64_t()>;  // unix seconds
  // memory: the offload engine (microVMs; null: no offload), which must
  // outlive the service. The service polls it for sandboxes whose memory
  // was lost (tick()), so the engine needs no hook back into it.
  SandboxService(storage::Store& store, runtime::Runtime& rt, ServiceConfig cfg, Clock clock,
                 GuestMemoryStore* memory = nullptr);
  ~SandboxService();

  // Start-up recovery: the sandboxes of rows a previous run left running or
  // paused are taken back (Runtime::recover, where they outlive sandgate)
  // and served again in that state; rows left creating, and those whose
  // sandbox cannot be taken back, are marked lost with the reason; then the
  // runtime removes everything else the previous run left.
  Status recover();

  Result<storage::SandboxRow> create(const storage::TenantRow& tenant, const CreateParams& p);
  // The network configuration of a live sandbox as the client last gave
  // it (create or update); nullopt when it is gone.
  std::optional<NetworkParams> network(const std::string& id);
  // PUT /sandboxes/{id}/network: the tenant's running or paused sandbox
  // gets n as its whole egress configuration (kNotFound otherwise, also
  // for other tenants' ids; kInvalid for a non-empty allowOut on a server
  // without egress, changing nothing). Connections opened later follow it;
  // the egress proxy, told by egress_policies, closes open ones it refuses.
  Status update_network(const std::string& tenant_id, const std::string& id, const NetworkParams& n);
  // A running or paused sandbox of the tenant; kNotFound otherwise (also
  // for other tenants' ids).
  Result<storage::SandboxRow> get(const std::string& tenant_id, const std::string& id);
  // The tenant's sandboxes; a template filter may name the template by id
  // or by name, as in create.
  Result<std::vector<storage::SandboxRow>> list(storage::SandboxQuery q);
  Status kill(const std::string& tenant_id, const std::string& id);
  // kConflict when already paused. keep_memory false (E2B's keepMemory,
  // "memory": false): a filesystem-only pause where the runtime can copy
  // the sandbox's files out (the process backend): the files are kept,
  // the processes end and the memory is freed; connect() starts it again
  // from them (a fresh start of its template's start command), also after
  // a restart of sandgate. The microVM backend keeps the memory instead.
  Status pause(const std::string& tenant_id, const std::string& id, bool keep_memory = true);
  // Resumes a paused sandbox (resumed=true) and extends its timeout to at
  // least now + timeout_s.
  struct Connected {
    storage::SandboxRow row;
    bool resumed = false;
  };
  Result<Connected> connect(const std::string& tenant_id, const std::string& id, int64_t timeout_s);
  Status set_timeout(const std::string& tenant_id, const std::string& id, int64_t timeout_s);
  // POST /sandboxes/{id}/snapshots: the sandbox's files as they are now
  // (its writable layer over its template's) become a new template of the
  // tenant's, named name (its id when ""); the sandbox runs on. On the
  // process backend memory and processes are not kept (a sandbox created
  // from it starts its template's start command afresh); on the kvm
  // backend the layer is a microVM snapshot, memory and processes
  // included. kNotFound for a sandbox that is not the tenant's running or
  // paused one, kQuota past the tenant's template storage; a failed copy
  // leaves nothing.
  // with_memory: the caller asked for the memory (400 where the runtime
  // keeps files only).
  Result<storage::SnapshotRow> snapshot(const std::string& tenant_id, const std::string& id, const std::string& name,
                                        bool with_memory = false);
  // POST /sandboxes/{id}/fork: count sandboxes from one snapshot of it
  // (its files; see snapshot()), each living timeout_s and with the
  // parent's environment variables, metadata and network. Each fork
  // succeeds or fails on its own (the tenant's quota, the runtime): one
  // result per fork. The snapshot is not listed and goes once the last
  // fork ends.
  Result<std::vector<Result<storage::SandboxRow>>> fork(const storage::TenantRow& tenant, const std::string& id,
                                                        int64_t count, int64_t timeout_s);
  // A connected stream to 127.0.0.1:port inside a running sandbox, for
  // the envd and port proxy. Not tenant-scoped: whoever knows the id may try
  // (envd checks the access token itself, as E2B's proxy leaves it to envd).
  // head: the request's headers, checked first (traffic_auth.h): envd
  // requests other than /health need the access token (or a signed /files
  // URL), and user ports the traffic token where the sandbox has one
  // (kUnauthorized otherwise, touching nothing). A paused sandbox is then
  // resumed first, transparently (its timeout restarts), unless its
  // autoResume is off or, where the runtime can tell, nothing listens on a
  // user port (kConflict: the proxy's 502, and it stays paused).
  // kNotFound for unknown or dead sandboxes.
  Result<UniqueFd> open_port(const std::string& id, uint16_t port, const http::HttpRequest& head);

  // Samples in [start, end] (unix seconds) plus, when the sandbox runs, a
  // reading taken now.
  Result<std::vector<MetricSample>> metrics(const std::string& tenant_id, const std::string& id,
                                            std::optional<int64_t> start, std::optional<int64_t> end);

  // Periodic sweep: enforce end_at, notice sandboxes whose processes died,
  // record metric samples. Called from a worker thread every second.
  void tick();
  // The stop: kills every live sandbox, or, where the runtime's sandboxes
  // outlive sandgate, lets go of them running for the next start's
  // recover(); the warm pool's sandboxes are killed either way.
  void shutdown();

  size_t live_count();
  // The lifecycle state of a live sandbox; kNotFound when it is not live.
  // Waits for an operation in progress on it (tests, diagnostics).
  Result<State> state(const std::string& id);

  // The wait coordinator (null when waits are off), for the model proxy's
  // tickets. Before traffic reaches a sandbox (ports, envd, connect,
  // pause, kill) the service has it run the sandbox first; it forgets a
  // sandbox that is killed or lost. Both without a sandbox lock held.
  wait::WaitCoordinator* waits() { return waits_.get(); }
  // Stops the coordinator's threads; pending deliveries are released. At
  // shutdown, after the model proxy and the sandboxes.
  void stop_waits();
  // Freeze / thaw for a model wait. They leave the stored state alone (a
  // wait pause is invisible to clients) and never undo a client's pause.
  Status wait_pause(const std::string& id);
  Status wait_resume(const std::string& id);
  // The agent's idle evidence: true when no process in the sandbox is
  // runnable. kNotFound for unknown or dead sandboxes.
  Result<bool> wait_idle(const std::string& id, std::chrono::milliseconds timeout);
  // Kills a live sandbox the gateway cannot use any more (a resume after a
  // wait pause failed); its state becomes lost with the reason.
  Status kill_lost(const std::string& id, const std::string& reason);

  // Memory offload (the GuestMemoryStore): wait_offload moves a wait-paused
  // microVM's RAM into the pool, or a process sandbox's memory out to swap
  // (kConflict when cancel was set or the sandbox is not wait-paused;
  // kUnavailable with offload off; kQuota when the CPU budget,
  // max_concurrent offloads at once, is spent), and wait_resume installs
  // the predicted pages (reads them back) before the vCPUs (processes) run.
  Status wait_offload(const std::string& id, const std::atomic<bool>& cancel);
  // M(t) = resident memory + pool bytes, summed over live sandboxes, from
  // the readings tick() takes every second.
  uint64_t memory_in_use();
  // The tenant of a live sandbox, from memory; kNotFound otherwise.
  Result<std::string> live_tenant(const std::string& id);
  // The warm pool's counts (all zero without one).
  WarmPool::Stats warm_pool_stats();
  // Offload to swap: pages out and back, in total and per live sandbox,
  // and the device's stored bytes (Prometheus text; nothing without it).
  void render_swap_metrics(std::string& out);

 private:
  // wait_offload's work, under the sandbox's op_mu.
  Status offload_one(const std::string& id, const std::atomic<bool>& cancel);
  struct Live {
    Mutex op_mu;  // serialises lifecycle operations on this sandbox
    std::unique_ptr<runtime::Sandbox> sb GUARDED_BY(op_mu);  // null once terminal
    // The one state of this sandbox; the row's state is written from it
    // (every transition happens under op_mu), so traffic to a running
    // sandbox costs no SQLite.
    State state GUARDED_BY(op_mu) = State::kCreating;
    std::string tenant_id;
    std::string template_id;
    int64_t started_at = 0;
    std::string envd_token;
    std::optional<std::string> traffic_token;  // allowPublicTraffic false
    bool auto_resume = true;
    int64_t init_pid = 0;  // the process backend's agent, as the host sees it
    std::atomic<uint64_t> mem_now{0};  // M(t): the last one-second reading
    // Offload to swap: pages the last swap-out left in swap, and pages
    // read back before thaws, in all.
    std::atomic<uint64_t> swap_out_pages{0};
    std::atomic<uint64_t> swap_in_pages{0};
    uint32_t cpu_count = 1;
    // Idle offload: when traffic last came (before_traffic), whether its
    // memory went out while idle (read back at the next traffic), the
    // cancel of a page-out in progress; the idle window as the liveness
    // sweep measures it.
    std::atomic<uint64_t> traffic_ns{0};
    std::atomic<bool> idle_out{false};
    std::atomic<bool> idle_cancel{false};
    uint64_t idle_since_ns GUARDED_BY(op_mu) = 0;
    uint64_t idle_cpu_ns GUARDED_BY(op_mu) = 0;
    bool idle_queued GUARDED_BY(op_mu) = false;
    Mutex net_mu;
    NetworkParams network GUARDED_BY(net_mu);  // the egress policy, from create or an update
    Mutex samples_mu;
    std::deque<MetricSample> samples GUARDED_BY(samples_mu);
    uint64_t last_cpu_ns GUARDED_BY(samples_mu) = 0;
    uint64_t last_mono_ns GUARDED_BY(samples_mu) = 0;
  };

  std::shared_ptr<Live> find_live(const std::string& id);
  // A snapshot's template row and layer, recorded (snapshot(), fork()).
  Result<std::pair<storage::SnapshotRow, storage::TemplateRow>> make_snapshot(const std::string& tenant_id,
                                                                              const std::string& id,
                                                                              const std::string& name,
                                                                              const char* kind);
  // What the sandbox's files are: its filesystem-only pause's, or its template's (build's).
  Result<storage::TemplateRow> files_of(const storage::SandboxRow& r);
  Result<std::pair<storage::SnapshotRow, storage::TemplateRow>> snapshot_locked(Live& live,
                                                                                const storage::SandboxRow& r,
                                                                                const std::string& name,
                                                                                const char* kind)
      REQUIRES(live.op_mu);
  // A filesystem-only pause, and the start from its files.
  bool pauses_to_disk(bool keep_memory) const;
  Status persist_locked(Live& live, const storage::SandboxRow& r) REQUIRES(live.op_mu);
  Status restore_locked(Live& live, const storage::SandboxRow& r) REQUIRES(live.op_mu);
  // A sandbox recover() took back, live again in its row's state.
  Status adopt(const storage::SandboxRow& r, std::unique_ptr<runtime::Sandbox> sb);
  void adopt_persisted(const storage::SandboxRow& r);
  static std::shared_ptr<Live> live_of(const storage::SandboxRow& r);
  struct Found {
    storage::SandboxRow row;
    std::shared_ptr<Live> live;
  };
  // The tenant's running or paused sandbox with its handle; kNotFound
  // otherwise. Callers lock live->op_mu and re-check live->sb.
  Result<Found> lookup(const std::string& tenant_id, const std::string& id);
  Status check_timeout(int64_t timeout_s) const;
  // Kills the runtime sandbox (twice if need be); one whose kill still
  // fails is parked in unkilled_ for tick() to kill, never dropped.
  // REQUIRES(live.op_mu).
  Status end_runtime(Live& live, const std::string& id) REQUIRES(live.op_mu);
  // Ends the sandbox (to: killed or lost). REQUIRES(live.op_mu).
  Status kill_locked(Live& live, const std::string& id, const std::string& tenant_id, State to,
                     const std::string& reason) REQUIRES(live.op_mu);
  // Moves the sandbox to `to`: asserts the move is in the lifecycle table
  // and writes the row's state where the stored state changes (a compare-
  // and-set from the stored state of its current one: false when the row
  // was not in it). The in-memory state changes only when it returns true.
  // REQUIRES(live.op_mu).
  Result<bool> move(Live& live, const std::string& id, State to) REQUIRES(live.op_mu);
  // The in-memory half of move(), for a row already written. REQUIRES(live.op_mu).
  static void enter(Live& live, State to) REQUIRES(live.op_mu);
  storage::SandboxRow new_row(const storage::TenantRow& tenant, const storage::TemplateRow& t, const CreateParams& p);
  Status run_start_command(runtime::Sandbox& sb, const std::string& token, const runtime::SandboxSpec& spec,
                           const storage::TemplateRow& t);
  // The warm pool's side: a pooled sandbox made as a create would make it
  // (no envVars, no metadata: those come when it is taken); whether the
  // tenant's quota has room for one more beside what the pool holds for it;
  // and handing a taken one to its row (the agent's "configure": the row's
  // id and envd token, and spec's environment for every later process).
  Result<WarmPool::Entry> make_pooled(const WarmPool::Recipe& r);
  bool pool_admits(const WarmPool::Recipe& r, size_t pooled_for_tenant);
  Status hand_over(runtime::Sandbox& sb, const storage::SandboxRow& row, const runtime::SandboxSpec& spec);
  runtime::SandboxSpec new_spec(const storage::SandboxRow& row, const storage::TemplateRow& t,
                                const CreateParams& p) const;
  // A wait-paused sandbox runs before traffic reaches it; a running
  // offload stops within a page.
  void before_traffic(const std::string& id);
  wait::CoordinatorHooks wait_actions();
  // The parts of tick(), in its order.
  void sweep_timeouts(int64_t now);
  void retry_deferred();
  void sweep_revoked(const std::vector<std::pair<std::string, std::shared_ptr<Live>>>& all);
  void sweep_liveness(const std::vector<std::pair<std::string, std::shared_ptr<Live>>>& all, int64_t now);
  // Idle offload: the liveness sweep measures each running sandbox's idle
  // window and queues it once the window is long enough; one thread pages
  // the queued out (a page-out takes its op_mu for up to seconds).
  void watch_idle(const std::string& id, Live& live, uint64_t cpu_ns) REQUIRES(live.op_mu);
  void idle_loop();
  Status idle_offload(const std::string& id);
  void stop_idle();
  // Reads back from swap what the sandbox touched in its last run (the
  // process backend's swap_in), counted; a failure is logged (what was
  // not read back faults back on use).
  void swap_in(const std::string& id, Live& live, const char* when) REQUIRES(live.op_mu);
  bool idle_enabled() const { return cfg_.swap_offload && cfg_.idle_offload_after.count() > 0; }
  // A metric sample from a usage reading (cpu percent since the last one).
  MetricSample sample(Live& live, const runtime::Usage& u, uint64_t pool_bytes) EXCLUDES(live.samples_mu);
  void event(const std::string& tenant_id, const std::string& id, const std::string& kind,
             const std::string& detail);

  storage::Store& store_;
  runtime::Runtime& rt_;
  const ServiceConfig cfg_;
  Clock clock_;
  Mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<Live>> live_ GUARDED_BY(mu_);
  int64_t last_sample_s_ = 0;                                     // touched by tick() only
  GuestMemoryStore* const memory_;  // may be null
  const size_t offload_slots_;
  std::atomic<size_t> offloads_running_{0};
  // Offload to swap, totals over every sandbox.
  std::atomic<uint64_t> swap_outs_{0};
  std::atomic<uint64_t> swap_out_pages_{0};
  std::atomic<uint64_t> swap_in_pages_{0};
  std::atomic<uint64_t> swap_unused_pages_{0};
  std::atomic<uint64_t> swap_out_ns_{0};
  std::atomic<uint64_t> swap_in_ns_{0};
  std::atomic<uint64_t> idle_outs_{0};
  std::mutex idle_mu_;
  std::condition_variable idle_cv_;
  std::deque<std::string> idle_queue_;  // GUARDED_BY(idle_mu_)
  bool idle_stopping_ = false;          // GUARDED_BY(idle_mu_)
  std::thread idle_thread_;             // runs idle_loop() with idle offload on
  Mutex lost_mu_;
  // Sandboxes killed while their end could not be written (a full disk);
  // tick() writes it.
  struct Unrecorded {
    std::string id, tenant_id, state, reason;
    int64_t at = 0;
  };
  std::vector<Unrecorded> unrecorded_ GUARDED_BY(lost_mu_);
  // Ended sandboxes whose runtime kill failed; tick() kills them again.
  std::vector<std::pair<std::string, std::unique_ptr<runtime::Sandbox>>> unkilled_ GUARDED_BY(lost_mu_);
  // Creates between their look into the warm pool and their row's insert,
  // per tenant: the pool counts them as live (pool_admits), or it could
  // start a sandbox for room a create is about to take.
  std::map<std::string, int64_t> creating_ GUARDED_BY(lost_mu_);
  void count_creating(const std::string& tenant_id, int64_t delta) EXCLUDES(lost_mu_);
  // Built once everything its thread calls into exists, stopped (in
  // shutdown() or its destruction) before any of it goes.
  std::unique_ptr<WarmPool> pool_;
  // Last: built once everything its threads call into exists, and stopped
  // (destroyed) before any of it goes.
  std::unique_ptr<wait::WaitCoordinator> waits_;
};

// A new sandbox id: 20 characters of [a-z0-9], never '-' or '.'.
std::string new_sandbox_id();

}  // namespace sg::lifecycle
