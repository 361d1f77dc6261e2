// SandboxWait: the wait coordinator's state machine for one sandbox
// (issue 5). It is driven by events — a model request from the sandbox
// started, its response began, it ended; the agent reported the sandbox
// idle or busy; a pause/resume/offload the owner carried out finished;
// other traffic arrived; the sandbox was killed — and answers each with the
// actions the owner must take (pause, resume, offload, release held
// responses). It does no I/O and reads no clock: time comes in with each
// event, so every path is tested deterministically
// (tests/wait-engine/coordinator_test.cpp).
//
// States and legal transitions (the only place they are decided: legal()):
//   running   -> waiting (a model request started)
//   waiting   -> running (no request left), pausing (grace over, idle, cooldown over,
//                and some request still waits for its response to start: a
//                streamed response being delivered is not a wait)
//   pausing   -> paused (pause done), waiting (pause failed), resuming (pause done but
//                the response is already coming, or other traffic), dead
//   paused    -> resuming, offloading, dead
//   offloading-> offloaded (done), paused (refused or failed), resuming (response
//                coming: the offload result is dropped by the owner), dead
//   offloaded -> resuming, dead
//   resuming  -> running / waiting (resume done; waiting if requests are still out),
//                dead
//   any       -> dead (killed); dead is final
// A response is delivered only while the sandbox runs (can_deliver()):
// responses that complete while it is paused are held and released by the
// kReleaseHeld action once the resume finished.
//
// Thread safety: none; the owner serialises calls (one strand or mutex per
// sandbox).
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace sg::wait {

using TimeNs = uint64_t;

enum class State { kRunning, kWaiting, kPausing, kPaused, kOffloading, kOffloaded, kResuming, kDead };
const char* state_name(State s);
bool legal(State from, State to);

enum class Action { kPause, kResume, kOffload, kReleaseHeld };

enum class Outcome { kCompleted, kCancelled, kUpstreamError, kClientGone };

struct WaitConfig {
  TimeNs grace_ns = 30'000'000;          // waiting this long (and idle) before a pause
  TimeNs cooldown_ns = 250'000'000;      // no new pause this soon after a resume
  TimeNs idle_report_max_age_ns = 50'000'000;  // idle evidence older than this does not count
  bool offload_enabled = false;          // the memory engine (issue 6) is present
  // Expected remaining wait that pays for an offload; 0: offload every
  // pause, even before the history knows the (tenant, model).
  TimeNs offload_min_remaining_ns = 2'000'000'000;
};

struct Transition {
  State from, to;
  TimeNs at;
  std::string reason;
};

struct WaitStats {
  uint64_t pauses = 0, resumes = 0, offloads = 0;
  uint64_t waits_started = 0;
  uint64_t waits_completed = 0, waits_cancelled = 0, waits_upstream_error = 0, waits_client_gone = 0;
  TimeNs paused_ns = 0;  // total time spent pausing..resuming
  uint64_t held_responses = 0;
};

class SandboxWait {
 public:
  explicit SandboxWait(WaitConfig cfg);

  // The model-request side. ids are unique per sandbox.
  std::vector<Action> on_request_start(uint64_t id, TimeNs now);
  // Response headers or first bytes arrived: resume now, so the resume
  // overlaps the rest of the generation.
  std::vector<Action> on_response_started(uint64_t id, TimeNs now);
  // The response is complete and ready to deliver: returns kReleaseHeld
  // when it can go out now; otherwise it is held until the resume is done.
  std::vector<Action> on_response_ready(uint64_t id, TimeNs now);
  // The request is over (delivered, cancelled, failed, client gone).
  std::vector<Action> on_request_end(uint64_t id, Outcome outcome, TimeNs now);

  // The agent's status report: idle = no tool process runnable.
  std::vector<Action> on_idle_report(bool idle, TimeNs now);
  // Timers: call at next_deadline() (or any time; it is idempotent).
  std::vector<Action> on_tick(TimeNs now);
  // expected_remaining_ns: the history's estimate for the oldest request.
  // offload_allowed: the owner's own gate (host memory pressure).
  std::vector<Action> on_pause_done(bool ok, TimeNs now, std::optional<TimeNs> expected_remaining_ns = {},
                                    bool offload_allowed = true);
  std::vector<Action> on_offload_done(bool ok, TimeNs now);
  // An offload slot came free after this sandbox's offload found none: it
  // offloads now if it is still paused with the wait ahead of it.
  std::vector<Action> on_offload_slot(TimeNs now);
  std::vector<Action> on_resume_done(bool ok, TimeNs now);
  // Anything else for this sandbox (envd, a port): it must run first.
  std::vector<Action> on_other_traffic(TimeNs now);
  void on_killed(TimeNs now);

  State state() const { return state_; }
  bool can_deliver() const { return state_ == State::kRunning || state_ == State::kWaiting; }
  size_t outstanding() const { return requests_.size(); }
  // A resume is due as soon as the running pause or offload reports back.
  bool resume_wanted() const { return resume_wanted_; }
  // Some outstanding request still waits for its response to start.
  bool awaiting_response() const { return responding_.size() < requests_.size(); }
  size_t held() const { return held_.size(); }
  // When on_tick should next be called, if anything is timed.
  std::optional<TimeNs> next_deadline() const;
  const WaitStats& stats() const { return stats_; }
  // Every transition since the last take_transitions() (the owner
  // persists them as events).
  const std::vector<Transition>& transitions() const { return log_; }
  std::vector<Transition> take_transitions() { return std::exchange(log_, {}); }

 private:
  void go(State to, TimeNs now, std::string reason);
  bool pause_allowed(TimeNs now) const;
  std::vector<Action> resume_if_stopped(TimeNs now, const char* why);

  WaitConfig cfg_;
  State state_ = State::kRunning;
  std::set<uint64_t> requests_;       // outstanding model requests
  std::set<uint64_t> responding_;     // of those, the ones whose response has started
  std::set<uint64_t> held_;           // complete responses waiting for the sandbox to run
  TimeNs waiting_since_ = 0;
  std::optional<TimeNs> idle_at_;     // last idle report (cleared by a busy one)
  TimeNs last_resume_done_ = 0;
  bool have_resumed_ = false;
  TimeNs stopped_since_ = 0;          // entered pausing
  bool resume_wanted_ = false;        // resume as soon as the pause finishes
  WaitStats stats_;
  std::vector<Transition> log_;
};

}  // namespace sg::wait
