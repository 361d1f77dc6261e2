// SandboxService implementation.
#include "sandbox-runtime/lifecycle/sandbox_service.h"
#include "wait-engine/metrics/histogram.h"

#include <sys/random.h>
#include <sys/stat.h>

#include <cassert>
#include <set>

#include <nlohmann/json.hpp>
#include <thread>

#include "base/http/routing.h"
#include "base/log.h"
#include "base/sys.h"
#include "sandbox-runtime/channel/control_message.h"
#include "sandbox-runtime/host/envd_client.h"
#include "sandbox-runtime/channel/services.h"
#include "sandbox-runtime/lifecycle/traffic_auth.h"

namespace sg::lifecycle {

using storage::SandboxRow;

namespace {

// One of the offloads' CPU slots (ServiceConfig::offload_concurrency),
// held while it lives; held() is false when every slot was in use.
class OffloadSlot {
 public:
  OffloadSlot(std::atomic<size_t>& running, size_t slots)
      : running_(running), held_(running.fetch_add(1) < slots) {
    if (!held_) running_.fetch_sub(1);
  }
  ~OffloadSlot() {
    if (held_) running_.fetch_sub(1);
  }
  OffloadSlot(const OffloadSlot&) = delete;
  OffloadSlot& operator=(const OffloadSlot&) = delete;
  bool held() const { return held_; }

