// WaitCoordinator: entries, timers, action threads.
#include "wait-engine/coordinator/coordinator.h"

#include <algorithm>

#include "base/log.h"

namespace sg::wait {

namespace {
// Adds one sandbox's counters to a sum.
void add(WaitStats& to, const WaitStats& st) {
  to.pauses += st.pauses;
  to.resumes += st.resumes;
  to.offloads += st.offloads;
  to.waits_started += st.waits_started;
  to.waits_completed += st.waits_completed;
  to.waits_cancelled += st.waits_cancelled;
  to.waits_upstream_error += st.waits_upstream_error;
  to.waits_client_gone += st.waits_client_gone;
  to.paused_ns += st.paused_ns;
  to.held_responses += st.held_responses;
}

bool stopped(State s) {
  return s == State::kPausing || s == State::kPaused || s == State::kOffloading || s == State::kOffloaded ||
         s == State::kResuming;
}
}  // namespace

WaitCoordinator::WaitCoordinator(CoordinatorConfig cfg, CoordinatorHooks hooks, Clock clock)
    : cfg_(cfg), hooks_(std::move(hooks)), clock_(std::move(clock)) {
  // Offload needs the memory engine's hook.
  cfg_.wait.offload_enabled = cfg_.wait.offload_enabled && bool(hooks_.offload);
  size_t n = std::max<size_t>(1, cfg_.action_threads);
  for (size_t i = 0; i < n; ++i) threads_.emplace_back([this] { action_loop(); });
  threads_.emplace_back([this] { timer_loop(); });
}

WaitCoordinator::~WaitCoordinator() {
  {
    // Running offloads stop within a page, so the threads join promptly.
    std::vector<EntryPtr> all;
    {
      std::lock_guard<std::mutex> g(mu_);
      for (auto& [id, e] : entries_) all.push_back(e);
    }
    for (auto& e : all) {
      std::lock_guard<std::mutex> l(e->mu);
      if (e->offload_cancel) e->offload_cancel->store(true, std::memory_order_release);
    }
  }
  {
    std::lock_guard<std::mutex> g(q_mu_);
    stopping_ = true;
  }
  q_cv_.notify_all();
  t_cv_.notify_all();
  for (auto& t : threads_) t.join();
  // Nobody may wait forever on a response.
  // Entries are copied out first: e->mu is always taken before mu_, never
  // under it.
  std::vector<EntryPtr> all;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (auto& [id, e] : entries_) all.push_back(e);
  }
  std::vector<std::function<void()>> fire;
  for (auto& e : all) {
    std::lock_guard<std::mutex> l(e->mu);
    for (auto& [rid, fn] : e->deliver) fire.push_back(std::move(fn));
    e->deliver.clear();
  }
  for (auto& f : fire) f();
}

WaitCoordinator::EntryPtr WaitCoordinator::find(const std::string& sandbox) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = entries_.find(sandbox);
  return it == entries_.end() ? nullptr : it->second;
}

WaitCoordinator::EntryPtr WaitCoordinator::find_or_make(const std::string& sandbox) {
  std::lock_guard<std::mutex> g(mu_);
  EntryPtr& e = entries_[sandbox];
  if (!e) e = std::make_shared<Entry>(cfg_.wait);
  return e;
}

void WaitCoordinator::post(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> g(q_mu_);
    if (stopping_) return;
    queue_.push_back(std::move(fn));
  }
  q_cv_.notify_one();
}

