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
#include "storage/batch_writer.h"
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
  storage::BatchWriter& rows;
  std::unique_ptr<llm::ModelProxy> proxy;
  memory::MemoryEngine* memory = nullptr;
  const memory::PressureGate* pressure = nullptr;

  Impl(const ModelGatewayConfig& c, storage::Store& s, lifecycle::SandboxService& sb, storage::BatchWriter& w)
      : cfg(c),
        store(s),
        sandboxes(sb),
        rows(w),
        request_limit(c.requests_per_s, c.requests_per_s * 2, [] { return sys::monotonic_ns(); }),
        token_budget(c.tokens_per_min, [] { return sys::monotonic_ns(); }) {}

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
    rows.add_usage(std::move(row));
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
                                                           storage::BatchWriter& rows, memory::MemoryEngine* memory,
                                                           const memory::PressureGate* pressure) {
  auto m = std::make_unique<Impl>(cfg, store, sandboxes, rows);
  m->memory = memory;
  m->pressure = pressure;
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
  deps.coordinator = sandboxes.waits();
  m->proxy = std::make_unique<llm::ModelProxy>(llm::ProxyConfig{}, std::move(deps));
  return std::unique_ptr<ModelGateway>(new ModelGateway(std::move(m)));
}

void ModelGateway::shutdown() { impl_->proxy->shutdown(); }

http::StreamHooks ModelGateway::hooks() { return impl_->proxy->hooks(impl_->cfg.body_limit); }

std::string ModelGateway::metrics() {
  std::string out;
  impl_->proxy->render_metrics(out);
  // (The coordinator is gone only after shutdown, when no request comes.)
  if (wait::WaitCoordinator* co = impl_->sandboxes.waits()) co->render_metrics(out);
  if (impl_->memory) {
    impl_->memory->render_metrics(out);
    metrics::render_count(out, "sandgate_memory_pressure", "gauge",
                          "Whether host memory pressure has turned offloading on (auto mode).",
                          impl_->pressure && impl_->pressure->on() ? 1 : 0);
  }
  impl_->sandboxes.render_swap_metrics(out);
  // M(t) over every live sandbox: resident memory + pool bytes, sampled
  // every second.
  metrics::render_count(out, "sandgate_sandboxes_memory_bytes", "gauge",
                        "Resident memory of all sandboxes plus their pool bytes.", impl_->sandboxes.memory_in_use());
  // The warm pool (sandbox-runtime/lifecycle/warm_pool.h): what it holds,
  // and how creates of hot templates were served.
  lifecycle::WarmPool::Stats wp = impl_->sandboxes.warm_pool_stats();
  struct Count {
    const char* name;
    const char* type;
    const char* help;
    uint64_t value;
  };
  for (const Count& c : {
           Count{"sandgate_warm_pool_sandboxes", "gauge", "Sandboxes started ahead of creates, ready to be taken.", wp.ready},
           Count{"sandgate_warm_pool_starting", "gauge", "Warm pool sandboxes being started now.", wp.starting},
           Count{"sandgate_warm_pool_taken_total", "counter", "Creates served by a sandbox from the warm pool.", wp.taken},
           Count{"sandgate_warm_pool_missed_total", "counter",
                 "Creates of a pooled template that found no sandbox ready and started one.", wp.missed},
           Count{"sandgate_warm_pool_started_total", "counter", "Sandboxes the warm pool started.", wp.made},
           Count{"sandgate_warm_pool_failed_total", "counter", "Warm pool sandboxes that failed to start.", wp.failed},
           Count{"sandgate_warm_pool_dropped_total", "counter",
                 "Warm pool sandboxes killed unused (their template went idle).", wp.dropped},
       })
    metrics::render_count(out, c.name, c.type, c.help, c.value);
  return out;
}

}  // namespace sg::llm
