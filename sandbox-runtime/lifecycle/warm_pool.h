// WarmPool: sandboxes of hot templates started ahead of their creates.
//
// A template with a start command (the code interpreter's server, a user's
// web server) makes each create wait for that command's ready check, which
// takes seconds. Once a tenant has created a sandbox of such a template,
// the pool keeps up to per_key sandboxes of it started and ready for that
// tenant (a pool per tenant and template version: its key), and a create
// takes one (take()): the service then gives it the creator's id, token
// and environment (the agent's "configure") instead of starting one. The
// pool refills in its own thread, only while admit() says the tenant has
// room (its quota counts what the pool holds), and a key nobody created
// from for `idle` is dropped and its sandboxes killed. Pooled sandboxes have
// no row and no egress (no policy: every destination denied) until taken.
//
// Thread safety: every method may be called from any thread; make() and
// admit() are called from the pool's thread without its lock held.
#pragma once

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
#include <vector>

#include "base/status.h"
#include "sandbox-runtime/runtime.h"
#include "storage/store.h"

namespace sg::lifecycle {

struct WarmPoolConfig {
  size_t per_key = 2;  // 0: no pool
  std::chrono::seconds idle{600};
  std::chrono::seconds retry_after_failure{10};
};

class WarmPool {
 public:
  // What a pooled sandbox is made from: the tenant and template rows as the
  // last create saw them.
  struct Recipe {
    storage::TenantRow tenant;
    storage::TemplateRow tpl;
  };
  // A started, ready sandbox; id is its runtime id (the row it becomes
  // takes it), token the envd token it was started with.
  struct Entry {
    std::string id;
    std::unique_ptr<runtime::Sandbox> sb;
  };
  struct Stats {
    size_t ready = 0;     // held now, ready to be taken
    size_t starting = 0;  // being made now
    uint64_t taken = 0, missed = 0, made = 0, failed = 0, dropped = 0;
  };
  using Make = std::function<Result<Entry>(const Recipe&)>;
  // Whether the tenant may have one more pooled sandbox, given how many the
  // pool holds or is making for it.
  using Admit = std::function<bool(const Recipe&, size_t pooled_for_tenant)>;
  using Clock = std::function<int64_t()>;  // unix seconds
  // Takes a sandbox whose kill failed twice (never dropped: its processes
  // would leak), for the service to kill again later.
  using Park = std::function<void(Entry)>;

  WarmPool(WarmPoolConfig cfg, Make make, Admit admit, Clock clock, Park park);
  ~WarmPool();  // stop()
  WarmPool(const WarmPool&) = delete;
  WarmPool& operator=(const WarmPool&) = delete;

  // The key of a tenant's template as it is now (a rebuilt template is a
  // new key; the old one goes idle).
  static std::string key_of(const std::string& tenant_id, const storage::TemplateRow& t);

  // A live pooled sandbox for key, or nullopt (a miss). Either way the key
  // is hot from now on (with this recipe) and the pool refills it.
  std::optional<Entry> take(const std::string& key, const Recipe& recipe);
  // Stops the refill thread and kills every pooled sandbox. Idempotent.
  void stop();
  Stats stats();

 private:
  struct Pool {
    Recipe recipe;
    std::deque<Entry> ready;
    size_t making = 0;
    int64_t last_use = 0;
    int64_t retry_at = 0;  // after a failed make
  };
  void run();
  // The next key to make one for, or "" (mu_ held).
  std::string next_wanted(int64_t now, size_t* pooled_for_tenant);
  void kill_all(std::vector<Entry>& entries);

  const WarmPoolConfig cfg_;
  const Make make_;
  const Admit admit_;
  const Clock clock_;
  const Park park_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, Pool> pools_;  // GUARDED_BY(mu_)
  bool stopping_ = false;              // GUARDED_BY(mu_)
  Stats stats_;                        // GUARDED_BY(mu_) (ready and starting computed)
  std::thread thread_;
};

}  // namespace sg::lifecycle