void WaitCoordinator::action_loop() {
  for (;;) {
    std::function<void()> fn;
    {
      std::unique_lock<std::mutex> l(q_mu_);
      q_cv_.wait(l, [&] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      fn = std::move(queue_.front());
      queue_.pop_front();
    }
    fn();
  }
}

void WaitCoordinator::timer_loop() {
  std::unique_lock<std::mutex> l(q_mu_);
  for (;;) {
    if (stopping_) return;
    if (timers_.empty()) {
      t_cv_.wait(l);
      continue;
    }
    TimeNs now = clock_();
    Timer t = timers_.top();
    if (t.at > now) {
      t_cv_.wait_for(l, std::chrono::nanoseconds(t.at - now));
      continue;
    }
    timers_.pop();
    l.unlock();
    if (EntryPtr e = find(t.sandbox)) {
      std::vector<std::function<void()>> fire;
      {
        std::lock_guard<std::mutex> g(e->mu);
        if (!e->gone && t.gen == e->timer_gen) {
          TimeNs n = clock_();
          std::vector<Action> acts = e->sw.on_tick(n);
          // The grace is over but the evidence is missing or stale: ask.
          if (acts.empty() && e->sw.state() == State::kWaiting && e->sw.awaiting_response() && !e->probing) {
            e->probing = true;
            post([this, s = t.sandbox, e] { run_probe(s, e); });
          }
          after(t.sandbox, e, std::move(acts), n, fire);
        }
      }
      for (auto& f : fire) f();
    }
    l.lock();
  }
}

void WaitCoordinator::arm_timer(const std::string& sandbox, const EntryPtr& e, TimeNs at) {
  uint64_t gen = ++e->timer_gen;
  {
    std::lock_guard<std::mutex> g(q_mu_);
    if (stopping_) return;
    timers_.push({at, sandbox, gen});
  }
  t_cv_.notify_one();
}

void WaitCoordinator::after(const std::string& sandbox, const EntryPtr& e, std::vector<Action> acts, TimeNs now,
                            std::vector<std::function<void()>>& fire) {
  for (Transition& t : e->sw.take_transitions()) {
    if (t.to == State::kPausing) e->stopped_since = t.at;
    if (stopped(t.from) && !stopped(t.to))
      paused_duration_.observe(static_cast<double>(t.at - e->stopped_since) / 1e9);
    if (hooks_.transition) hooks_.transition(sandbox, t);
  }
  for (Action a : acts) {
    if (a == Action::kReleaseHeld) continue;  // handled below, by state
    if (a == Action::kOffload) e->offload_cancel = std::make_shared<std::atomic<bool>>(false);
    post([this, sandbox, e, a] { run_action(sandbox, e, a); });
  }
  // An offload no longer wanted (a response, other traffic, the last
  // request gone, the sandbox killed) stops within a page.
  if (e->offload_cancel && (e->sw.state() != State::kOffloading || e->sw.resume_wanted() || e->gone))
    e->offload_cancel->store(true, std::memory_order_release);
  // Deliveries go whenever the sandbox runs (or is dead: the write fails
  // there, never hangs).
  if (e->sw.can_deliver() || e->sw.state() == State::kDead || e->gone) {
    for (auto& [id, fn] : e->deliver) fire.push_back(std::move(fn));
    e->deliver.clear();
  }
  e->cv.notify_all();
  // A wait that has not become a pause yet: the grace (or cooldown) timer.
  if (e->sw.state() == State::kWaiting && e->sw.awaiting_response() && !e->probing) {
    std::optional<TimeNs> d = e->sw.next_deadline();
    if (!d) {
      // No evidence yet: ask at the end of the grace.
      d = now + cfg_.wait.grace_ns;
      if (e->probe_backoff > 0) d = now + e->probe_backoff;
    }
    arm_timer(sandbox, e, *d);
  }
}

void WaitCoordinator::run_probe(const std::string& sandbox, EntryPtr e) {
  probes_.fetch_add(1, std::memory_order_relaxed);
  Result<bool> idle = hooks_.idle ? hooks_.idle(sandbox) : Result<bool>(false);
  std::vector<std::function<void()>> fire;
  {
    std::lock_guard<std::mutex> g(e->mu);
    e->probing = false;
    if (e->gone) return;
    TimeNs now = clock_();
    bool is_idle = idle && *idle;
    if (!idle) LOG_DEBUG("sandbox " << sandbox << ": idle probe: " << idle.error().message());
    // Busy (or unknown): ask again later, backing off up to the cap.
    e->probe_backoff = is_idle ? 0
                               : std::min<TimeNs>(cfg_.probe_backoff_max_ns,
                                                  std::max<TimeNs>(cfg_.wait.grace_ns, e->probe_backoff * 2));
    std::vector<Action> acts = e->sw.on_idle_report(is_idle, now);
    after(sandbox, e, std::move(acts), now, fire);
  }
  for (auto& f : fire) f();
}

void WaitCoordinator::run_action(const std::string& sandbox, EntryPtr e, Action a) {
  TimeNs t0 = clock_();
  Status s = Status::Ok();
  if (a == Action::kPause) {
    s = hooks_.pause ? hooks_.pause(sandbox) : internal_error("no pause hook");
    pause_latency_.observe(static_cast<double>(clock_() - t0) / 1e9);
    if (!s) {
      pause_failures_.fetch_add(1, std::memory_order_relaxed);
      LOG_WARN("sandbox " << sandbox << ": wait pause failed: " << s.error().message());
    }
  } else if (a == Action::kResume) {
    s = hooks_.resume ? hooks_.resume(sandbox) : internal_error("no resume hook");
    resume_latency_.observe(static_cast<double>(clock_() - t0) / 1e9);
    if (!s) {
      resume_failures_.fetch_add(1, std::memory_order_relaxed);
      LOG_WARN("sandbox " << sandbox << ": wait resume failed: " << s.error().message());
    }
  } else if (a == Action::kOffload) {
    std::shared_ptr<std::atomic<bool>> cancel;
    {
      std::lock_guard<std::mutex> g(e->mu);
      cancel = e->offload_cancel;
    }
    if (!cancel) {
      s = Error(ErrorKind::kConflict, "offload no longer wanted");
    } else {
      s = hooks_.offload(sandbox, *cancel);
      offload_latency_.observe(static_cast<double>(clock_() - t0) / 1e9);
    }
    if (s) {
      offloads_done_.fetch_add(1, std::memory_order_relaxed);
    } else if (s.error().kind() == ErrorKind::kConflict) {
      offloads_cancelled_.fetch_add(1, std::memory_order_relaxed);
      LOG_DEBUG("sandbox " << sandbox << ": offload stopped: " << s.error().message());
    } else if (s.error().kind() == ErrorKind::kQuota) {
      // No CPU slot: paused, whole, until an offload ends and offers its slot.
      offloads_skipped_.fetch_add(1, std::memory_order_relaxed);
      LOG_DEBUG("sandbox " << sandbox << ": offload waits for a slot: " << s.error().message());
      std::lock_guard<std::mutex> g(mu_);
      slot_waiters_.push_back(sandbox);
    } else {
      offload_failures_.fetch_add(1, std::memory_order_relaxed);
      LOG_WARN("sandbox " << sandbox << ": offload failed (it stays paused): " << s.error().message());
    }
  }
  // The owner's offload gate (it reads /proc/meminfo): asked before the
  // sandbox's lock is taken, and only when a completed pause could offload.
  bool offload_allowed = a != Action::kPause || !s || !cfg_.wait.offload_enabled || !hooks_.offload_wanted ||
                         hooks_.offload_wanted();
  std::vector<std::function<void()>> fire;
  {
    std::lock_guard<std::mutex> g(e->mu);
    if (e->gone) return;
    TimeNs now = clock_();
    std::vector<Action> acts;
    if (a == Action::kPause) {
      std::optional<TimeNs> remaining;
      {
        // The oldest request's expected remaining wait, from history.
        std::lock_guard<std::mutex> h(mu_);
        for (const auto& [id, r] : e->reqs) {
          remaining = history_.expected_remaining_ns(r.history_key, "", now - r.started);
          break;
        }
      }
      acts = e->sw.on_pause_done(bool(s), now, remaining, offload_allowed);
    } else if (a == Action::kResume) {
      acts = e->sw.on_resume_done(bool(s), now);
    } else if (a == Action::kOffload) {
      e->offload_cancel.reset();
      acts = e->sw.on_offload_done(bool(s), now);
    }
    after(sandbox, e, std::move(acts), now, fire);
  }
  for (auto& f : fire) f();
  if (a == Action::kOffload && (s || s.error().kind() != ErrorKind::kQuota)) offer_offload_slot();
  if (a == Action::kResume && !s && hooks_.kill) {
    LOG_WARN("sandbox " << sandbox << ": could not be resumed after a wait pause; killing it");
    hooks_.kill(sandbox);
  }
}

// The slot the offload that just ended held goes to the oldest sandbox
// still paused that found none; those no longer paused drop out.
void WaitCoordinator::offer_offload_slot() {
  for (;;) {
    std::string sandbox;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (slot_waiters_.empty()) return;
      sandbox = std::move(slot_waiters_.front());
      slot_waiters_.pop_front();
    }
    EntryPtr e = find(sandbox);
    if (!e) continue;
    std::vector<std::function<void()>> fire;
    bool taken;
    {
      std::lock_guard<std::mutex> g(e->mu);
      if (e->gone) continue;
      TimeNs now = clock_();
      std::vector<Action> acts = e->sw.on_offload_slot(now);
      taken = !acts.empty();
      after(sandbox, e, std::move(acts), now, fire);
    }
    for (auto& f : fire) f();
    if (taken) return;
  }
}

