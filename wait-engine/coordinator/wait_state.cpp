// SandboxWait: transitions, grace, cooldown, held responses.
#include "wait-engine/coordinator/wait_state.h"

#include <cassert>

namespace sg::wait {

const char* state_name(State s) {
  switch (s) {
    case State::kRunning: return "running";
    case State::kWaiting: return "waiting";
    case State::kPausing: return "pausing";
    case State::kPaused: return "paused";
    case State::kOffloading: return "offloading";
    case State::kOffloaded: return "offloaded";
    case State::kResuming: return "resuming";
    case State::kDead: return "dead";
  }
  return "?";
}

bool legal(State from, State to) {
  if (from == State::kDead) return false;
  if (to == State::kDead) return true;
  switch (from) {
    case State::kRunning: return to == State::kWaiting;
    case State::kWaiting: return to == State::kRunning || to == State::kPausing;
    case State::kPausing: return to == State::kPaused || to == State::kWaiting || to == State::kResuming;
    case State::kPaused: return to == State::kResuming || to == State::kOffloading;
    case State::kOffloading: return to == State::kOffloaded || to == State::kPaused || to == State::kResuming;
    case State::kOffloaded: return to == State::kResuming;
    case State::kResuming: return to == State::kRunning || to == State::kWaiting;
    case State::kDead: return false;
  }
  return false;
}

SandboxWait::SandboxWait(WaitConfig cfg) : cfg_(cfg) {}

void SandboxWait::go(State to, TimeNs now, std::string reason) {
  assert(legal(state_, to));
  if (state_ == State::kPausing || state_ == State::kPaused || state_ == State::kOffloading ||
      state_ == State::kOffloaded || state_ == State::kResuming) {
    if (to == State::kRunning || to == State::kWaiting || to == State::kDead) stats_.paused_ns += now - stopped_since_;
  }
  if (to == State::kPausing) stopped_since_ = now;
  log_.push_back({state_, to, now, std::move(reason)});
  state_ = to;
}

bool SandboxWait::pause_allowed(TimeNs now) const {
  if (state_ != State::kWaiting || requests_.empty()) return false;
  // Only requests whose response has not started yet are waits.
  if (responding_.size() >= requests_.size()) return false;
  if (now < waiting_since_ + cfg_.grace_ns) return false;
  if (have_resumed_ && now < last_resume_done_ + cfg_.cooldown_ns) return false;
  // Evidence: an idle report, recent, and no busy report since.
  if (!idle_at_ || now > *idle_at_ + cfg_.idle_report_max_age_ns) return false;
  return true;
}

std::vector<Action> SandboxWait::resume_if_stopped(TimeNs now, const char* why) {
  switch (state_) {
    case State::kPausing:
    case State::kOffloading:
      resume_wanted_ = true;  // acted on when the pause/offload reports back
      return {};
    case State::kPaused:
    case State::kOffloaded:
      go(State::kResuming, now, why);
      ++stats_.resumes;
      return {Action::kResume};
    default: return {};
  }
}

std::vector<Action> SandboxWait::on_request_start(uint64_t id, TimeNs now) {
  if (state_ == State::kDead) return {};
  requests_.insert(id);
  ++stats_.waits_started;
  if (state_ == State::kRunning) {
    waiting_since_ = now;
    go(State::kWaiting, now, "model request started");
  }
  return {};
}

std::vector<Action> SandboxWait::on_response_started(uint64_t id, TimeNs now) {
  if (state_ == State::kDead || !requests_.count(id)) return {};
  responding_.insert(id);
  return resume_if_stopped(now, "model response started");
}

std::vector<Action> SandboxWait::on_response_ready(uint64_t id, TimeNs now) {
  if (state_ == State::kDead || !requests_.count(id)) return {};
  if (can_deliver()) return {Action::kReleaseHeld};
  held_.insert(id);
  ++stats_.held_responses;
  return resume_if_stopped(now, "model response ready");
}

std::vector<Action> SandboxWait::on_request_end(uint64_t id, Outcome outcome, TimeNs now) {
  if (!requests_.erase(id)) return {};
  held_.erase(id);
  responding_.erase(id);
  switch (outcome) {
    case Outcome::kCompleted: ++stats_.waits_completed; break;
    case Outcome::kCancelled: ++stats_.waits_cancelled; break;
    case Outcome::kUpstreamError: ++stats_.waits_upstream_error; break;
    case Outcome::kClientGone: ++stats_.waits_client_gone; break;
  }
  if (state_ == State::kDead) return {};
  if (requests_.empty()) {
    if (state_ == State::kWaiting) {
      go(State::kRunning, now, "no model request left");
      return {};
    }
    // Nothing left to wait for: whatever ended the wait, run again.
    return resume_if_stopped(now, "the last model request ended");
  }
  return {};
}

std::vector<Action> SandboxWait::on_idle_report(bool idle, TimeNs now) {
  if (state_ == State::kDead) return {};
  if (idle) idle_at_ = now;
  else idle_at_.reset();
  return on_tick(now);
}

std::vector<Action> SandboxWait::on_tick(TimeNs now) {
  if (!pause_allowed(now)) return {};
  go(State::kPausing, now, "idle while waiting on a model");
  ++stats_.pauses;
  resume_wanted_ = false;
  return {Action::kPause};
}

std::vector<Action> SandboxWait::on_pause_done(bool ok, TimeNs now, std::optional<TimeNs> expected_remaining_ns,
                                               bool offload_allowed) {
  if (state_ != State::kPausing) return {};
  if (!ok) {
    go(State::kWaiting, now, "pause failed");
    last_resume_done_ = now;  // the cooldown also spaces failed attempts
    have_resumed_ = true;
    return {};
  }
  if (resume_wanted_ || requests_.empty() || !held_.empty()) {
    resume_wanted_ = false;
    go(State::kResuming, now, "response came while pausing");
    ++stats_.resumes;
    return {Action::kResume};
  }
  go(State::kPaused, now, "paused");
  bool pays = cfg_.offload_min_remaining_ns == 0 ||
              (expected_remaining_ns && *expected_remaining_ns >= cfg_.offload_min_remaining_ns);
  if (cfg_.offload_enabled && offload_allowed && pays) {
    go(State::kOffloading, now, "expected wait pays for an offload");
    ++stats_.offloads;
    return {Action::kOffload};
  }
  return {};
}

std::vector<Action> SandboxWait::on_offload_slot(TimeNs now) {
  if (state_ != State::kPaused || !cfg_.offload_enabled || resume_wanted_ || requests_.empty() || !held_.empty())
    return {};
  go(State::kOffloading, now, "an offload slot came free");
  ++stats_.offloads;
  return {Action::kOffload};
}

std::vector<Action> SandboxWait::on_offload_done(bool ok, TimeNs now) {
  if (state_ != State::kOffloading) return {};
  if (resume_wanted_ || requests_.empty() || !held_.empty()) {
    resume_wanted_ = false;
    go(State::kResuming, now, ok ? "response came while offloading" : "offload failed; response came");
    ++stats_.resumes;
    return {Action::kResume};
  }
  go(ok ? State::kOffloaded : State::kPaused, now, ok ? "offloaded" : "offload refused or failed");
  return {};
}

std::vector<Action> SandboxWait::on_resume_done(bool ok, TimeNs now) {
  if (state_ != State::kResuming) return {};
  if (!ok) {
    // A sandbox that cannot be resumed is lost to its owner; the owner
    // kills it and reports on_killed.
    go(State::kDead, now, "resume failed");
    return {};
  }
  last_resume_done_ = now;
  have_resumed_ = true;
  idle_at_.reset();  // fresh evidence is needed for the next pause
  if (requests_.empty()) {
    go(State::kRunning, now, "resumed");
  } else {
    waiting_since_ = now;
    go(State::kWaiting, now, "resumed; model requests still out");
  }
  if (!held_.empty()) {
    held_.clear();
    return {Action::kReleaseHeld};
  }
  return {};
}

std::vector<Action> SandboxWait::on_other_traffic(TimeNs now) {
  if (state_ == State::kDead) return {};
  idle_at_.reset();
  return resume_if_stopped(now, "other traffic for the sandbox");
}

void SandboxWait::on_killed(TimeNs now) {
  if (state_ == State::kDead) return;
  go(State::kDead, now, "sandbox killed");
  held_.clear();
}

std::optional<TimeNs> SandboxWait::next_deadline() const {
  if (state_ != State::kWaiting || requests_.empty() || !idle_at_ || responding_.size() >= requests_.size())
    return std::nullopt;
  TimeNs t = waiting_since_ + cfg_.grace_ns;
  if (have_resumed_ && last_resume_done_ + cfg_.cooldown_ns > t) t = last_resume_done_ + cfg_.cooldown_ns;
  return t;
}

}  // namespace sg::wait