 private:
  std::atomic<size_t>& running_;
  const bool held_;
};

Error no_offload_slot() { return Error(ErrorKind::kQuota, "memory offload: CPU budget in use by other offloads"); }

}  // namespace

std::string new_sandbox_id() {
  static const char kAlphabet[] = "abcdefghijklmnopqrstuvwxyz0123456789";
  unsigned char raw[20];
  size_t got = 0;
  while (got < sizeof raw) {
    ssize_t n = ::getrandom(raw + got, sizeof raw - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  std::string id;
  // 256 % 36 != 0: the bias (at most 1/256 per character) is irrelevant for ids.
  for (unsigned char c : raw) id += kAlphabet[c % 36];
  return id;
}

SandboxService::SandboxService(storage::Store& store, runtime::Runtime& rt, ServiceConfig cfg, Clock clock,
                               GuestMemoryStore* memory)
    : store_(store),
      rt_(rt),
      cfg_(cfg),
      clock_(std::move(clock)),
      memory_(memory),
      offload_slots_(std::max<size_t>(1, cfg.offload_concurrency)) {
  if (cfg_.warm_pool.per_key > 0)
    pool_ = std::make_unique<WarmPool>(
        cfg_.warm_pool, [this](const WarmPool::Recipe& r) { return make_pooled(r); },
        [this](const WarmPool::Recipe& r, size_t n) { return pool_admits(r, n); }, clock_,
        [this](WarmPool::Entry e) {
          MutexLock g(lost_mu_);
          unkilled_.emplace_back(e.id, std::move(e.sb));
        });
  if (cfg_.waits.enabled)
    waits_ = std::make_unique<wait::WaitCoordinator>(cfg_.waits.coordinator, wait_actions(),
                                                     [] { return sys::monotonic_ns(); });
  if (idle_enabled()) idle_thread_ = std::thread([this] { idle_loop(); });
}

// The coordinator acts through this service. Its action threads call
// these with no lock of the service held.
wait::CoordinatorHooks SandboxService::wait_actions() {
  wait::CoordinatorHooks h;
  h.pause = [this](const std::string& id) { return wait_pause(id); };
  h.resume = [this](const std::string& id) { return wait_resume(id); };
  h.idle = [this](const std::string& id) { return wait_idle(id, std::chrono::milliseconds(500)); };
  h.transition = [this](const std::string& id, const wait::Transition& t) {
    if (!cfg_.record_event) return;
    storage::EventRow e;
    e.at = clock_();
    e.sandbox_id = id;
    if (Result<std::string> tenant = live_tenant(id)) e.tenant_id = *tenant;
    e.kind = "wait";
    nlohmann::json d = {{"from", wait::state_name(t.from)},
                        {"to", wait::state_name(t.to)},
                        {"reason", t.reason},
                        {"mono_ns", t.at}};
    e.detail = d.dump();
    cfg_.record_event(std::move(e));
  };
  h.kill = [this](const std::string& id) {
    Status s = kill_lost(id, "could not be resumed after a model-wait pause");
    if (!s && s.error().kind() != ErrorKind::kNotFound)
      LOG_ERROR("sandbox " << id << ": kill after a failed resume: " << s.error().message());
  };
  if (memory_ || cfg_.swap_offload) h.offload = [this](const std::string& id, const std::atomic<bool>& cancel) {
    return wait_offload(id, cancel);
  };
  h.offload_wanted = cfg_.waits.offload_wanted;
  return h;
}

void SandboxService::before_traffic(const std::string& id) {
  if (idle_enabled()) {
    if (std::shared_ptr<Live> live = find_live(id)) {
      live->traffic_ns.store(sys::monotonic_ns());
      live->idle_cancel.store(true);  // an idle page-out in progress stops within a piece
      if (live->idle_out.load()) {
        // Out while idle: what it touched in its last run back first, as
        // before a wait offload's thaw; the rest faults back on use.
        MutexLock g(live->op_mu);
        if (live->sb && live->idle_out.exchange(false)) swap_in(id, *live, "after an idle offload");
      }
    }
  }
  if (!waits_) return;
  if (Status s = waits_->ensure_running(id, std::chrono::milliseconds(10000)); !s)
    LOG_WARN("sandbox " << id << ": " << s.error().message());
}

void SandboxService::swap_in(const std::string& id, Live& live, const char* when) {
  uint64_t t0 = sys::monotonic_ns();
  Result<uint64_t> n = live.sb->swap_in();
  swap_in_ns_ += sys::monotonic_ns() - t0;
  if (!n) {
    LOG_WARN("sandbox " << id << ": swap-in " << when << ": " << n.error().message());
    return;
  }
  live.swap_in_pages += *n;
  swap_in_pages_ += *n;
}

void SandboxService::stop_waits() { waits_.reset(); }

SandboxService::~SandboxService() { stop_idle(); }

void SandboxService::stop_idle() {
  {
    std::lock_guard<std::mutex> l(idle_mu_);
    idle_stopping_ = true;
  }
  idle_cv_.notify_all();
  if (idle_thread_.joinable()) idle_thread_.join();
}

// Called by the liveness sweep each second for each running sandbox, with
// its CPU time so far. The window restarts at traffic, at a state other
// than running, and when the sandbox used over 1 % of one CPU since it
// began (its agent's own upkeep stays under that).
void SandboxService::watch_idle(const std::string& id, Live& live, uint64_t cpu_ns) {
  uint64_t now = sys::monotonic_ns();
  bool busy = live.idle_since_ns == 0 || live.state != State::kRunning ||
              live.traffic_ns.load() >= live.idle_since_ns || cpu_ns < live.idle_cpu_ns ||
              cpu_ns - live.idle_cpu_ns > (now - live.idle_since_ns) / 100;
  if (busy) {
    // Running again after an idle offload, it faults back what it uses; it
    // may go out again after the next idle window.
    if (live.idle_since_ns != 0 && live.state == State::kRunning) live.idle_out.store(false);
    live.idle_since_ns = now;
    live.idle_cpu_ns = cpu_ns;
    return;
  }
  if (live.idle_out.load() || live.idle_queued ||
      now - live.idle_since_ns < static_cast<uint64_t>(cfg_.idle_offload_after.count()) * 1000000ull)
    return;
  live.idle_queued = true;
  {
    std::lock_guard<std::mutex> l(idle_mu_);
    idle_queue_.push_back(id);
  }
  idle_cv_.notify_one();
}

void SandboxService::idle_loop() {
  for (;;) {
    std::string id;
    {
      std::unique_lock<std::mutex> l(idle_mu_);
      idle_cv_.wait(l, [this] { return idle_stopping_ || !idle_queue_.empty(); });
      if (idle_stopping_) return;
      id = std::move(idle_queue_.front());
      idle_queue_.pop_front();
    }
    Status s = idle_offload(id);
    if (!s && s.error().kind() != ErrorKind::kConflict && s.error().kind() != ErrorKind::kNotFound &&
        s.error().kind() != ErrorKind::kQuota)
      LOG_WARN("sandbox " << id << ": idle offload: " << s.error().message());
    if (s && cfg_.swap_after_offload) cfg_.swap_after_offload();
  }
}

Status SandboxService::idle_offload(const std::string& id) {
  std::shared_ptr<Live> live = find_live(id);
  if (!live) return not_found_error("sandbox \"" + id + "\" not found");
  // Whatever happens here, the sweep may queue it again.
  struct Unqueue {
    Live& l;
    ~Unqueue() {
      MutexLock g(l.op_mu);
      l.idle_queued = false;
    }
  } unqueue{*live};
  if (cfg_.waits.offload_wanted && !cfg_.waits.offload_wanted()) return Error(ErrorKind::kQuota, "no memory pressure");
  OffloadSlot slot(offloads_running_, offload_slots_);
  if (!slot.held()) return no_offload_slot();
  MutexLock g(live->op_mu);
  if (!live->sb) return not_found_error("sandbox \"" + id + "\" not found");
  // Traffic, a wait or a pause since it was queued: no longer idle. The
  // cancel is cleared before traffic is looked at: traffic that comes
  // after the look sets it again (before_traffic: the time, then the cancel).
  live->idle_cancel.store(false);
  if (live->state != State::kRunning || live->idle_out.load() || live->traffic_ns.load() >= live->idle_since_ns)
    return Error(ErrorKind::kConflict, "sandbox " + id + " is no longer idle");
  uint64_t t0 = sys::monotonic_ns();
  Result<runtime::SwapOutAccount> out = live->sb->swap_out(live->idle_cancel, runtime::Sandbox::SwapOutOf::kIdle);
  swap_out_ns_ += sys::monotonic_ns() - t0;
  if (!out) return out.error().with_context("idle offload of sandbox " + id);
  live->idle_out.store(true);
  ++idle_outs_;
  live->swap_out_pages = out->out_pages;
  swap_out_pages_ += out->out_pages;
  swap_unused_pages_ += out->unused_pages;
  LOG_INFO("sandbox " << id << ": idle " << (t0 - live->idle_since_ns) / 1000000 << " ms; " << out->out_pages << " of "
                      << out->resident_pages << " resident pages out to swap in " << (sys::monotonic_ns() - t0) / 1000000
                      << " ms; " << out->hot_pages << " to read back at its next traffic");
  return Status::Ok();
}

void SandboxService::event(const std::string& tenant_id, const std::string& id, const std::string& kind,
                           const std::string& detail) {
  nlohmann::json d = {{"message", detail}};
  if (Status s = store_.add_event(tenant_id, id, kind, d.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace),
                                  clock_());
      !s)
    LOG_WARN("record event " << kind << " for sandbox " << id << ": " << s.error().message());
}

Status SandboxService::recover() {
  Result<std::vector<SandboxRow>> rows = store_.list_live();
  if (!rows) return rows.error();
  std::set<std::string> kept;
  for (const SandboxRow& r : *rows) {
    std::string reason;
    if (r.state == storage::kStateCreating) {
      reason = "sandgate restarted while the sandbox was being created";
    } else if (r.backend != rt_.name()) {
      reason = "sandgate restarted with the " + rt_.name() + " backend; the sandbox ran on " + r.backend;
    } else if (Result<std::optional<storage::TemplateRow>> files =
                   r.state == storage::kStatePaused ? store_.paused_files(r.id) : std::optional<storage::TemplateRow>();
               files && *files && !rt_.sandboxes_outlive_host()) {
      adopt_persisted(r);  // on disk: it outlives any sandgate
      continue;
    } else if (!rt_.sandboxes_outlive_host()) {
      reason = "sandgate restarted: " + rt_.name() + " sandboxes do not outlive it here";
    } else if (Result<std::unique_ptr<runtime::Sandbox>> sb = rt_.recover(r.id); !sb) {
      // One paused without its memory has no processes: its files are it.
      Result<std::optional<storage::TemplateRow>> files =
          r.state == storage::kStatePaused ? store_.paused_files(r.id) : std::optional<storage::TemplateRow>();
      if (files && *files) {
        adopt_persisted(r);
        continue;
      }
      reason = "sandgate restarted and could not take the sandbox back: " + sb.error().message();
    } else if (Status a = adopt(r, std::move(*sb)); !a) {
      reason = "sandgate restarted and could not take the sandbox back: " + a.error().message();
    } else {
      kept.insert(r.id);
      continue;
    }
    Result<bool> done = store_.finish(r.id, storage::kStateLost, reason, clock_());
    if (!done) return done.error();
    event(r.tenant_id, r.id, "lost", reason);
    LOG_INFO("sandbox " << r.id << " (tenant " << r.tenant_id << ") marked lost: " << reason);
  }
  if (!kept.empty()) LOG_INFO(kept.size() << " sandboxes taken back from the previous run");
  return rt_.cleanup_stale_except(kept);
}

// The egress lists as stored with the row (and back).
static std::string network_json(const NetworkParams& n) {
  return nlohmann::json{{"allowOut", n.allow_out}, {"denyOut", n.deny_out}}.dump();
}

static Result<NetworkParams> network_of(const SandboxRow& r) {
  NetworkParams n;
  n.allow_internet = r.allow_internet;
  nlohmann::json j = nlohmann::json::parse(r.network, nullptr, false);
  if (!j.is_object()) return internal_error("its stored network configuration is damaged");
  std::vector<std::string>* lists[2] = {&n.allow_out, &n.deny_out};
  const char* names[2] = {"allowOut", "denyOut"};
  for (int k = 0; k < 2; ++k) {
    auto l = j.find(names[k]);
    if (l == j.end()) continue;
    if (!l->is_array()) return internal_error("its stored network configuration is damaged");
    for (const nlohmann::json& e : *l)
      if (e.is_string()) lists[k]->push_back(e.get<std::string>());
  }
  Result<network::EgressPolicy> pol = network::parse_egress_policy(n.allow_out, n.deny_out, n.allow_internet);
  if (!pol) return pol.error().with_context("its stored network configuration");
  n.egress = std::move(*pol);
  n.asks_egress = !n.allow_out.empty();
  return n;
}

// The fields of a live sandbox its row holds (a create's, or a sandbox
// taken back after a restart).
std::shared_ptr<SandboxService::Live> SandboxService::live_of(const SandboxRow& r) {
  auto live = std::make_shared<Live>();
  live->tenant_id = r.tenant_id;
  live->template_id = r.template_id;
  live->started_at = r.started_at;
  live->cpu_count = static_cast<uint32_t>(std::max<int64_t>(1, r.cpu_count));
  live->envd_token = r.envd_token;
  live->traffic_token = r.traffic_token;
  live->auto_resume = r.auto_resume;
  return live;
}

// A sandbox paused without its memory, after a restart: live again with
// no runtime sandbox; connect() starts it from its files.
void SandboxService::adopt_persisted(const SandboxRow& r) {
  std::shared_ptr<Live> live = live_of(r);
  Result<NetworkParams> net = network_of(r);
  {
    MutexLock n(live->net_mu);
    if (net) live->network = *net;
  }
  {
    MutexLock g(live->op_mu);
    live->state = State::kPersisted;  // as its row and files say
  }
  {
    MutexLock g(mu_);
    live_[r.id] = live;
  }
  event(r.tenant_id, r.id, "recovered", "paused with its files only, after a restart of sandgate");
}

// A sandbox recover() took back becomes live again in its stored state:
// paused stays frozen; running runs (one wait-paused when sandgate went
// is thawed: the model request it waited for went with that sandgate).
Status SandboxService::adopt(const SandboxRow& r, std::unique_ptr<runtime::Sandbox> sb) {
  // Its processes are here: the files of a filesystem-only pause that a
  // crash cut short are not what it runs.
  if (Status d = store_.drop_paused_files(r.id, /*stale_only=*/true); !d) return d;
  Result<NetworkParams> net = network_of(r);
  State st = r.state == storage::kStatePaused ? State::kPaused : State::kRunning;
  Status freezer = !net ? Status(net.error()) : st == State::kPaused ? sb->pause() : sb->resume();
  if (!freezer) {
    if (Status k = sb->kill(); !k) {
      MutexLock g(lost_mu_);
      unkilled_.emplace_back(r.id, std::move(sb));
    }
    return freezer;
  }
  std::shared_ptr<Live> live = live_of(r);
  live->init_pid = sb->init_pid();
  {
    MutexLock n(live->net_mu);
    live->network = *net;
  }
  {
    MutexLock g(live->op_mu);
    live->sb = std::move(sb);
    // Not a move in the table: the sandbox resumes the state its row kept.
    live->state = st;
  }
  if (cfg_.egress && cfg_.egress_policies) cfg_.egress_policies->set(r.id, net->egress);
  {
    MutexLock g(mu_);
    live_[r.id] = live;
  }
  event(r.tenant_id, r.id, "recovered", std::string("taken back after a restart of sandgate, ") + r.state);
  return Status::Ok();
}

std::shared_ptr<SandboxService::Live> SandboxService::find_live(const std::string& id) {
  MutexLock g(mu_);
  auto it = live_.find(id);
  return it == live_.end() ? nullptr : it->second;
}

size_t SandboxService::live_count() {
  MutexLock g(mu_);
  return live_.size();
}

Result<State> SandboxService::state(const std::string& id) {
  std::shared_ptr<Live> live = find_live(id);
  if (!live) return not_found_error("sandbox \"" + id + "\" is not live");
  MutexLock g(live->op_mu);
  return live->state;
}

static Error not_found(const std::string& id) { return not_found_error("sandbox \"" + id + "\" not found"); }

void SandboxService::enter(Live& live, State to) {
  // A move outside the table is a bug in this file, never a client's doing.
  assert(legal(live.state, to) && "a sandbox moved outside the lifecycle table");
  live.state = to;
}

Result<bool> SandboxService::move(Live& live, const std::string& id, State to) {
  assert(legal(live.state, to) && "a sandbox moved outside the lifecycle table");
  std::string from_row(stored_state(live.state)), to_row(stored_state(to));
  if (from_row != to_row) {
    Result<bool> moved = store_.transition(id, {from_row}, to_row);
    if (!moved || !*moved) return moved;
  }
  live.state = to;
  return true;
}

SandboxRow SandboxService::new_row(const storage::TenantRow& tenant, const storage::TemplateRow& t,
                                   const CreateParams& p) {
  SandboxRow row;
  row.id = new_sandbox_id();
  row.tenant_id = tenant.id;
  row.template_id = t.id;
  row.build_id = t.build_id;
  row.alias = t.name;
  row.state = storage::kStateCreating;
  row.backend = rt_.name();
  row.metadata = nlohmann::json(p.metadata).dump();
  row.env_vars = nlohmann::json(p.env_vars).dump();
  row.envd_token = sys::random_hex(16);
  row.envd_version = "";
  row.cpu_count = t.cpu_count;
  row.memory_mb = t.memory_mb;
  row.disk_size_mb = t.disk_size_mb;
  row.timeout_s = p.timeout_s;
  row.started_at = clock_();
  row.end_at = row.started_at + p.timeout_s;
  row.on_timeout = p.on_timeout_pause ? (p.on_timeout_pause_files ? storage::kOnTimeoutPauseFiles : "pause") : "kill";
  row.auto_resume = p.auto_resume;
  row.allow_internet = p.network.allow_internet;
  row.network = network_json(p.network);
  if (!p.public_traffic) row.traffic_token = sys::random_hex(16);
  return row;
}

runtime::SandboxSpec SandboxService::new_spec(const SandboxRow& row, const storage::TemplateRow& t,
                                             const CreateParams& p) const {
  runtime::SandboxSpec spec;
  spec.id = row.id;
  spec.rootfs = t.rootfs_path;
  spec.cpu_count = static_cast<uint32_t>(t.cpu_count);
  spec.memory_mb = static_cast<uint64_t>(t.memory_mb);
  spec.max_pids = cfg_.max_pids;
  spec.disk_mb = static_cast<uint64_t>(t.disk_size_mb);
  nlohmann::json layers = nlohmann::json::parse(t.layers, nullptr, false);
  if (layers.is_array())
    for (const nlohmann::json& l : layers)
      if (l.is_string()) spec.layers.push_back(l.get<std::string>());
  // A built template's ENV, under the create's envVars.
  nlohmann::json config = nlohmann::json::parse(t.config, nullptr, false);
  if (config.is_object())
    if (auto env = config.find("env"); env != config.end() && env->is_object())
      for (auto it = env->begin(); it != env->end(); ++it)
        if (it->is_string() && !p.env_vars.count(it.key())) spec.env.emplace_back(it.key(), it->get<std::string>());
  if (cfg_.model_proxy_env)
    for (auto& [k, v] : model_proxy_env())
      if (!p.env_vars.count(k)) spec.env.emplace_back(k, v);
  if (cfg_.egress && cfg_.egress_proxy_env)
    for (auto& [k, v] : egress_proxy_env())
      if (!p.env_vars.count(k)) spec.env.emplace_back(k, v);
  for (const auto& [k, v] : p.env_vars) spec.env.emplace_back(k, v);
  spec.envd_access_token = row.envd_token;
  spec.ready_timeout = cfg_.ready_timeout;
  spec.start = host::start_command_of(t.config, cfg_.start_ready_timeout);
  return spec;
}

// A built template's start command where the runtime does not run it
// (the process backend: at each create), then its ready command until it
// succeeds; the create answers once ready.
Status SandboxService::run_start_command(runtime::Sandbox& sb, const std::string& token,
                                         const runtime::SandboxSpec& spec, const storage::TemplateRow& t) {
  if (!spec.start || rt_.runs_start_command()) return Status::Ok();
  if (Status s = host::start_and_wait_ready(sb, token, *spec.start); !s)
    return s.error().with_context("template '" + t.name + "'");
  return Status::Ok();
}

Result<SandboxRow> SandboxService::create(const storage::TenantRow& tenant, const CreateParams& p) {
  if (Status s = check_timeout(p.timeout_s); !s) return s.error();
  // Refused, not silently dropped: this server lets no sandbox out.
  if (p.network.asks_egress && !cfg_.egress)
    return invalid_error("field 'network.allowOut': egress is not available on this server "
                         "(it runs with --network off; every destination is denied)");
  if (cfg_.ensure_template)
    if (Status s = cfg_.ensure_template(tenant, p.template_ref); !s) return s.error();
  Result<std::optional<storage::TemplateRow>> tpl = store_.resolve_template(tenant.id, p.template_ref);
  if (!tpl) return tpl.error();
  if (!*tpl) return not_found_error("template '" + p.template_ref + "' not found");
  const storage::TemplateRow& t = **tpl;
  if (t.status != "ready")
    return Error(ErrorKind::kUnavailable, "template '" + t.name + "' is " + t.status + ", not ready; retry shortly");

  // A template with a start command: one of the warm pool's, if it has one
  // (the row takes its id).
  std::optional<WarmPool::Entry> pooled;
  count_creating(tenant.id, +1);  // until the row is in (pool_admits)
  if (pool_ && host::start_command_of(t.config, cfg_.start_ready_timeout))
    pooled = pool_->take(WarmPool::key_of(tenant.id, t), WarmPool::Recipe{tenant, t});
  SandboxRow row = new_row(tenant, t, p);
  if (pooled) row.id = pooled->id;
  Status inserted = cfg_.reserve ? cfg_.reserve(tenant, row) : Status::Ok();
  if (inserted) inserted = store_.insert_sandbox_within_quota(row, tenant.max_sandboxes, tenant.max_memory_mb);
  count_creating(tenant.id, -1);
  if (Status s = inserted; !s) {
    if (pooled) {  // over quota: it goes, as a create would not have started one
      if (Status k = pooled->sb->kill(); !k) {
        MutexLock g(lost_mu_);
        unkilled_.emplace_back(pooled->id, std::move(pooled->sb));
      }
    }
    return s.error();
  }

  runtime::SandboxSpec spec = new_spec(row, t, p);
  uint64_t t0 = sys::monotonic_ns();
  Result<std::unique_ptr<runtime::Sandbox>> sb = Error(ErrorKind::kInternal, "not created");
  if (pooled) {
    if (Status h = hand_over(*pooled->sb, row, spec); h) {
      sb = std::move(pooled->sb);
    } else {
      LOG_WARN("sandbox " << row.id << ": the warm pool's sandbox refused its creator's configuration ("
                          << h.error().message() << "); starting one");
      if (Status k = pooled->sb->kill(); !k) {
        // Its remains keep the id: this create cannot start another on it.
        MutexLock g(lost_mu_);
        unkilled_.emplace_back(pooled->id, std::move(pooled->sb));
        (void)store_.finish(row.id, storage::kStateFailed, k.error().message(), clock_());
        return k.error();
      }
      pooled.reset();
    }
  }
  if (!pooled) {
    sb = rt_.create(spec);
    if (!sb) {
      (void)store_.finish(row.id, storage::kStateFailed, sb.error().message(), clock_());
      event(tenant.id, row.id, "create_failed", sb.error().message());
      LOG_ERROR("create sandbox " << row.id << " (tenant " << tenant.name << "): " << sb.error().message());
      return sb.error();
    }
    if (Status s = run_start_command(**sb, row.envd_token, spec, t); !s) {
      (void)(*sb)->kill();
      (void)store_.finish(row.id, storage::kStateFailed, s.error().message(), clock_());
      event(tenant.id, row.id, "create_failed", s.error().message());
      return s.error();
    }
  }
  std::shared_ptr<Live> live = live_of(row);  // kCreating; not shared until running
  row.envd_version = channel::kEnvdVersion;
  row.init_pid = (*sb)->init_pid();
  live->init_pid = row.init_pid.value_or(0);
  {
    // Not shared yet, so uncontended: held because the fields are its.
    MutexLock n(live->net_mu);
    live->network = p.network;
  }
  {
    MutexLock g(live->op_mu);
    live->sb = std::move(*sb);
    if (Status s = store_.set_running(row.id, *row.init_pid, row.envd_version); !s) {
      (void)end_runtime(*live, row.id);
      enter(*live, State::kFailed);
      (void)store_.finish(row.id, std::string(stored_state(State::kFailed)), s.error().message(),
                          clock_());
      return s.error();
    }
    enter(*live, State::kRunning);
  }
  row.state = std::string(stored_state(State::kRunning));
  if (cfg_.egress && cfg_.egress_policies) cfg_.egress_policies->set(row.id, p.network.egress);
  {
    MutexLock g(mu_);
    live_[row.id] = live;
  }
  double ms = static_cast<double>(sys::monotonic_ns() - t0) / 1e6;
  event(tenant.id, row.id, "created",
        "template " + t.name + (pooled ? ", from the warm pool" : "") + ", ready in " + std::to_string(ms) + " ms");
  LOG_INFO("sandbox " << row.id << " created for tenant " << tenant.name << " from " << t.name << " in " << ms
                      << " ms");
  return row;
}

Result<SandboxService::Found> SandboxService::lookup(const std::string& tenant_id, const std::string& id) {
  Result<SandboxRow> row = get(tenant_id, id);
  if (!row) return row.error();
  std::shared_ptr<Live> live = find_live(id);
  if (!live) return not_found(id);
  return Found{std::move(*row), std::move(live)};
}

Status SandboxService::check_timeout(int64_t timeout_s) const {
  if (timeout_s < 0 || timeout_s > cfg_.max_timeout_s)
    return invalid_error("timeout must be between 0 and " + std::to_string(cfg_.max_timeout_s) + " seconds");
  return Status::Ok();
}

Result<SandboxRow> SandboxService::get(const std::string& tenant_id, const std::string& id) {
  Result<std::optional<SandboxRow>> r = store_.get_sandbox(tenant_id, id);
  if (!r) return r.error();
  if (!*r || ((*r)->state != storage::kStateRunning && (*r)->state != storage::kStatePaused)) return not_found(id);
  return **r;
}

Status SandboxService::end_runtime(Live& live, const std::string& id) {
  if (!live.sb) return Status::Ok();
  Status st = live.sb->kill();
  // kill() is idempotent: a second try gets what a busy first one missed.
  if (!st) st = live.sb->kill();
  if (st) {
    live.sb.reset();
  } else {
    // Recorded as ended all the same (clients are told the truth: it is
    // gone to them); its remains are killed again by every tick until
    // they are (never dropped: a dropped handle would leak its processes).
    LOG_ERROR("kill sandbox " << id << ": " << st.error().message() << "; retrying every second");
    MutexLock g(lost_mu_);
    unkilled_.emplace_back(id, std::move(live.sb));
  }
  // The VMM is gone (or going): its fault server and pool records can go too.
  if (memory_) memory_->forget(id);
  return st;
}

Status SandboxService::kill_locked(Live& live, const std::string& id, const std::string& tenant_id, State to,
                                   const std::string& reason) {
  const std::string state(stored_state(to));
  Result<bool> done = store_.finish(id, state, reason, clock_());
  if (!done) {
    // The record cannot be written (a full disk: often this very
    // sandbox's). The kill goes ahead, freeing what it held; the record
    // is written again at once and, failing that, by every tick until it
    // sticks. Clients are told the truth: the sandbox is gone.
    LOG_WARN("sandbox " << id << ": recording its end failed (" << done.error().message()
                        << "); killing it anyway, the record follows");
  }
  Status st = end_runtime(live, id);
  // The files of its filesystem-only pauses go with it.
  if (Status d = store_.drop_paused_files(id); !d) LOG_WARN("sandbox " << id << ": " << d.error().message());
  enter(live, to);
  {
    MutexLock g(mu_);
    live_.erase(id);
  }
  if (cfg_.egress_policies) cfg_.egress_policies->erase(id);
  if (!done) done = store_.finish(id, state, reason, clock_());
  if (!done) {
    MutexLock g(lost_mu_);
    unrecorded_.push_back(Unrecorded{id, tenant_id, state, reason, clock_()});
  } else if (*done) {
    event(tenant_id, id, state, reason);
  }
  if (waits_) waits_->forget(id);
  return st;
}

Status SandboxService::wait_pause(const std::string& id) {
  std::shared_ptr<Live> live = find_live(id);
  if (!live) return not_found(id);
  MutexLock g(live->op_mu);
  if (!live->sb) return not_found(id);
  // A client paused it (stopped already), or a wait pause holds it.
  if (live->state != State::kRunning) return Status::Ok();
  if (Status s = live->sb->pause(); !s) return s.error().with_context("wait pause of sandbox " + id);
  enter(*live, State::kWaitPaused);
  return Status::Ok();
}

Status SandboxService::wait_resume(const std::string& id) {
  std::shared_ptr<Live> live = find_live(id);
  if (!live) return not_found(id);
  MutexLock g(live->op_mu);
  if (!live->sb) return not_found(id);
  // Running, or a client paused it meanwhile (it stays paused).
  if (live->state != State::kWaitPaused && live->state != State::kOffloaded) return Status::Ok();
  if (memory_) {
    // Predicted pages in before the vCPUs run; the rest fault on demand.
    if (Result<uint64_t> n = memory_->prefetch(id); !n)
      LOG_WARN("sandbox " << id << ": prefetch before resume: " << n.error().message());
  } else if (cfg_.swap_offload && live->state == State::kOffloaded) {
    // What it touched in its previous run back from swap before the thaw.
    swap_in(id, *live, "before resume");
  }
  if (Status s = live->sb->resume(); !s) return s.error().with_context("wait resume of sandbox " + id);
  enter(*live, State::kRunning);
  return Status::Ok();
}

Status SandboxService::wait_offload(const std::string& id, const std::atomic<bool>& cancel) {
  Status s = offload_one(id, cancel);
  // The swap device's upkeep, with the sandbox's lock released (its resume
  // may be waiting for it).
  if (s && !memory_ && cfg_.swap_after_offload) cfg_.swap_after_offload();
  return s;
}

Status SandboxService::offload_one(const std::string& id, const std::atomic<bool>& cancel) {
  if (!memory_ && !cfg_.swap_offload) return Error(ErrorKind::kUnavailable, "memory offload is off");
  std::shared_ptr<Live> live = find_live(id);
  if (!live) return not_found(id);
  // The CPU budget: at most offload_slots_ encoders at once; a sandbox
  // that finds none stays paused (whole) for this wait.
  OffloadSlot slot(offloads_running_, offload_slots_);
  if (!slot.held()) return no_offload_slot();
  MutexLock g(live->op_mu);
  if (!live->sb) return not_found(id);
  if (live->state != State::kWaitPaused) return Error(ErrorKind::kConflict, "sandbox " + id + " is not wait-paused");
  if (!memory_) {
    // Offload to swap: its private memory out, the kernel compressing it.
    enter(*live, State::kOffloading);
    uint64_t t0 = sys::monotonic_ns();
    Result<runtime::SwapOutAccount> out = live->sb->swap_out(cancel, runtime::Sandbox::SwapOutOf::kPaused);
    swap_out_ns_ += sys::monotonic_ns() - t0;
    // Cancelled part-way, what went out faults back: resumed alike.
    enter(*live, out ? State::kOffloaded : State::kWaitPaused);
    if (!out) return out.error().with_context("offload of sandbox " + id);
    ++swap_outs_;
    live->swap_out_pages = out->out_pages;
    swap_out_pages_ += out->out_pages;
    swap_unused_pages_ += out->unused_pages;
    LOG_INFO("sandbox " << id << ": " << out->out_pages << " of " << out->resident_pages
                        << " resident pages out to swap in " << (sys::monotonic_ns() - t0) / 1000000 << " ms ("
                        << out->unused_pages << " read back and not used put back); " << out->hot_pages
                        << " to read back before the thaw");
    return Status::Ok();
  }
  Result<runtime::GuestMemoryInfo> gm = live->sb->guest_memory();
  if (!gm) return gm.error();
  OffloadRequest req;
  req.tenant_id = live->tenant_id;
  req.template_id = live->template_id;
  req.memory = *gm;
  runtime::Sandbox* sb = live->sb.get();
  req.release = [sb] { return sb->release_guest_memory(); };
  enter(*live, State::kOffloading);
  Result<std::string> done = memory_->offload(id, req, cancel);
  // Resumed alike either way (wait_resume prefetches, the rest faults
  // back): offloaded means the engine reported a whole offload.
  enter(*live, done ? State::kOffloaded : State::kWaitPaused);
  if (!done) return done.error().with_context("offload of sandbox " + id);
  LOG_INFO("sandbox " << id << ": " << *done);
  return Status::Ok();
}

void SandboxService::render_swap_metrics(std::string& out) {
  if (!cfg_.swap_offload) return;
  metrics::render_count(out, "sandgate_swap_offloads_total", "counter",
                        "Wait-paused process sandboxes whose memory went out to swap.", swap_outs_.load());
  metrics::render_count(out, "sandgate_swap_idle_offloads_total", "counter",
                        "Idle process sandboxes whose memory went out to swap as they ran.", idle_outs_.load());
  metrics::render_count(out, "sandgate_swap_out_pages_total", "counter",
                        "4 KiB pages process sandboxes put out to swap.", swap_out_pages_.load());
  metrics::render_count(out, "sandgate_swap_in_pages_total", "counter",
                        "4 KiB pages read back from swap before thaws.", swap_in_pages_.load());
  metrics::render_count(out, "sandgate_swap_unused_pages_total", "counter",
                        "4 KiB pages read back before a thaw and not touched before the next offload, which put them "
                        "back.",
                        swap_unused_pages_.load());
  metrics::render_header(out, "sandgate_swap_out_seconds_total", "counter",
                         "Time spent putting sandboxes' memory out to swap.");
  metrics::render_sample(out, "sandgate_swap_out_seconds_total", "", static_cast<double>(swap_out_ns_.load()) / 1e9);
  metrics::render_header(out, "sandgate_swap_in_seconds_total", "counter", "Time spent reading memory back before thaws.");
  metrics::render_sample(out, "sandgate_swap_in_seconds_total", "", static_cast<double>(swap_in_ns_.load()) / 1e9);
  std::vector<std::pair<std::string, std::shared_ptr<Live>>> lives;
  {
    MutexLock g(mu_);
    for (auto& [id, live] : live_) lives.emplace_back(id, live);
  }
  // Per sandbox, written exactly (as render_count).
  auto per_sandbox = [&](const char* name, const char* type, const char* help, auto value) {
    metrics::render_header(out, name, type, help);
    for (auto& [id, live] : lives)
      out += std::string(name) + "{sandbox=\"" + metrics::escape_label(id) + "\"} " + std::to_string(value(*live)) + "\n";
  };
  per_sandbox("sandgate_sandbox_swap_out_pages", "gauge", "Pages the sandbox's last offload put out to swap.",
              [](const Live& l) { return l.swap_out_pages.load(); });
  per_sandbox("sandgate_sandbox_swap_in_pages_total", "counter", "Pages read back into the sandbox before its thaws.",
              [](const Live& l) { return l.swap_in_pages.load(); });
  if (cfg_.swap_device_metrics) cfg_.swap_device_metrics(out);
}

uint64_t SandboxService::memory_in_use() {
  MutexLock g(mu_);
  uint64_t sum = 0;
  for (auto& [id, live] : live_) sum += live->mem_now.load(std::memory_order_relaxed);
  return sum;
}

Result<bool> SandboxService::wait_idle(const std::string& id, std::chrono::milliseconds timeout) {
  std::shared_ptr<Live> live = find_live(id);
  if (!live) return not_found(id);
  MutexLock g(live->op_mu);
  if (!live->sb) return not_found(id);
  Result<std::string> reply = live->sb->control(R"({"type":"status"})", timeout);
  if (!reply) return reply.error();
  auto j = nlohmann::json::parse(*reply, nullptr, false);
  if (!j.is_object() || !j.contains("runnable") || !j["runnable"].is_number_unsigned())
    return internal_error("agent status without a runnable count: " + reply->substr(0, 200));
  return j["runnable"].get<uint64_t>() == 0;
}

Status SandboxService::kill_lost(const std::string& id, const std::string& reason) {
  std::shared_ptr<Live> live = find_live(id);
  if (!live) return not_found(id);
  MutexLock g(live->op_mu);
  if (!live->sb) return not_found(id);
  return kill_locked(*live, id, live->tenant_id, State::kLost, reason);
}

Result<std::string> SandboxService::live_tenant(const std::string& id) {
  std::shared_ptr<Live> live = find_live(id);
  if (!live) return not_found(id);
  return live->tenant_id;
}

std::vector<std::pair<std::string, std::string>> egress_proxy_env() {
  std::string url = "http://127.0.0.1:" + std::to_string(channel::kEgressProxyPort);
  std::string local = "localhost,127.0.0.1,::1";
  return {{"HTTP_PROXY", url}, {"HTTPS_PROXY", url}, {"http_proxy", url}, {"https_proxy", url},
          {"NO_PROXY", local},  {"no_proxy", local}};
}

std::optional<NetworkParams> SandboxService::network(const std::string& id) {
  std::shared_ptr<Live> live = find_live(id);
  if (!live) return std::nullopt;
  MutexLock g(live->net_mu);
  return live->network;
}

Status SandboxService::update_network(const std::string& tenant_id, const std::string& id, const NetworkParams& n) {
  Result<Found> f = lookup(tenant_id, id);
  if (!f) return f.error();
  if (n.asks_egress && !cfg_.egress)
    return invalid_error("field 'allowOut': egress is not available on this server "
                         "(it runs with --network off; every destination is denied)");
  {
    MutexLock op(f->live->op_mu);
    if (!f->live->sb && f->live->state != State::kPersisted) return not_found(id);
    // The stored flag first (GET shows it): if that fails, nothing changed.
    if (Status s = store_.set_network(id, n.allow_internet, network_json(n)); !s) return s;
    MutexLock g(f->live->net_mu);
    f->live->network = n;
  }
  event(tenant_id, id, "network_updated",
        "egress: " + std::to_string(n.allow_out.size()) + " allowOut, " + std::to_string(n.deny_out.size()) +
            " denyOut entries; internet access " +
            (n.allow_internet ? (*n.allow_internet ? "on" : "off") : "default (on)"));
  // Outside the sandbox's locks: the proxy's recheck reads the table.
  if (cfg_.egress && cfg_.egress_policies) cfg_.egress_policies->set(id, n.egress);
  return Status::Ok();
}

std::vector<std::pair<std::string, std::string>> model_proxy_env() {
  std::string base = "http://127.0.0.1:" + std::to_string(channel::kModelProxyPort);
  return {{"OPENAI_BASE_URL", base + "/v1"},
          {"ANTHROPIC_BASE_URL", base},
          // The SDKs refuse to start without a key; the channel is the
          // credential, so any value works and none is a real secret.
          {"OPENAI_API_KEY", "sandgate-channel"},
          {"ANTHROPIC_API_KEY", "sandgate-channel"}};
}

Result<std::vector<SandboxRow>> SandboxService::list(storage::SandboxQuery q) {
  if (q.template_id && !q.template_id->empty()) {
    Result<std::optional<storage::TemplateRow>> t = store_.find_template(q.tenant_id, *q.template_id);
    if (!t) return t.error();
    if (*t) q.template_id = (*t)->id;  // else: no template by that name or id, and no sandbox of it
  }
  return store_.list_sandboxes(q);
}

Status SandboxService::kill(const std::string& tenant_id, const std::string& id) {
  Result<SandboxRow> row = get(tenant_id, id);
  if (!row) return row.error();
  std::shared_ptr<Live> live = find_live(id);
  if (!live) {
    // A row without a handle: its processes are already gone.
    Result<bool> done = store_.finish(id, storage::kStateKilled, "killed by client", clock_());
    if (!done) return done.error();
    return *done ? Status::Ok() : Status(not_found(id));
  }
  // A running offload holds the sandbox's lock for seconds: this stops it
  // within a page (and resumes the sandbox, which is then killed).
  before_traffic(id);
  MutexLock g(live->op_mu);
  if (!live->sb && live->state != State::kPersisted) return not_found(id);
  return kill_locked(*live, id, tenant_id, State::kKilled, "killed by client");
}

Status SandboxService::pause(const std::string& tenant_id, const std::string& id, bool keep_memory) {
  Result<Found> found = lookup(tenant_id, id);
  if (!found) return found.error();
  std::shared_ptr<Live> live = found->live;
  before_traffic(id);  // a running offload stops first (kill() says why)
  MutexLock g(live->op_mu);
  if (live->state == State::kPaused || live->state == State::kPersisted)
    return conflict_error("sandbox \"" + id + "\" is already paused");
  if (!live->sb) return not_found(id);
  // To disk: microVMs always (a snapshot with their memory, which is more
  // than a filesystem-only pause asks), process sandboxes when only their
  // files are to be kept.
  if (pauses_to_disk(keep_memory)) return persist_locked(*live, found->row);
  // Stopped first (idempotent for a wait-paused one), then recorded.
  if (Status s = live->sb->pause(); !s) return s.error().with_context("pause sandbox " + id);
  Result<bool> moved = move(*live, id, State::kPaused);
  if (!moved || !*moved) {
    // Not recorded: it runs on as the row says (a wait pause's own resume
    // is the coordinator's, so a wait-paused one stays frozen).
    if (live->state == State::kRunning) (void)live->sb->resume();
    if (!moved) return moved.error();
    return conflict_error("sandbox \"" + id + "\" is already paused");
  }
  event(tenant_id, id, "paused", "paused by client");
  return Status::Ok();
}

// Whether a pause goes to disk (persist_locked) rather than freezing.
bool SandboxService::pauses_to_disk(bool keep_memory) const {
  if (cfg_.snapshot_dir.empty()) return false;
  return rt_.snapshots_memory() || (!keep_memory && rt_.exports_layers());
}

// A pause to disk: the sandbox becomes a hidden template (kind "pause"),
// the row says paused, and its VMM or processes go, freeing its memory.
// connect() starts it again from that template: a process sandbox from
// its files (a fresh start), a microVM from its snapshot (its processes
// and memory as they were).
Status SandboxService::persist_locked(Live& live, const SandboxRow& r) {
  const std::string& id = r.id;
  // The memory the microVM was restored from: its pause is packed against it.
  std::string base;
  if (cfg_.pause_packer && rt_.snapshots_memory())
    if (Result<runtime::GuestMemoryInfo> mi = live.sb->guest_memory(); mi) base = mi->template_memory;
  Result<std::pair<storage::SnapshotRow, storage::TemplateRow>> snap =
      snapshot_locked(live, r, "", storage::kPauseKind);
  if (!snap) return snap.error().with_context(rt_.snapshots_memory() ? "pause to disk" : "filesystem-only pause");
  // Recorded before the processes go: a crash from here on finds the row
  // paused with its files (and the next start removes the processes).
  Result<bool> moved = store_.transition(id, {storage::kStateRunning}, storage::kStatePaused);
  if (!moved || !*moved) {
    (void)store_.set_template_status(snap->second.id, "deleted", clock_());
    if (!moved) return moved.error();
    return conflict_error("sandbox \"" + id + "\" changed state during the pause; retry");
  }
  enter(live, State::kSnapshotting);
  enter(live, State::kPersisted);
  if (Status k = end_runtime(live, id); !k) LOG_WARN("sandbox " << id << ": its processes are killed by later ticks");
  if (cfg_.egress && cfg_.egress_policies) cfg_.egress_policies->erase(id);
  std::string detail = rt_.snapshots_memory() ? "paused to disk: a microVM snapshot with its memory and processes"
                                              : "paused, files only (its memory and processes are gone)";
  // With the VMM gone, its RAM as written is packed; a pack that fails
  // (a full disk) leaves it as it was, which resumes the same.
  nlohmann::json layers = nlohmann::json::parse(snap->second.layers, nullptr, false);
  if (!base.empty() && layers.is_array() && !layers.empty() && layers.back().is_string()) {
    const std::string dir = layers.back().get<std::string>();
    Result<std::string> packed = cfg_.pause_packer->pack(dir, base);
    if (packed) {
      detail += "; " + *packed;
      // The tenant's template storage counts what the pause keeps now (its
      // base is a link to a file it does not own).
      struct stat b {};
      uint64_t shared = ::stat((dir + "/memory.base").c_str(), &b) == 0 ? uint64_t(b.st_blocks) * 512 : 0;
      uint64_t used = sys::disk_usage(dir);
      if (Status s = store_.set_template_file_bytes(dir, static_cast<int64_t>(used > shared ? used - shared : 0)); !s)
        LOG_WARN("sandbox " << id << ": " << s.error().message());
    } else
      LOG_WARN("sandbox " << id << ": its pause keeps its memory unpacked: " << packed.error().message());
  }
  event(r.tenant_id, id, "paused", detail);
  return Status::Ok();
}

// connect() of a sandbox paused without its memory: a fresh sandbox of the
// same id, token and environment on the files the pause kept.
Status SandboxService::restore_locked(Live& live, const SandboxRow& r) {
  const std::string& id = r.id;
  Result<std::optional<storage::TemplateRow>> files = store_.paused_files(id);
  if (!files) return files.error();
  if (!*files) return internal_error("sandbox " + id + ": the files of its pause are missing");
  CreateParams p;
  p.template_ref = (*files)->id;
  p.auto_resume = r.auto_resume;
  {
    MutexLock n(live.net_mu);
    p.network = live.network;
  }
  nlohmann::json env = nlohmann::json::parse(r.env_vars, nullptr, false);
  if (env.is_object())
    for (auto it = env.begin(); it != env.end(); ++it)
      if (it->is_string()) p.env_vars[it.key()] = it->get<std::string>();
  runtime::SandboxSpec spec = new_spec(r, **files, p);
  const std::string from = rt_.snapshots_memory() ? " from its snapshot on disk" : " from its files";
  // A microVM's pause keeps its RAM packed: made whole (and checked) first.
  if (cfg_.pause_packer && rt_.snapshots_memory())
    for (const std::string& l : spec.layers)
      if (runtime::is_vm_snapshot_layer(l))
        if (Status u = cfg_.pause_packer->unpack(l); !u) return u.error().with_context("resume sandbox " + id + from);
  Result<std::unique_ptr<runtime::Sandbox>> sb = rt_.create(spec);
  if (!sb) return sb.error().with_context("resume sandbox " + id + from);
  if (Status s = run_start_command(**sb, r.envd_token, spec, **files); !s) {
    (void)(*sb)->kill();
    return s.error().with_context("resume sandbox " + id + from);
  }
  int pid = (*sb)->init_pid();
  if (Status s = store_.set_resumed(id, pid, channel::kEnvdVersion); !s) {
    (void)(*sb)->kill();
    return s;
  }
  if (Status m = store_.mark_resumed((*files)->id); !m) LOG_WARN("sandbox " << id << ": " << m.error().message());
  live.sb = std::move(*sb);
  live.init_pid = pid;
  enter(live, State::kRunning);
  if (cfg_.egress && cfg_.egress_policies) {
    MutexLock n(live.net_mu);
    cfg_.egress_policies->set(id, live.network.egress);
  }
  return Status::Ok();
}

Result<SandboxService::Connected> SandboxService::connect(const std::string& tenant_id, const std::string& id,
                                                          int64_t timeout_s) {
  if (Status s = check_timeout(timeout_s); !s) return s.error();
  Result<Found> found = lookup(tenant_id, id);
  if (!found) return found.error();
  before_traffic(id);
  SandboxRow* row = &found->row;
  std::shared_ptr<Live> live = found->live;
  MutexLock g(live->op_mu);
  Connected out;
  int64_t now = clock_();
  if (live->state == State::kPersisted) {
    if (Status s = restore_locked(*live, *row); !s) return s.error();
    out.resumed = true;
    if (Status s = store_.set_end_at(id, now + timeout_s); !s) return s.error();
    event(tenant_id, id, "resumed",
          rt_.snapshots_memory() ? "resumed by connect from its snapshot on disk"
                                 : "resumed by connect from its files (a fresh start)");
  } else if (!live->sb) {
    return not_found(id);
  } else if (live->state == State::kPaused) {
    if (Status s = live->sb->resume(); !s) return s.error().with_context("resume sandbox " + id);
    Result<bool> moved = move(*live, id, State::kRunning);
    if (!moved || !*moved) {
      (void)live->sb->pause();  // as the row says
      if (!moved) return moved.error();
      return conflict_error("sandbox \"" + id + "\" changed state during resume; retry");
    }
    out.resumed = true;
    // A resumed sandbox gets a fresh timeout from now.
    if (Status s = store_.set_end_at(id, now + timeout_s); !s) return s.error();
    event(tenant_id, id, "resumed", "resumed by connect");
  } else if (row->end_at < now + timeout_s) {
    if (Status s = store_.set_end_at(id, now + timeout_s); !s) return s.error();
  }
  Result<SandboxRow> fresh = get(tenant_id, id);
  if (!fresh) return fresh.error();
  out.row = std::move(*fresh);
  return out;
}

Result<UniqueFd> SandboxService::open_port(const std::string& id, uint16_t port, const http::HttpRequest& head) {
  std::shared_ptr<Live> live = find_live(id);
  if (!live) return not_found(id);
  // Credentials before anything wakes: a request envd or a private port
  // would refuse must not resume (or un-wait-pause) the sandbox.
  bool envd = port == http::kEnvdPort;
  if (envd && head.path != "/health" && !envd_credentials_ok(head, live->envd_token, clock_()))
    return Error(ErrorKind::kUnauthorized, "invalid or missing access token for sandbox \"" + id +
                                               "\": send its envdAccessToken as X-Access-Token");
  if (!envd && live->traffic_token && !traffic_token_ok(head, *live->traffic_token))
    return Error(ErrorKind::kUnauthorized, "the ports of sandbox \"" + id +
                                               "\" are private (allowPublicTraffic false): send its "
                                               "trafficAccessToken as the e2b-traffic-access-token header");
  before_traffic(id);
  MutexLock g(live->op_mu);
  if (live->state == State::kPersisted) {
    // A microVM paused to disk comes back whole, as a frozen one would.
    if (!rt_.snapshots_memory())
      return conflict_error("sandbox \"" + id + "\" is paused without its memory (keepMemory false): "
                            "connect to resume it");
    if (!live->auto_resume)
      return conflict_error("sandbox \"" + id + "\" is paused and its autoResume is off: resume it with "
                            "Sandbox.connect() (POST /sandboxes/" + id + "/connect)");
    Result<std::optional<SandboxRow>> row = store_.get_sandbox(live->tenant_id, id);
    if (!row) return row.error();
    if (!*row) return not_found(id);
    if (Status s = restore_locked(*live, **row); !s) return s.error();
    (void)store_.set_end_at(id, clock_() + (*row)->timeout_s);
    event(live->tenant_id, id, "resumed", "resumed from its snapshot on disk by traffic to port " + std::to_string(port));
    return live->sb->open_port(port);
  }
  if (!live->sb) return not_found(id);
  if (live->state == State::kPaused) {
    if (!live->auto_resume)
      return conflict_error("sandbox \"" + id + "\" is paused and its autoResume is off: resume it with "
                            "Sandbox.connect() (POST /sandboxes/" + id + "/connect)");
    // Nothing to serve the request: it stays paused (the process
    // backend's sockets can be read while it is frozen).
    if (!envd && rt_.name() == std::string("process") && live->init_pid > 0 &&
        port_listening(live->init_pid, port) == std::optional<bool>(false))
      return conflict_error("sandbox \"" + id + "\" is paused and nothing in it listens on port " +
                            std::to_string(port) + ": it was not resumed");
    if (Status s = live->sb->resume(); !s) return s.error().with_context("resume sandbox " + id + " for traffic");
    Result<bool> resumed = move(*live, id, State::kRunning);
    if (!resumed || !*resumed) {
      (void)live->sb->pause();  // as the row says
      if (!resumed) return resumed.error();
      return conflict_error("sandbox \"" + id + "\" changed state during resume; retry");
    }
    Result<std::optional<SandboxRow>> row = store_.get_sandbox(live->tenant_id, id);
    if (row && *row) (void)store_.set_end_at(id, clock_() + (*row)->timeout_s);
    event(live->tenant_id, id, "resumed", "resumed by traffic to port " + std::to_string(port));
  }
  return live->sb->open_port(port);
}

// A build id as the template builds make them: a UUID (version 4 form).
static std::string new_build_id() {
  std::string h = sys::random_hex(16);
  h[12] = '4';
  return h.substr(0, 8) + "-" + h.substr(8, 4) + "-" + h.substr(12, 4) + "-" + h.substr(16, 4) + "-" + h.substr(20, 12);
}

Result<storage::TemplateRow> SandboxService::files_of(const SandboxRow& r) {
  // Resumed from a filesystem-only pause: it runs that pause's files.
  Result<std::optional<storage::TemplateRow>> paused = store_.paused_files(r.id, storage::kResumedKind);
  if (!paused) return paused.error();
  if (*paused) return **paused;
  return store_.template_of_sandbox(r);
}

Result<std::pair<storage::SnapshotRow, storage::TemplateRow>> SandboxService::make_snapshot(
    const std::string& tenant_id, const std::string& id, const std::string& name, const char* kind) {
  if (cfg_.snapshot_dir.empty()) return Error(ErrorKind::kUnavailable, "snapshots are not available on this server");
  Result<Found> f = lookup(tenant_id, id);
  if (!f) return f.error();
  before_traffic(id);  // a wait-paused sandbox runs first
  MutexLock op(f->live->op_mu);
  if (!f->live->sb) {
    if (f->live->state == State::kPersisted)
      return conflict_error("sandbox \"" + id + "\" is paused to disk: connect to resume it first");
    return not_found(id);
  }
  return snapshot_locked(*f->live, f->row, name, kind);
}

Result<std::pair<storage::SnapshotRow, storage::TemplateRow>> SandboxService::snapshot_locked(
    Live& live, const SandboxRow& r, const std::string& name, const char* kind) {
  const std::string& id = r.id;
  if (live.state != State::kRunning && live.state != State::kPaused)
    return conflict_error("sandbox \"" + id + "\" is busy (" + std::string(lifecycle::name(live.state)) + "); retry");
  Result<storage::TemplateRow> parent = files_of(r);
  if (!parent) return parent.error();
  nlohmann::json layers = nlohmann::json::parse(parent->layers, nullptr, false);
  if (!layers.is_array()) layers = nlohmann::json::array();
  // A microVM snapshot holds everything of the one it was restored from:
  // the new one replaces it on top of the file layers.
  if (rt_.snapshots_memory()) {
    nlohmann::json files = nlohmann::json::array();
    for (const nlohmann::json& l : layers)
      if (!l.is_string() || !runtime::is_vm_snapshot_layer(l.get<std::string>())) files.push_back(l);
    layers = std::move(files);
  }
  // Each snapshot of a snapshot adds a layer: the chain is bounded.
  if (layers.size() + 1 > runtime::kMaxTemplateLayers)
    return invalid_error("sandbox " + id + " runs files of " + std::to_string(layers.size()) +
                         " layers; a snapshot of it would pass " + std::to_string(runtime::kMaxTemplateLayers));
  std::string tid = new_sandbox_id();
  std::string dest = cfg_.snapshot_dir + "/" + kind + "-" + tid;
  if (Status s = sys::make_dirs(cfg_.snapshot_dir, 0700); !s) return s.error();
  uint64_t t0 = sys::monotonic_ns();
  // The copy freezes the sandbox while it reads the layer and thaws it
  // after (unless it was paused): the sandbox runs on.
  State was = live.state;
  enter(live, State::kSnapshotting);
  Status exported = live.sb->export_layer(dest);
  enter(live, was);
  if (!exported) {
    (void)sys::remove_tree(dest);
    return exported.error().with_context("snapshot of sandbox " + id);
  }
  layers.push_back(dest);
  int64_t now = clock_();
  storage::TemplateRow t = *parent;
  t.id = tid;
  t.name = name.empty() ? tid : name;
  t.tenant_id = r.tenant_id;
  t.status = "ready";
  t.layers = layers.dump();
  t.created_at = t.updated_at = now;
  t.is_public = false;
  t.build_id.reset();
  storage::SnapshotRow row{0, tid, r.tenant_id, id, kind, now, t.name, new_build_id()};
  storage::TemplateFileRow file{dest, r.tenant_id, storage::kFileLayer, tid,
                                static_cast<int64_t>(sys::disk_usage(dest)), now, now};
  Result<std::string> added = store_.add_snapshot(t, row, file, cfg_.template_max_bytes);
  if (!added) {
    (void)sys::remove_tree(dest);
    return added.error();
  }
  // A named snapshot may be a new build of an earlier one's template.
  row.template_id = t.id = *added;
  t.build_id = row.build_id;
  event(r.tenant_id, id, "snapshot",
        std::string(kind) + " " + tid + ": " + std::to_string(file.bytes >> 10) + " KiB in " +
            std::to_string((sys::monotonic_ns() - t0) / 1000000) + " ms");
  return std::make_pair(row, t);
}

Result<storage::SnapshotRow> SandboxService::snapshot(const std::string& tenant_id, const std::string& id,
                                                     const std::string& name, bool with_memory) {
  // A snapshot with memory asked for explicitly (the Python SDK's mode
  // "full") is refused where only files are kept, rather than silently
  // not done; microVM snapshots always keep it.
  if (with_memory && !rt_.snapshots_memory())
    return invalid_error("field 'memory': snapshots keep the sandbox's files only on the " + rt_.name() +
                         " backend (omit it, or use mode \"filesystem\")");
  Result<std::pair<storage::SnapshotRow, storage::TemplateRow>> s =
      make_snapshot(tenant_id, id, name, storage::kSnapshotKind);
  if (!s) return s.error();
  return s->first;
}

Result<std::vector<Result<SandboxRow>>> SandboxService::fork(const storage::TenantRow& tenant, const std::string& id,
                                                             int64_t count, int64_t timeout_s) {
  if (Status s = check_timeout(timeout_s); !s) return s.error();
  Result<Found> f = lookup(tenant.id, id);
  if (!f) return f.error();
  Result<std::optional<NetworkParams>> net = [&]() -> Result<std::optional<NetworkParams>> {
    MutexLock g(f->live->net_mu);
    return std::optional<NetworkParams>(f->live->network);
  }();
  // The forks' template: the parent's files now.
  Result<std::pair<storage::SnapshotRow, storage::TemplateRow>> snap =
      make_snapshot(tenant.id, id, "", storage::kForkKind);
  if (!snap) return snap.error();
  CreateParams p;
  p.template_ref = snap->second.id;
  p.timeout_s = timeout_s;
  p.auto_resume = f->row.auto_resume;
  p.network = **net;
  nlohmann::json md = nlohmann::json::parse(f->row.metadata, nullptr, false);
  if (md.is_object())
    for (auto it = md.begin(); it != md.end(); ++it)
      if (it->is_string()) p.metadata[it.key()] = it->get<std::string>();
  nlohmann::json env = nlohmann::json::parse(f->row.env_vars, nullptr, false);
  if (env.is_object())
    for (auto it = env.begin(); it != env.end(); ++it)
      if (it->is_string()) p.env_vars[it.key()] = it->get<std::string>();
  std::vector<Result<SandboxRow>> out;
  for (int64_t i = 0; i < count; ++i) out.push_back(create(tenant, p));
  // Hidden from now on; its files stay while a fork runs it (the
  // template-file collector keeps what live sandboxes run).
  if (Status s = store_.set_template_status(snap->second.id, "deleted", clock_()); !s)
    LOG_WARN("fork of " << id << ": hide its snapshot " << snap->second.id << ": " << s.error().message());
  return out;
}

Status SandboxService::set_timeout(const std::string& tenant_id, const std::string& id, int64_t timeout_s) {
  if (Status s = check_timeout(timeout_s); !s) return s.error();
  Result<SandboxRow> row = get(tenant_id, id);
  if (!row) return row.error();
  return store_.set_end_at(id, clock_() + timeout_s);
}

MetricSample SandboxService::sample(Live& live, const runtime::Usage& u, uint64_t pool_bytes) {
  uint64_t mono = sys::monotonic_ns();
  MetricSample m;
  m.unix_s = clock_();
  m.cpu_usage_ns = u.cpu_usage_ns;
  m.usage = u;
  m.pool_bytes = pool_bytes;
  MutexLock g(live.samples_mu);
  uint64_t prev_cpu = live.last_cpu_ns, prev_mono = live.last_mono_ns;
  if (prev_mono == 0) {
    // First reading: average over the sandbox's life so far.
    prev_mono = mono - static_cast<uint64_t>(std::max<int64_t>(1, m.unix_s - live.started_at)) * 1000000000ull;
    prev_cpu = 0;
  }
  // Percent of the sandbox's own CPUs, as E2B reports it.
  double cpus = live.cpu_count;
  double wall = static_cast<double>(mono - prev_mono);
  if (wall > 0 && u.cpu_usage_ns >= prev_cpu)
    m.cpu_used_pct = 100.0 * static_cast<double>(u.cpu_usage_ns - prev_cpu) / wall / cpus;
  live.last_cpu_ns = u.cpu_usage_ns;
  live.last_mono_ns = mono;
  return m;
}

Result<std::vector<MetricSample>> SandboxService::metrics(const std::string& tenant_id, const std::string& id,
                                                          std::optional<int64_t> start, std::optional<int64_t> end) {
  Result<SandboxRow> row = get(tenant_id, id);
  if (!row) return row.error();
  std::shared_ptr<Live> live = find_live(id);
  if (!live) return not_found(id);
  std::vector<MetricSample> out;
  {
    MutexLock g(live->samples_mu);
    for (const MetricSample& m : live->samples)
      if ((!start || m.unix_s >= *start) && (!end || m.unix_s <= *end)) out.push_back(m);
  }
  int64_t now = clock_();
  if ((!start || now >= *start) && (!end || now <= *end)) {
    MutexLock g(live->op_mu);
    if (live->sb) {
      Result<runtime::Usage> u = live->sb->usage();
      if (!u) return u.error().with_context("metrics of sandbox " + id);
      out.push_back(sample(*live, *u, memory_ ? memory_->pool_bytes(id) : 0));
    }
  }
  return out;
}

void SandboxService::tick() {
  int64_t now = clock_();
  sweep_timeouts(now);
  retry_deferred();
  // Sandboxes whose memory the engine could not restore.
  if (memory_)
    for (auto& [id, why] : memory_->take_lost()) {
      Status s = kill_lost(id, "guest memory could not be restored: " + why);
      if (!s && s.error().kind() != ErrorKind::kNotFound) LOG_ERROR("sandbox " << id << ": " << s.error().message());
    }
  std::vector<std::pair<std::string, std::shared_ptr<Live>>> all;
  {
    MutexLock g(mu_);
    all.assign(live_.begin(), live_.end());
  }
  sweep_revoked(all);
  sweep_liveness(all, now);
}

// 1. Timeouts: kill, or pause with onTimeout=pause.
void SandboxService::sweep_timeouts(int64_t now) {
  Result<std::vector<SandboxRow>> expired = store_.list_expired(now);
  if (!expired) {
    LOG_WARN("timeout sweep: " << expired.error().message());
  } else {
    for (const SandboxRow& r : *expired) {
      std::shared_ptr<Live> live = find_live(r.id);
      if (!live) {
        (void)store_.finish(r.id, storage::kStateKilled, "timeout", now);
        continue;
      }
      if (!live->op_mu.try_lock()) continue;  // busy (an offload): the next tick acts on it
      MutexLock g(live->op_mu, std::adopt_lock);
      if (!live->sb) continue;
      if ((r.on_timeout == storage::kOnTimeoutPauseFiles || r.on_timeout == "pause") && live->state == State::kRunning &&
          pauses_to_disk(r.on_timeout != storage::kOnTimeoutPauseFiles)) {
        if (Status s = persist_locked(*live, r); !s)
          LOG_WARN("pause sandbox " << r.id << " to disk at timeout: " << s.error().message() << "; retried next tick");
        continue;
      }
      if (r.on_timeout == "pause" || r.on_timeout == storage::kOnTimeoutPauseFiles) {
        if (live->state == State::kPaused) continue;
        if (Status s = live->sb->pause(); !s) {
          LOG_ERROR("pause sandbox " << r.id << " at timeout: " << s.error().message());
          (void)kill_locked(*live, r.id, r.tenant_id, State::kKilled, "timeout (pause failed)");
          continue;
        }
        Result<bool> moved = move(*live, r.id, State::kPaused);
        if (moved && *moved) {
          event(r.tenant_id, r.id, "paused", "timeout reached, lifecycle onTimeout=pause");
        } else {
          // Not recorded: the next tick tries again; until then it runs.
          if (live->state == State::kRunning) (void)live->sb->resume();
          if (!moved) LOG_WARN("pause sandbox " << r.id << " at timeout: " << moved.error().message());
        }
      } else {
        (void)kill_locked(*live, r.id, r.tenant_id, State::kKilled, "timeout reached");
        LOG_INFO("sandbox " << r.id << " killed: timeout reached");
      }
    }
  }
}

// Ends that could not be recorded when they happened (a full disk), and
// ended sandboxes whose runtime kill failed: again, until it works.
void SandboxService::retry_deferred() {
  // Ends that could not be recorded when they happened (a full disk).
  std::vector<Unrecorded> unrecorded;
  {
    MutexLock g(lost_mu_);
    unrecorded.swap(unrecorded_);
  }
  for (Unrecorded& u : unrecorded) {
    Result<bool> done = store_.finish(u.id, u.state, u.reason, u.at);
    if (!done) {
      MutexLock g(lost_mu_);
      unrecorded_.push_back(std::move(u));
      continue;
    }
    if (*done) event(u.tenant_id, u.id, u.state, u.reason);
  }
  // Ended sandboxes whose kill failed: again, until it works.
  std::vector<std::pair<std::string, std::unique_ptr<runtime::Sandbox>>> unkilled;
  {
    MutexLock g(lost_mu_);
    unkilled.swap(unkilled_);
  }
  for (auto& [id, sb] : unkilled) {
    if (Status k = sb->kill(); !k) {
      MutexLock g(lost_mu_);
      unkilled_.emplace_back(id, std::move(sb));
      continue;
    }
    LOG_INFO("sandbox " << id << ": killed at last");
  }
}

// Revoked tenants (`sandgate tenant revoke`, possibly from another
// process): their sandboxes end now, not at their timeouts.
void SandboxService::sweep_revoked(const std::vector<std::pair<std::string, std::shared_ptr<Live>>>& all) {
  std::map<std::string, bool> revoked;
  for (auto& [id, live] : all) {
    auto [it, fresh] = revoked.try_emplace(live->tenant_id, false);
    if (!fresh) continue;
    Result<std::optional<storage::TenantRow>> t = store_.find_tenant(live->tenant_id);
    it->second = t && *t && (*t)->disabled;
  }
  for (auto& [id, live] : all) {
    if (!revoked[live->tenant_id]) continue;
    before_traffic(id);  // a running offload stops first
    MutexLock g(live->op_mu);
    if (!live->sb && live->state != State::kPersisted) continue;
    (void)kill_locked(*live, id, live->tenant_id, State::kKilled, "its tenant was revoked");
    LOG_INFO("sandbox " << id << " killed: tenant " << live->tenant_id << " was revoked");
  }
}

// 2. Liveness, M(t) every second, and 3. metric samples every 5 s.
void SandboxService::sweep_liveness(const std::vector<std::pair<std::string, std::shared_ptr<Live>>>& all,
                                    int64_t now) {
  bool take_samples = now - last_sample_s_ >= 5;
  if (take_samples) last_sample_s_ = now;
  for (auto& [id, live] : all) {
    // A sandbox busy with a long operation (an offload) is looked at on a
    // later tick: one sandbox must not hold up the sweep of the others.
    if (!live->op_mu.try_lock()) continue;
    MutexLock g(live->op_mu, std::adopt_lock);
    if (!live->sb) continue;
    if (!live->sb->alive()) {
      LOG_WARN("sandbox " << id << " died: its PID 1 exited");
      (void)kill_locked(*live, id, live->tenant_id, State::kLost, "the sandbox's processes exited");
      continue;
    }
    // One reading a second: M(t) (resident memory, i.e. cgroup or the
    // VMM's RSS, + pool bytes), and every 5 s a metric sample from it.
    Result<runtime::Usage> u = live->sb->usage();
    if (!u) continue;
    uint64_t pool = memory_ ? memory_->pool_bytes(id) : 0;
    live->mem_now.store(u->mem_used_bytes + pool, std::memory_order_relaxed);
    if (idle_enabled()) watch_idle(id, *live, u->cpu_usage_ns);
    if (take_samples) {
      MetricSample m = sample(*live, *u, pool);
      MutexLock sg(live->samples_mu);
      live->samples.push_back(m);
      while (live->samples.size() > 720) live->samples.pop_front();
    }
  }}

Result<WarmPool::Entry> SandboxService::make_pooled(const WarmPool::Recipe& r) {
  CreateParams p;
  p.template_ref = r.tpl.id;
  SandboxRow row = new_row(r.tenant, r.tpl, p);
  runtime::SandboxSpec spec = new_spec(row, r.tpl, p);
  Result<std::unique_ptr<runtime::Sandbox>> sb = rt_.create(spec);
  if (!sb) return sb.error();
  if (Status s = run_start_command(**sb, row.envd_token, spec, r.tpl); !s) {
    if (Status k = (*sb)->kill(); !k) {
      MutexLock g(lost_mu_);
      unkilled_.emplace_back(row.id, std::move(*sb));
    }
    return s.error();
  }
  return WarmPool::Entry{row.id, std::move(*sb)};
}

void SandboxService::count_creating(const std::string& tenant_id, int64_t delta) {
  MutexLock g(lost_mu_);
  if ((creating_[tenant_id] += delta) <= 0) creating_.erase(tenant_id);
}

bool SandboxService::pool_admits(const WarmPool::Recipe& r, size_t pooled_for_tenant) {
  Result<std::vector<SandboxRow>> live = store_.list_live();
  if (!live) return false;
  int64_t in_flight = 0;
  {
    MutexLock g(lost_mu_);
    auto it = creating_.find(r.tenant.id);
    if (it != creating_.end()) in_flight = it->second;
  }
  // What the pool holds, this one, and the creates whose rows are not in yet.
  int64_t count = static_cast<int64_t>(pooled_for_tenant) + 1 + in_flight;
  int64_t mb = count * r.tpl.memory_mb;
  for (const SandboxRow& s : *live)
    if (s.tenant_id == r.tenant.id) {
      ++count;
      mb += s.memory_mb;
    }
  // Room for what the pool would hold and one more create beside it.
  return count + 1 <= r.tenant.max_sandboxes && mb + r.tpl.memory_mb <= r.tenant.max_memory_mb;
}

Status SandboxService::hand_over(runtime::Sandbox& sb, const SandboxRow& row, const runtime::SandboxSpec& spec) {
  if (!sb.alive()) return Error(ErrorKind::kUnavailable, "it is not running");
  nlohmann::json env = nlohmann::json::object();
  for (const auto& [k, v] : spec.env) env[k] = v;
  nlohmann::json req = {{"type", "configure"}, {"sandboxId", row.id}, {"envdAccessToken", row.envd_token}, {"env", env}};
  Result<std::string> r = sb.control(req.dump(), std::chrono::milliseconds(10000));
  if (!r) return r.error();
  nlohmann::json reply = nlohmann::json::parse(*r, nullptr, false);
  if (!reply.is_object() || reply.value("type", "") != "configured")
    return internal_error("the agent refused configure: " + r->substr(0, 200));
  return Status::Ok();
}

WarmPool::Stats SandboxService::warm_pool_stats() { return pool_ ? pool_->stats() : WarmPool::Stats{}; }

void SandboxService::shutdown() {
  // The pool first: its thread starts sandboxes through this service. The
  // idle offloads' thread pages out through it.
  if (pool_) pool_->stop();
  stop_idle();
  std::vector<std::pair<std::string, std::shared_ptr<Live>>> all;
  {
    MutexLock g(mu_);
    all.assign(live_.begin(), live_.end());
  }
  size_t left = 0;
  for (auto& [id, live] : all) {
    MutexLock g(live->op_mu);
    if (!live->sb) continue;
    if (rt_.sandboxes_outlive_host()) {
      // Left running for the next start to take back (recover()): the
      // handle goes, closing the channel; the row keeps its state.
      live->sb.reset();
      ++left;
      continue;
    }
    (void)kill_locked(*live, id, live->tenant_id, State::kLost, "sandgate stopped: its sandboxes end with it");
  }
  if (left) LOG_INFO(left << " sandboxes left running for the next start of sandgate");
  // A last try for the ones whose kill kept failing; what is left then is
  // the runtime's cleanup_stale() at the next start.
  MutexLock g(lost_mu_);
  for (auto& [id, sb] : unkilled_)
    if (Status k = sb->kill(); !k) LOG_ERROR("sandbox " << id << " left behind: " << k.error().message());
  unkilled_.clear();
}

}  // namespace sg::lifecycle