WaitCoordinator::Ticket WaitCoordinator::begin(const std::string& sandbox, const std::string& history_key) {
  EntryPtr e = find_or_make(sandbox);
  Ticket t{sandbox, 0};
  {
    std::lock_guard<std::mutex> g(mu_);
    t.id = next_id_++;
  }
  std::vector<std::function<void()>> fire;
  {
    std::lock_guard<std::mutex> g(e->mu);
    TimeNs now = clock_();
    // A stop already under way when the request began is not its pause:
    // end() subtracts the part of it that came before.
    TimeNs paused_before = e->sw.stats().paused_ns;
    if (stopped(e->sw.state()) && now > e->stopped_since) paused_before += now - e->stopped_since;
    e->reqs[t.id] = {history_key, now, paused_before};
    e->probe_backoff = 0;
    after(sandbox, e, e->sw.on_request_start(t.id, now), now, fire);
  }
  for (auto& f : fire) f();
  return t;
}

bool WaitCoordinator::response_started(const Ticket& t) {
  EntryPtr e = find(t.sandbox);
  if (!e) return false;
  std::vector<std::function<void()>> fire;
  bool was_stopped;
  {
    std::lock_guard<std::mutex> g(e->mu);
    TimeNs now = clock_();
    was_stopped = stopped(e->sw.state());
    if (auto it = e->reqs.find(t.id); it != e->reqs.end() && it->second.started) {
      std::lock_guard<std::mutex> h(mu_);
      history_.record(it->second.history_key, "", now - it->second.started);
      it->second.started = 0;  // recorded once
    }
    after(t.sandbox, e, e->sw.on_response_started(t.id, now), now, fire);
  }
  for (auto& f : fire) f();
  return was_stopped;
}

