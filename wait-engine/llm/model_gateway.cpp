// ModelGateway: wiring of the model proxy and the wait coordinator.
#include "wait-engine/llm/model_gateway.h"

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "sandbox-runtime/lifecycle/sandbox_service.h"
#include "wait-engine/coordinator/coordinator.h"
#include "wait-engine/llm/proxy.h"
#include "wait-engine/memory/offload.h"
#include "wait-engine/memory/pressure.h"
#include "wait-engine/metrics/histogram.h"
#include "storage/store.h"
#include "base/log.h"
#include "base/sys.h"
#include "tenancy/api_key.h"
#include "tenancy/llm_keys.h"
#include "tenancy/rate_limiter.h"
#include "tenancy/token_budget.h"

namespace sg::llm {

namespace {

// A small time-bounded cache (authentication and upstream lookups hit
// SQLite otherwise on every model request).
template <class V>
class TtlCache {
 public:
  explicit TtlCache(uint64_t ttl_ns, size_t max) : ttl_(ttl_ns), max_(max) {}
  std::optional<V> get(const std::string& k) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = map_.find(k);
    if (it == map_.end() || sys::monotonic_ns() - it->second.at > ttl_) return std::nullopt;
    return it->second.v;
  }
  void put(const std::string& k, V v) {
    std::lock_guard<std::mutex> g(mu_);
    if (map_.size() >= max_) map_.clear();
    map_[k] = {std::move(v), sys::monotonic_ns()};
  }

 private:
  struct E {
    V v;
    uint64_t at;
  };
  uint64_t ttl_;
  size_t max_;
  std::mutex mu_;
  std::unordered_map<std::string, E> map_;  // GUARDED_BY(mu_)
};

std::vector<std::string> split_ids(const std::string& v) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i <= v.size()) {
    size_t j = v.find(',', i);
    if (j == std::string::npos) j = v.size();
    std::string id = v.substr(i, j - i);
    while (!id.empty() && id.front() == ' ') id.erase(id.begin());
    while (!id.empty() && id.back() == ' ') id.pop_back();
    out.push_back(id);
    i = j + 1;
  }
  return out;
}

}  // namespace

