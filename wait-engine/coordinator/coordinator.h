// WaitCoordinator: the live owner of one SandboxWait per sandbox (issue 5).
//
// The model proxy reports each bound request (begin, response_started,
// when_deliverable, end); the coordinator runs the state machine
// (wait_state.h) and carries out its actions through hooks the gateway
// supplies: pause / resume the sandbox (cgroup freeze or vCPUs stopped),
// ask the agent whether any tool process is runnable (the idle evidence),
// and record each transition (events in SQLite). Other traffic for a
// sandbox calls ensure_running() first.
//
// Idle evidence is asked for when the grace of a wait ends (and again, with
// backoff, while the sandbox stays busy), so a report is never older than
// the state machine accepts.
//
// Threads: every public method may be called from any thread and never
// blocks on a sandbox (except ensure_running, which waits for the resume it
// asks for). Hooks run on the coordinator's own action threads; timers on
// its timer thread. A per-sandbox mutex serialises the state machine.
// Delivery callbacks run on an action thread or inline in the caller; they
// must only post work elsewhere.
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
#include <queue>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "wait-engine/coordinator/wait_history.h"
#include "wait-engine/coordinator/wait_state.h"
#include "wait-engine/metrics/histogram.h"
#include "base/status.h"

namespace sg::wait {

struct CoordinatorHooks {
  std::function<Status(const std::string& sandbox)> pause;
  std::function<Status(const std::string& sandbox)> resume;
  // True when no tool process in the sandbox is runnable.
  std::function<Result<bool>(const std::string& sandbox)> idle;
  // Must not block for long (queue it).
  std::function<void(const std::string& sandbox, const Transition& t)> transition;
  // A sandbox that could not be resumed is lost to its owner: kill it (it
  // calls forget() in turn). Called on an action thread, no lock held.
  // Optional.
  std::function<void(const std::string& sandbox)> kill;
  // Offloads a paused sandbox's memory (the memory engine). Must stop
  // within a page once cancel is set (a response or other traffic came, or
  // the sandbox went): an error leaves the sandbox paused and whole
  // (kConflict: cancelled; kQuota: skipped for want of a CPU slot).
  // Optional: without it (or with WaitConfig::offload_enabled false) a
  // wait only pauses.
  std::function<Status(const std::string& sandbox, const std::atomic<bool>& cancel)> offload;
  // Whether offloading is wanted now (host memory pressure); asked when a
  // pause finished. Optional: always, without it.
  std::function<bool()> offload_wanted;
};

struct CoordinatorConfig {
  WaitConfig wait;
  size_t action_threads = 4;
  TimeNs probe_backoff_max_ns = 500'000'000;  // a busy sandbox is re-asked at most this far apart
};

class WaitCoordinator {
 public:
  using Clock = std::function<TimeNs()>;
  WaitCoordinator(CoordinatorConfig cfg, CoordinatorHooks hooks, Clock clock);
  ~WaitCoordinator();  // stops its threads; pending delivery callbacks are called
  WaitCoordinator(const WaitCoordinator&) = delete;
  WaitCoordinator& operator=(const WaitCoordinator&) = delete;

  struct Ticket {
    std::string sandbox;
    uint64_t id = 0;
  };
  // A model request from (or bound to) sandbox started. history_key names
  // the wait history (tenant and model).
  Ticket begin(const std::string& sandbox, const std::string& history_key);
  // The response is known to be coming: resume now. Returns whether the
  // sandbox was stopped (pausing, paused, offloaded, resuming) at that time.
  bool response_started(const Ticket& t);
  // Calls ready once, as soon as the response may be delivered (at once if
  // the sandbox runs; also when the sandbox dies or the coordinator stops).
  void when_deliverable(const Ticket& t, std::function<void()> ready);
  // Returns how long the sandbox was stopped while the request was out.
  TimeNs end(const Ticket& t, Outcome outcome);
  // Other traffic: resumes the sandbox if the coordinator stopped it and
  // waits (at most timeout) until it runs. kTimeout when it did not;
  // kUnavailable when its resume failed (it stays frozen until killed).
  Status ensure_running(const std::string& sandbox, std::chrono::milliseconds timeout);
  // The sandbox was killed or is gone.
  void forget(const std::string& sandbox);

  std::optional<State> state(const std::string& sandbox);