void WaitCoordinator::when_deliverable(const Ticket& t, std::function<void()> ready) {
  EntryPtr e = find(t.sandbox);
  if (!e) {
    ready();
    return;
  }
  std::vector<std::function<void()>> fire;
  {
    std::lock_guard<std::mutex> g(e->mu);
    TimeNs now = clock_();
    e->deliver[t.id] = std::move(ready);
    after(t.sandbox, e, e->sw.on_response_ready(t.id, now), now, fire);
  }
  for (auto& f : fire) f();
}

TimeNs WaitCoordinator::end(const Ticket& t, Outcome outcome) {
  EntryPtr e = find(t.sandbox);
  if (!e) return 0;
  std::vector<std::function<void()>> fire;
  TimeNs paused = 0;
  {
    std::lock_guard<std::mutex> g(e->mu);
    TimeNs now = clock_();
    if (auto it = e->reqs.find(t.id); it != e->reqs.end()) {
      paused = e->sw.stats().paused_ns - it->second.paused_at_begin;
      if (stopped(e->sw.state()) && now > e->stopped_since) paused += now - e->stopped_since;
      e->reqs.erase(it);
    }
    if (auto it = e->deliver.find(t.id); it != e->deliver.end()) {
      fire.push_back(std::move(it->second));
      e->deliver.erase(it);
    }
    after(t.sandbox, e, e->sw.on_request_end(t.id, outcome, now), now, fire);
  }
  for (auto& f : fire) f();
  return paused;
}

