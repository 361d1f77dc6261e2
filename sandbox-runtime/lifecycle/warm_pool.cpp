// WarmPool (warm_pool.h): a map of per-key pools and one refill thread.
#include "sandbox-runtime/lifecycle/warm_pool.h"

#include "base/log.h"

namespace sg::lifecycle {

WarmPool::WarmPool(WarmPoolConfig cfg, Make make, Admit admit, Clock clock, Park park)
    : cfg_(cfg), make_(std::move(make)), admit_(std::move(admit)), clock_(std::move(clock)), park_(std::move(park)) {
  if (cfg_.per_key > 0) thread_ = std::thread([this] { run(); });
}

WarmPool::~WarmPool() { stop(); }

std::string WarmPool::key_of(const std::string& tenant_id, const storage::TemplateRow& t) {
  return tenant_id + "\n" + t.id + "\n" + t.rootfs_path + "\n" + t.layers + "\n" + t.config + "\n" +
         std::to_string(t.cpu_count) + "c" + std::to_string(t.memory_mb) + "m" + std::to_string(t.disk_size_mb) + "d";
}

std::optional<WarmPool::Entry> WarmPool::take(const std::string& key, const Recipe& recipe) {
  if (cfg_.per_key == 0) return std::nullopt;
  std::vector<Entry> dead;
  std::optional<Entry> got;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (stopping_) return std::nullopt;
    Pool& p = pools_[key];
    p.recipe = recipe;
    p.last_use = clock_();
    while (!p.ready.empty() && !got) {
      Entry e = std::move(p.ready.front());
      p.ready.pop_front();
      if (e.sb && e.sb->alive()) {
        got = std::move(e);
      } else {
        dead.push_back(std::move(e));
      }
    }
    if (got) ++stats_.taken;
    else ++stats_.missed;
  }
  cv_.notify_all();
  kill_all(dead);
  return got;
}

std::string WarmPool::next_wanted(int64_t now, size_t* pooled_for_tenant) {
  for (auto& [key, p] : pools_) {
    if (p.ready.size() + p.making >= cfg_.per_key || now < p.retry_at) continue;
    size_t n = 0;
    for (auto& [k2, q] : pools_)
      if (q.recipe.tenant.id == p.recipe.tenant.id) n += q.ready.size() + q.making;
    *pooled_for_tenant = n;
    return key;
  }
  return "";
}

void WarmPool::run() {
  std::unique_lock<std::mutex> g(mu_);
  while (!stopping_) {
    int64_t now = clock_();
    // Keys nobody created from for `idle` go, with their sandboxes.
    std::vector<Entry> idle;
    for (auto it = pools_.begin(); it != pools_.end();) {
      if (it->second.making == 0 && now - it->second.last_use >= cfg_.idle.count()) {
        for (Entry& e : it->second.ready) idle.push_back(std::move(e));
        stats_.dropped += it->second.ready.size();
        it = pools_.erase(it);
      } else {
        ++it;
      }
    }
    if (!idle.empty()) {
      g.unlock();
      kill_all(idle);
      g.lock();
      continue;
    }
    size_t pooled = 0;
    std::string key = next_wanted(now, &pooled);
    if (key.empty()) {
      cv_.wait_for(g, std::chrono::seconds(1));
      continue;
    }
    Pool& p = pools_[key];
    Recipe recipe = p.recipe;
    ++p.making;
    g.unlock();
    bool admitted = admit_(recipe, pooled);
    Result<Entry> made = admitted ? make_(recipe) : Result<Entry>(Error(ErrorKind::kQuota, "no room"));
    g.lock();
    auto it = pools_.find(key);
    if (it != pools_.end()) --it->second.making;
    if (!made) {
      if (admitted) {
        ++stats_.failed;
        LOG_WARN("warm pool: starting a sandbox of template " << recipe.tpl.name << " for tenant "
                                                              << recipe.tenant.name << ": " << made.error().message());
      }
      if (it != pools_.end()) it->second.retry_at = clock_() + cfg_.retry_after_failure.count();
      continue;
    }
    ++stats_.made;
    if (stopping_ || it == pools_.end()) {
      std::vector<Entry> extra;
      extra.push_back(std::move(*made));
      g.unlock();
      kill_all(extra);
      g.lock();
      continue;
    }
    it->second.ready.push_back(std::move(*made));
  }
}

void WarmPool::stop() {
  std::vector<Entry> all;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  {
    std::lock_guard<std::mutex> g(mu_);
    for (auto& [key, p] : pools_)
      for (Entry& e : p.ready) all.push_back(std::move(e));
    pools_.clear();
  }
  kill_all(all);
}

WarmPool::Stats WarmPool::stats() {
  std::lock_guard<std::mutex> g(mu_);
  Stats s = stats_;
  for (auto& [key, p] : pools_) {
    s.ready += p.ready.size();
    s.starting += p.making;
  }
  return s;
}

void WarmPool::kill_all(std::vector<Entry>& entries) {
  for (Entry& e : entries) {
    if (!e.sb) continue;
    Status s = e.sb->kill();
    if (!s) s = e.sb->kill();
    if (!s) {
      LOG_ERROR("warm pool: kill sandbox " << e.id << ": " << s.error().message() << "; retrying every second");
      park_(std::move(e));
    }
  }
  entries.clear();
}

}  // namespace sg::lifecycle