  struct Totals {
    uint64_t pauses = 0, resumes = 0, pause_failures = 0, resume_failures = 0, probes = 0;
    uint64_t waits_started = 0, waits_completed = 0, waits_cancelled = 0, waits_upstream_error = 0,
             waits_client_gone = 0;
    double paused_seconds = 0;
    size_t sandboxes = 0, stopped_now = 0;
  };
  Totals totals();
  // Appends the coordinator's series in Prometheus text format.
  void render_metrics(std::string& out);

 private:
  struct Entry {
    explicit Entry(WaitConfig c) : sw(c) {}
    std::mutex mu;
    std::condition_variable cv;  // state changes (ensure_running waits)
    SandboxWait sw;              // GUARDED_BY(mu)
    std::map<uint64_t, std::function<void()>> deliver;  // GUARDED_BY(mu)
    struct Req {
      std::string history_key;
      TimeNs started = 0;        // 0 once the response started (history recorded)
      TimeNs paused_at_begin = 0;  // sw.stats().paused_ns when it began
    };
    std::map<uint64_t, Req> reqs;  // GUARDED_BY(mu)
    bool probing = false;          // GUARDED_BY(mu): an idle probe is queued or running
    TimeNs probe_backoff = 0;      // GUARDED_BY(mu)
    uint64_t timer_gen = 0;        // GUARDED_BY(mu): only the newest timer counts
    bool gone = false;             // GUARDED_BY(mu)
    TimeNs stopped_since = 0;      // GUARDED_BY(mu)
    TimeNs paused_ns_recorded = 0; // GUARDED_BY(mu)
    // Set while an offload runs; after() sets it once the offload is no
    // longer wanted.
    std::shared_ptr<std::atomic<bool>> offload_cancel;  // GUARDED_BY(mu)
  };
  using EntryPtr = std::shared_ptr<Entry>;

  EntryPtr find(const std::string& sandbox);
  EntryPtr find_or_make(const std::string& sandbox);
  // With e.mu held: records transitions, starts actions, fires deliveries
  // that may go, re-arms the timer. Callbacks to fire are moved to `fire`.
  void after(const std::string& sandbox, const EntryPtr& e, std::vector<Action> acts, TimeNs now,
             std::vector<std::function<void()>>& fire);
  void arm_timer(const std::string& sandbox, const EntryPtr& e, TimeNs at);
  void run_action(const std::string& sandbox, EntryPtr e, Action a);
  void offer_offload_slot();
  void run_probe(const std::string& sandbox, EntryPtr e);
  void post(std::function<void()> fn);
  void action_loop();
  void timer_loop();

  CoordinatorConfig cfg_;
  CoordinatorHooks hooks_;
  Clock clock_;

  std::mutex mu_;
  std::unordered_map<std::string, EntryPtr> entries_;  // GUARDED_BY(mu_)
  uint64_t next_id_ = 1;                                // GUARDED_BY(mu_)
  WaitHistory history_;                                 // GUARDED_BY(mu_)
  // Paused sandboxes whose offload found no slot (the owner's CPU budget),
  // oldest first: each offload that ends offers its slot to the next.
  std::deque<std::string> slot_waiters_;                // GUARDED_BY(mu_)

  std::mutex q_mu_;
  std::condition_variable q_cv_;
  std::deque<std::function<void()>> queue_;  // GUARDED_BY(q_mu_)
  struct Timer {
    TimeNs at;
    std::string sandbox;
    uint64_t gen;
    bool operator>(const Timer& o) const { return at > o.at; }
  };
  std::priority_queue<Timer, std::vector<Timer>, std::greater<Timer>> timers_;  // GUARDED_BY(q_mu_)
  std::condition_variable t_cv_;
  bool stopping_ = false;  // GUARDED_BY(q_mu_)
  std::vector<std::thread> threads_;

  std::atomic<uint64_t> pause_failures_{0}, resume_failures_{0}, probes_{0};
  std::atomic<uint64_t> offloads_done_{0}, offload_failures_{0}, offloads_cancelled_{0}, offloads_skipped_{0};
  metrics::Histogram offload_latency_{{0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30}};
  metrics::Histogram pause_latency_{metrics::latency_bounds()};
  metrics::Histogram resume_latency_{metrics::latency_bounds()};
  metrics::Histogram paused_duration_{{0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120}};
  // Totals of entries already forgotten.
  WaitStats retired_;  // GUARDED_BY(mu_)
};

}  // namespace sg::wait