Status WaitCoordinator::ensure_running(const std::string& sandbox, std::chrono::milliseconds timeout) {
  EntryPtr e = find(sandbox);
  if (!e) return Status::Ok();
  std::vector<std::function<void()>> fire;
  // Dead and not forgotten: its resume failed and it stays frozen.
  auto unresumable = [&] {
    return Error(ErrorKind::kUnavailable, "sandbox " + sandbox +
                                              " could not be resumed after a wait pause (see the log); kill it");
  };
  std::unique_lock<std::mutex> l(e->mu);
  if (!e->gone && e->sw.state() == State::kDead) return unresumable();
  if (!stopped(e->sw.state())) return Status::Ok();
  TimeNs now = clock_();
  after(sandbox, e, e->sw.on_other_traffic(now), now, fire);
  l.unlock();
  for (auto& f : fire) f();
  l.lock();
  bool ok = e->cv.wait_for(l, timeout, [&] { return e->gone || !stopped(e->sw.state()); });
  if (!ok)
    return Error(ErrorKind::kTimeout, "sandbox " + sandbox + " did not resume within " +
                                          std::to_string(timeout.count()) + " ms");
  if (!e->gone && e->sw.state() == State::kDead) return unresumable();
  return Status::Ok();
}

void WaitCoordinator::forget(const std::string& sandbox) {
  EntryPtr e;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = entries_.find(sandbox);
    if (it == entries_.end()) return;
    e = it->second;
    entries_.erase(it);
  }
  std::vector<std::function<void()>> fire;
  {
    std::lock_guard<std::mutex> g(e->mu);
    TimeNs now = clock_();
    e->sw.on_killed(now);
    after(sandbox, e, {}, now, fire);
    e->gone = true;
    e->cv.notify_all();
    std::lock_guard<std::mutex> h(mu_);
    add(retired_, e->sw.stats());
  }
  for (auto& f : fire) f();
}

std::optional<State> WaitCoordinator::state(const std::string& sandbox) {
  EntryPtr e = find(sandbox);
  if (!e) return std::nullopt;
  std::lock_guard<std::mutex> g(e->mu);
  return e->sw.state();
}

WaitCoordinator::Totals WaitCoordinator::totals() {
  std::vector<EntryPtr> all;
  Totals t;
  WaitStats sum;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (auto& [id, e] : entries_) all.push_back(e);
    sum = retired_;
  }
  t.sandboxes = all.size();
  for (auto& e : all) {
    std::lock_guard<std::mutex> g(e->mu);
    add(sum, e->sw.stats());
    if (stopped(e->sw.state())) ++t.stopped_now;
  }
  t.pauses = sum.pauses;
  t.resumes = sum.resumes;
  t.waits_started = sum.waits_started;
  t.waits_completed = sum.waits_completed;
  t.waits_cancelled = sum.waits_cancelled;
  t.waits_upstream_error = sum.waits_upstream_error;
  t.waits_client_gone = sum.waits_client_gone;
  t.paused_seconds = static_cast<double>(sum.paused_ns) / 1e9;
  t.pause_failures = pause_failures_.load();
  t.resume_failures = resume_failures_.load();
  t.probes = probes_.load();
  return t;
}