struct ModelGateway::Impl {
  ModelGatewayConfig cfg;
  storage::Store& store;
  lifecycle::SandboxService& sandboxes;
  tenancy::LlmKeys keys{store};
  std::optional<llm::Upstream> flag_openai, flag_anthropic;
  tenancy::RateLimiter request_limit;
  tenancy::TokenBudget token_budget;
  TtlCache<std::string> key_cache{5'000'000'000ull, 10000};  // key hash -> tenant id
  TtlCache<std::optional<llm::Upstream>> upstream_cache{2'000'000'000ull, 10000};
  std::unique_ptr<wait::WaitCoordinator> coordinator;
  std::unique_ptr<llm::ModelProxy> proxy;
  memory::MemoryEngine* memory = nullptr;
  // --memory-offload auto: on under 20% MemAvailable, off over 30%.
  memory::PressureGate pressure{0.2, 0.3};

  // The writer: usage rows and transition events, batched.
  std::mutex w_mu;
  std::condition_variable w_cv;
  std::vector<storage::LlmUsageRow> usage_q;  // GUARDED_BY(w_mu)
  std::vector<storage::EventRow> event_q;     // GUARDED_BY(w_mu)
  bool w_stop = false;                         // GUARDED_BY(w_mu)
  std::thread writer;
  static constexpr size_t kMaxQueued = 100000;

  Impl(const ModelGatewayConfig& c, storage::Store& s, lifecycle::SandboxService& sb)
      : cfg(c),
        store(s),
        sandboxes(sb),
        request_limit(c.requests_per_s, c.requests_per_s * 2, [] { return sys::monotonic_ns(); }),
        token_budget(c.tokens_per_min, [] { return sys::monotonic_ns(); }) {}

  ~Impl() {
    // The proxy and coordinator first (no more rows), then the writer.
    proxy.reset();
    coordinator.reset();
    {
      std::lock_guard<std::mutex> g(w_mu);
      w_stop = true;
    }
    w_cv.notify_all();
    if (writer.joinable()) writer.join();
  }

  void write_loop() {
    for (;;) {
      std::vector<storage::LlmUsageRow> u;
      std::vector<storage::EventRow> e;
      {
        std::unique_lock<std::mutex> l(w_mu);
        w_cv.wait(l, [&] { return w_stop || !usage_q.empty() || !event_q.empty(); });
        // Gather a batch (one SQLite transaction for many rows), at most 20 ms.
        w_cv.wait_for(l, std::chrono::milliseconds(20),
                      [&] { return w_stop || usage_q.size() + event_q.size() >= 512; });
        u.swap(usage_q);
        e.swap(event_q);
        if (u.empty() && e.empty() && w_stop) return;
      }
      if (!u.empty())
        if (Status s = store.insert_llm_usage(u); !s) LOG_ERROR("model usage: " << s.error().message());
      if (!e.empty())
        if (Status s = store.add_events(e); !s) LOG_ERROR("wait events: " << s.error().message());
    }
  }

  void queue_usage(const llm::UsageRecord& r) {
    storage::LlmUsageRow row;
    row.at_ms = r.at_ms;
    row.tenant_id = r.tenant_id;
    row.sandbox_id = r.sandbox_id;
    row.provider = llm::provider_name(r.provider);
    row.route = r.route;
    row.model = r.model;
    row.stream = r.stream;
    row.status = r.status;
    row.outcome = r.outcome;
    row.input_tokens = r.usage.input;
    row.output_tokens = r.usage.output;
    row.cache_read_tokens = r.usage.cache_read;
    row.cache_write_tokens = r.usage.cache_write;
    row.usage_found = r.usage.found;
    row.duration_ms = r.duration_ms;
    row.wait_paused_ms = r.wait_paused_ms;
    {
      std::lock_guard<std::mutex> g(w_mu);
      if (usage_q.size() >= kMaxQueued) {
        LOG_WARN("model usage queue full: a row is dropped");
        return;
      }
      usage_q.push_back(std::move(row));
      if (usage_q.size() + event_q.size() != 1 && usage_q.size() + event_q.size() < 512) return;
    }
    w_cv.notify_one();
  }

  void queue_transition(const std::string& sandbox, const wait::Transition& t) {
    storage::EventRow e;
    e.at = sys::unix_seconds();
    e.sandbox_id = sandbox;
    if (Result<std::string> tenant = sandboxes.live_tenant(sandbox)) e.tenant_id = *tenant;
    e.kind = "wait";
    nlohmann::json d = {{"from", wait::state_name(t.from)},
                        {"to", wait::state_name(t.to)},
                        {"reason", t.reason},
                        {"mono_ns", t.at}};
    e.detail = d.dump();
    {
      std::lock_guard<std::mutex> g(w_mu);
      if (event_q.size() >= kMaxQueued) return;
      event_q.push_back(std::move(e));
      if (usage_q.size() + event_q.size() != 1 && usage_q.size() + event_q.size() < 512) return;
    }
    w_cv.notify_one();
  }

  // cache_only: answer only from memory (nullopt when SQLite is needed).
  std::optional<Result<llm::Caller>> authenticate(const http::HttpRequest& req, bool cache_only) {
    llm::Caller c;
    if (!req.bound_sandbox.empty()) {
      // The channel is the credential: the sandbox's tenant, this sandbox.
      Result<std::string> tenant = sandboxes.live_tenant(req.bound_sandbox);
      if (!tenant) return Result<llm::Caller>(Error(ErrorKind::kUnauthorized, "the sandbox is not running"));
      c.tenant_id = *tenant;
      c.sandboxes.push_back(req.bound_sandbox);
      return Result<llm::Caller>(c);
    }
    std::string key = llm::presented_key(req);
    if (key.empty())
      return Result<llm::Caller>(Error(ErrorKind::kUnauthorized,
                   "missing API key: pass a sandgate model key (sk-sg-...) as Authorization: Bearer or x-api-key"));
    std::string hash = tenancy::hash_api_key(key);
    if (std::optional<std::string> t = key_cache.get(hash)) {
      c.tenant_id = *t;
    } else {
      if (cache_only) return std::nullopt;
      Result<storage::TenantRow> who = keys.authenticate(key);
      if (!who) return Result<llm::Caller>(who.error());
      c.tenant_id = who->id;
      key_cache.put(hash, who->id);
    }
    std::string bind = req.header(llm::kBindHeader);
    if (!bind.empty()) {
      std::vector<std::string> ids = split_ids(bind);
      if (ids.size() > 64) return Result<llm::Caller>(invalid_error("X-Sandgate-Sandbox names more than 64 sandboxes"));
      for (const std::string& id : ids) {
        if (id.empty() || id.size() > 64) return Result<llm::Caller>(invalid_error("X-Sandgate-Sandbox: malformed sandbox id list"));
        Result<std::string> tenant = sandboxes.live_tenant(id);
        // Another tenant's sandbox reads exactly like a missing one.
        if (!tenant || *tenant != c.tenant_id)
          return Result<llm::Caller>(not_found_error("X-Sandgate-Sandbox: sandbox \"" + id.substr(0, 64) + "\" is not running"));
        c.sandboxes.push_back(id);
      }
    }
    return Result<llm::Caller>(c);
  }

  std::optional<Result<std::optional<llm::Upstream>>> upstream(const std::string& tenant_id, llm::Provider p,
                                                               bool cache_only) {
    std::string ck = tenant_id + "\n" + llm::provider_name(p);
    if (auto hit = upstream_cache.get(ck)) return Result<std::optional<llm::Upstream>>(*hit);
    if (cache_only) return std::nullopt;
    Result<std::optional<storage::UpstreamRow>> row = store.find_upstream(tenant_id, llm::provider_name(p));
    if (!row) return row.error();
    std::optional<llm::Upstream> out;
    if (*row) {
      Result<tenancy::BaseUrl> u = tenancy::parse_base_url((*row)->base_url);
      if (!u) return Result<std::optional<llm::Upstream>>(u.error().with_context("stored upstream base URL"));
      out = llm::Upstream{p, u->tls, u->host, u->port, u->path_prefix, (*row)->api_key};
    } else {
      out = p == llm::Provider::kAnthropic ? flag_anthropic : flag_openai;
    }
    upstream_cache.put(ck, out);
    return Result<std::optional<llm::Upstream>>(out);
  }
};

ModelGateway::ModelGateway(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ModelGateway::~ModelGateway() = default;

Result<std::unique_ptr<ModelGateway>> ModelGateway::create(const ModelGatewayConfig& cfg, storage::Store& store,
                                                           lifecycle::SandboxService& sandboxes,
                                                           memory::MemoryEngine* memory) {
  auto m = std::make_unique<Impl>(cfg, store, sandboxes);
  m->memory = memory;
  auto flag = [](const std::string& url, const std::string& key_file, llm::Provider p,
                 std::optional<llm::Upstream>& out) -> Status {
    if (url.empty()) return Status::Ok();
    Result<tenancy::BaseUrl> u = tenancy::parse_base_url(url);
    if (!u) return u.error().with_context(std::string("--") + llm::provider_name(p) + "-base-url");
    std::string key;
    if (!key_file.empty()) {
      Result<std::string> k = tenancy::read_upstream_key_file(key_file);
      if (!k) return k.error();
      key = *k;
    }
    out = llm::Upstream{p, u->tls, u->host, u->port, u->path_prefix, key};
    return Status::Ok();
  };
  if (Status s = flag(cfg.openai_base_url, cfg.openai_key_file, llm::Provider::kOpenAI, m->flag_openai); !s)
    return s.error();
  if (Status s = flag(cfg.anthropic_base_url, cfg.anthropic_key_file, llm::Provider::kAnthropic, m->flag_anthropic); !s)
    return s.error();

  Impl* im = m.get();
  if (cfg.pause) {
    wait::CoordinatorConfig cc;
    cc.wait.grace_ns = static_cast<uint64_t>(cfg.grace_ms) * 1000000ull;
    cc.wait.cooldown_ns = static_cast<uint64_t>(cfg.cooldown_ms) * 1000000ull;
    wait::CoordinatorHooks hooks;
    hooks.pause = [im](const std::string& id) { return im->sandboxes.wait_pause(id); };
    hooks.resume = [im](const std::string& id) { return im->sandboxes.wait_resume(id); };
    hooks.idle = [im](const std::string& id) { return im->sandboxes.wait_idle(id, std::chrono::milliseconds(500)); };
    hooks.transition = [im](const std::string& id, const wait::Transition& t) { im->queue_transition(id, t); };
    hooks.kill = [im](const std::string& id) {
      Status s = im->sandboxes.kill_lost(id, "could not be resumed after a model-wait pause");
      if (!s && s.error().kind() != ErrorKind::kNotFound)
        LOG_ERROR("sandbox " << id << ": kill after a failed resume: " << s.error().message());
    };
    if (memory && cfg.memory_offload != "off") {
      cc.wait.offload_enabled = true;
      cc.wait.offload_min_remaining_ns = static_cast<uint64_t>(cfg.offload_min_wait_ms) * 1000000ull;
      hooks.offload = [im](const std::string& id, const std::atomic<bool>& cancel) {
        return im->sandboxes.wait_offload(id, cancel);
      };
      if (cfg.memory_offload == "auto") {
        hooks.offload_wanted = [im] {
          Result<memory::HostMemory> h = memory::read_host_memory();
          return h ? im->pressure.update(h->available, h->total) : im->pressure.on();
        };
      }
    }
    m->coordinator = std::make_unique<wait::WaitCoordinator>(cc, std::move(hooks), [] { return sys::monotonic_ns(); });
    wait::WaitCoordinator* co = m->coordinator.get();
    sandboxes.set_wait_hooks(
        [co](const std::string& id) {
          if (Status s = co->ensure_running(id, std::chrono::milliseconds(10000)); !s)
            LOG_WARN("sandbox " << id << ": " << s.error().message());
        },
        [co](const std::string& id) { co->forget(id); });
  }

  llm::ProxyDeps deps;
  deps.authenticate = [im](const http::HttpRequest& req, llm::Provider) { return *im->authenticate(req, false); };
  deps.upstream = [im](const std::string& tenant, llm::Provider p) { return *im->upstream(tenant, p, false); };
  deps.resolve_fast = [im](const http::HttpRequest& req, llm::Provider p) -> std::optional<llm::Resolved> {
    std::optional<Result<llm::Caller>> c = im->authenticate(req, true);
    if (!c) return std::nullopt;
    if (!*c) return llm::Resolved{std::move(*c), Result<std::optional<llm::Upstream>>(std::nullopt)};
    std::optional<Result<std::optional<llm::Upstream>>> u = im->upstream((*c)->tenant_id, p, true);
    if (!u) return std::nullopt;
    return llm::Resolved{std::move(*c), std::move(*u)};
  };
  deps.record = [im](llm::UsageRecord r) { im->queue_usage(r); };
  deps.admit_request = [im](const std::string& tenant) { return im->request_limit.acquire(tenant); };
  deps.admit_tokens = [im](const std::string& tenant) { return im->token_budget.admit(tenant); };
  deps.charge_tokens = [im](const std::string& tenant, uint64_t n) { im->token_budget.charge(tenant, n); };
  deps.key_well_formed = [](std::string_view key) { return tenancy::is_well_formed_llm_key(key); };
  deps.coordinator = m->coordinator.get();
  m->proxy = std::make_unique<llm::ModelProxy>(llm::ProxyConfig{}, std::move(deps));
  m->writer = std::thread([im] { im->write_loop(); });
  return std::unique_ptr<ModelGateway>(new ModelGateway(std::move(m)));
}

void ModelGateway::shutdown() {
  impl_->proxy->shutdown();
  // Pending deliveries are released (posted to the stopped io_context).
  impl_->coordinator.reset();
}

http::StreamHooks ModelGateway::hooks() { return impl_->proxy->hooks(impl_->cfg.body_limit); }

std::string ModelGateway::metrics() {
  std::string out;
  impl_->proxy->render_metrics(out);
  // (The coordinator is gone only after shutdown(), when no request comes.)
  if (impl_->coordinator) impl_->coordinator->render_metrics(out);
  if (impl_->memory) {
    impl_->memory->render_metrics(out);
    metrics::render_count(out, "sandgate_memory_pressure", "gauge",
                          "Whether host memory pressure has turned offloading on (auto mode).",
                          impl_->pressure.on() ? 1 : 0);
  }
  // M(t) over every live sandbox: resident memory + pool bytes, sampled
  // every second.
  metrics::render_count(out, "sandgate_sandboxes_memory_bytes", "gauge",
                        "Resident memory of all sandboxes plus their pool bytes.", impl_->sandboxes.memory_in_use());
  return out;
}

}  // namespace sg::llm