void WaitCoordinator::render_metrics(std::string& out) {
  using namespace metrics;
  Totals t = totals();
  render_header(out, "sandgate_wait_pauses_total", "counter", "Sandboxes paused while waiting on a model.");
  render_sample(out, "sandgate_wait_pauses_total", "", static_cast<double>(t.pauses));
  render_header(out, "sandgate_wait_resumes_total", "counter", "Resumes of wait-paused sandboxes.");
  render_sample(out, "sandgate_wait_resumes_total", "", static_cast<double>(t.resumes));
  render_header(out, "sandgate_wait_action_failures_total", "counter", "Pauses and resumes that failed.");
  render_sample(out, "sandgate_wait_action_failures_total", "action=\"pause\"", static_cast<double>(t.pause_failures));
  render_sample(out, "sandgate_wait_action_failures_total", "action=\"resume\"", static_cast<double>(t.resume_failures));
  render_header(out, "sandgate_wait_paused_seconds_total", "counter",
                "Seconds sandboxes spent stopped (pausing to resumed) during model waits.");
  render_sample(out, "sandgate_wait_paused_seconds_total", "", t.paused_seconds);
  render_header(out, "sandgate_wait_stopped_sandboxes", "gauge", "Sandboxes stopped by the wait coordinator now.");
  render_sample(out, "sandgate_wait_stopped_sandboxes", "", static_cast<double>(t.stopped_now));
  render_header(out, "sandgate_wait_idle_probes_total", "counter", "Idle-evidence requests sent to agents.");
  render_sample(out, "sandgate_wait_idle_probes_total", "", static_cast<double>(t.probes));
  render_header(out, "sandgate_waits_total", "counter", "Model waits of bound sandboxes, by outcome.");
  render_sample(out, "sandgate_waits_total", "outcome=\"started\"", static_cast<double>(t.waits_started));
  render_sample(out, "sandgate_waits_total", "outcome=\"completed\"", static_cast<double>(t.waits_completed));
  render_sample(out, "sandgate_waits_total", "outcome=\"cancelled\"", static_cast<double>(t.waits_cancelled));
  render_sample(out, "sandgate_waits_total", "outcome=\"upstream_error\"", static_cast<double>(t.waits_upstream_error));
  render_sample(out, "sandgate_waits_total", "outcome=\"client_gone\"", static_cast<double>(t.waits_client_gone));
  pause_latency_.render(out, "sandgate_wait_pause_latency_seconds", "Time to pause a sandbox (freeze or vCPU stop).");
  resume_latency_.render(out, "sandgate_wait_resume_latency_seconds", "Time to resume a wait-paused sandbox.");
  paused_duration_.render(out, "sandgate_wait_paused_duration_seconds", "Length of each wait pause.");
  render_header(out, "sandgate_wait_offloads_total", "counter",
                "Offloads of wait-paused sandboxes, by result (skipped: no CPU slot then; it waits for one).");
  render_sample(out, "sandgate_wait_offloads_total", "result=\"done\"", static_cast<double>(offloads_done_.load()));
  render_sample(out, "sandgate_wait_offloads_total", "result=\"cancelled\"",
                static_cast<double>(offloads_cancelled_.load()));
  render_sample(out, "sandgate_wait_offloads_total", "result=\"skipped\"", static_cast<double>(offloads_skipped_.load()));
  render_sample(out, "sandgate_wait_offloads_total", "result=\"failed\"", static_cast<double>(offload_failures_.load()));
  offload_latency_.render(out, "sandgate_wait_offload_seconds", "Time to offload a paused sandbox's memory.");
}

}  // namespace sg::wait
