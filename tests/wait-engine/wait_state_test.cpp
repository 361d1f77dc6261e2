// The wait coordinator's per-sandbox state machine (wait_state.cpp): every
// transition path with made-up times.
#include <doctest/doctest.h>

#include <algorithm>

#include "wait-engine/coordinator/wait_state.h"

using namespace sg::wait;

namespace {
constexpr TimeNs ms = 1'000'000;

bool has(const std::vector<Action>& a, Action x) { return std::find(a.begin(), a.end(), x) != a.end(); }

WaitConfig cfg() {
  WaitConfig c;
  c.grace_ns = 30 * ms;
  c.cooldown_ns = 200 * ms;
  c.idle_report_max_age_ns = 50 * ms;
  return c;
}

// Drives a sandbox into kPaused: request at t, idle at t+grace, pause done.
void pause_at(SandboxWait& w, uint64_t id, TimeNs t) {
  w.on_request_start(id, t);
  auto a = w.on_idle_report(true, t + 30 * ms);
  REQUIRE(has(a, Action::kPause));
  REQUIRE(w.state() == State::kPausing);
  w.on_pause_done(true, t + 31 * ms);
  REQUIRE(w.state() == State::kPaused);
}
}  // namespace

TEST_CASE("legal transitions are exactly the documented ones") {
  CHECK(legal(State::kRunning, State::kWaiting));
  CHECK_FALSE(legal(State::kRunning, State::kPaused));
  CHECK_FALSE(legal(State::kRunning, State::kPausing));
  CHECK(legal(State::kWaiting, State::kPausing));
  CHECK_FALSE(legal(State::kWaiting, State::kPaused));
  CHECK(legal(State::kPaused, State::kOffloading));
  CHECK_FALSE(legal(State::kPaused, State::kRunning));  // always through resuming
  CHECK(legal(State::kOffloaded, State::kResuming));
  CHECK_FALSE(legal(State::kOffloaded, State::kPaused));
  CHECK(legal(State::kResuming, State::kWaiting));
  for (State s : {State::kRunning, State::kWaiting, State::kPausing, State::kPaused, State::kOffloading,
                  State::kOffloaded, State::kResuming})
    CHECK(legal(s, State::kDead));
  for (State s : {State::kRunning, State::kWaiting, State::kDead}) CHECK_FALSE(legal(State::kDead, s));
}

TEST_CASE("a wait pauses only after the grace, with fresh idle evidence") {
  SandboxWait w(cfg());
  w.on_request_start(1, 0);
  CHECK(w.state() == State::kWaiting);
  CHECK_FALSE(w.next_deadline());               // no idle evidence yet: nothing timed
  CHECK(w.on_idle_report(true, 10 * ms).empty());  // inside the grace
  CHECK(w.next_deadline() == 30 * ms);
  CHECK(w.on_tick(29 * ms).empty());
  auto a = w.on_tick(30 * ms);
  CHECK(has(a, Action::kPause));
  CHECK(w.state() == State::kPausing);
  CHECK(w.stats().pauses == 1);
}

TEST_CASE("a busy report or stale evidence prevents the pause") {
  SandboxWait w(cfg());
  w.on_request_start(1, 0);
  w.on_idle_report(true, 5 * ms);
  w.on_idle_report(false, 20 * ms);  // a tool process became runnable
  CHECK(w.on_tick(40 * ms).empty());
  CHECK(w.state() == State::kWaiting);
  SandboxWait s(cfg());
  s.on_request_start(1, 0);
  s.on_idle_report(true, 0);
  CHECK(s.on_tick(60 * ms).empty());  // evidence 60 ms old: too old
  CHECK(has(s.on_idle_report(true, 60 * ms), Action::kPause));
}

TEST_CASE("the response resumes the sandbox; held responses go out after the resume") {
  SandboxWait w(cfg());
  pause_at(w, 1, 0);
  CHECK_FALSE(w.can_deliver());
  auto a = w.on_response_started(1, 500 * ms);
  CHECK(has(a, Action::kResume));
  CHECK(w.state() == State::kResuming);
  CHECK(w.on_response_ready(1, 510 * ms).empty());  // held: not running yet
  CHECK(w.held() == 1);
  auto r = w.on_resume_done(true, 520 * ms);
  CHECK(has(r, Action::kReleaseHeld));
  CHECK(w.can_deliver());
  CHECK(w.state() == State::kWaiting);  // request 1 not ended yet
  w.on_request_end(1, Outcome::kCompleted, 521 * ms);
  CHECK(w.state() == State::kRunning);
  CHECK(w.stats().paused_ns == 520 * ms - 30 * ms);
  CHECK(w.stats().waits_completed == 1);
}

TEST_CASE("a response ready while running is released at once") {
  SandboxWait w(cfg());
  w.on_request_start(1, 0);
  CHECK(has(w.on_response_ready(1, 5 * ms), Action::kReleaseHeld));
  CHECK(w.held() == 0);
}

TEST_CASE("a response during the pause itself resumes right after it") {
  SandboxWait w(cfg());
  w.on_request_start(1, 0);
  w.on_idle_report(true, 30 * ms);
  REQUIRE(w.state() == State::kPausing);
  CHECK(w.on_response_started(1, 31 * ms).empty());  // cannot resume a pause in flight
  auto a = w.on_pause_done(true, 32 * ms);
  CHECK(has(a, Action::kResume));
  CHECK(w.state() == State::kResuming);
}

TEST_CASE("a response being streamed is not a wait: no pause again until another request waits") {
  WaitConfig c = cfg();
  c.cooldown_ns = 0;
  SandboxWait w(c);
  pause_at(w, 1, 0);
  CHECK(has(w.on_response_started(1, 40 * ms), Action::kResume));
  w.on_resume_done(true, 41 * ms);
  REQUIRE(w.state() == State::kWaiting);
  // The stream goes on; the sandbox reads it and is idle: no pause.
  CHECK(w.on_idle_report(true, 200 * ms).empty());
  CHECK(w.on_tick(300 * ms).empty());
  CHECK_FALSE(w.next_deadline().has_value());
  CHECK(w.state() == State::kWaiting);
  // A second request that still waits makes it a wait again.
  w.on_request_start(2, 300 * ms);
  CHECK(has(w.on_idle_report(true, 340 * ms), Action::kPause));
  w.on_request_end(1, Outcome::kCompleted, 341 * ms);
  CHECK(w.state() == State::kPausing);
}

TEST_CASE("cooldown: no pause again right after a resume") {
  SandboxWait w(cfg());
  pause_at(w, 1, 0);
  w.on_response_started(1, 100 * ms);
  w.on_resume_done(true, 110 * ms);
  w.on_request_end(1, Outcome::kCompleted, 111 * ms);
  w.on_request_start(2, 120 * ms);
  CHECK(w.on_idle_report(true, 160 * ms).empty());  // grace over, cooldown not
  CHECK(w.next_deadline() == 310 * ms);
  CHECK(has(w.on_idle_report(true, 310 * ms), Action::kPause));
}

TEST_CASE("cancellation, upstream errors and client disconnects leave the sandbox running") {
  for (Outcome o : {Outcome::kCancelled, Outcome::kUpstreamError, Outcome::kClientGone}) {
    SandboxWait w(cfg());
    pause_at(w, 1, 0);
    auto a = w.on_request_end(1, o, 100 * ms);
    CHECK(has(a, Action::kResume));
    w.on_resume_done(true, 105 * ms);
    CHECK(w.state() == State::kRunning);
    CHECK(w.outstanding() == 0);
    CHECK(w.held() == 0);
  }
  SandboxWait w(cfg());
  w.on_request_start(1, 0);
  w.on_request_end(1, Outcome::kClientGone, 1 * ms);
  CHECK(w.state() == State::kRunning);
  CHECK(w.stats().waits_client_gone == 1);
}

TEST_CASE("with two requests out, ending one keeps the sandbox paused") {
  SandboxWait w(cfg());
  pause_at(w, 1, 0);
  w.on_request_start(2, 40 * ms);
  CHECK(w.on_request_end(1, Outcome::kCancelled, 50 * ms).empty());
  CHECK(w.state() == State::kPaused);
  CHECK(has(w.on_request_end(2, Outcome::kCancelled, 60 * ms), Action::kResume));
}

TEST_CASE("other traffic resumes a paused sandbox and invalidates idle evidence") {
  SandboxWait w(cfg());
  pause_at(w, 1, 0);
  CHECK(has(w.on_other_traffic(50 * ms), Action::kResume));
  w.on_resume_done(true, 55 * ms);
  CHECK(w.state() == State::kWaiting);
  CHECK_FALSE(w.next_deadline());  // needs a new idle report
}

TEST_CASE("offload only when enabled and the expected wait pays for it") {
  WaitConfig c = cfg();
  c.offload_enabled = true;
  c.offload_min_remaining_ns = 1000 * ms;
  SandboxWait w(c);
  w.on_request_start(1, 0);
  w.on_idle_report(true, 30 * ms);
  CHECK(w.on_pause_done(true, 31 * ms, 500 * ms).empty());
  CHECK(w.state() == State::kPaused);
  SandboxWait o(c);
  o.on_request_start(1, 0);
  o.on_idle_report(true, 30 * ms);
  CHECK(has(o.on_pause_done(true, 31 * ms, 5000 * ms), Action::kOffload));
  CHECK(o.state() == State::kOffloading);
  o.on_offload_done(false, 40 * ms);  // refused: stays paused
  CHECK(o.state() == State::kPaused);
  SandboxWait d(cfg());  // disabled: never
  d.on_request_start(1, 0);
  d.on_idle_report(true, 30 * ms);
  CHECK(d.on_pause_done(true, 31 * ms, 50000 * ms).empty());
  SandboxWait r(c);  // response during the offload: resume when it reports back
  r.on_request_start(1, 0);
  r.on_idle_report(true, 30 * ms);
  r.on_pause_done(true, 31 * ms, 5000 * ms);
  CHECK(r.on_response_started(1, 35 * ms).empty());
  CHECK(has(r.on_offload_done(true, 40 * ms), Action::kResume));
}

TEST_CASE("kill ends everything; a failed pause goes back to waiting; a failed resume is dead") {
  SandboxWait w(cfg());
  pause_at(w, 1, 0);
  w.on_response_ready(1, 40 * ms);
  w.on_killed(45 * ms);
  CHECK(w.state() == State::kDead);
  CHECK(w.held() == 0);
  CHECK(w.on_request_start(2, 50 * ms).empty());
  CHECK(w.on_other_traffic(50 * ms).empty());
  CHECK(w.state() == State::kDead);

  SandboxWait f(cfg());
  f.on_request_start(1, 0);
  f.on_idle_report(true, 30 * ms);
  f.on_pause_done(false, 31 * ms);
  CHECK(f.state() == State::kWaiting);
  CHECK(f.on_idle_report(true, 100 * ms).empty());  // cooldown spaces retries too

  SandboxWait g(cfg());
  pause_at(g, 1, 0);
  g.on_other_traffic(40 * ms);
  g.on_resume_done(false, 41 * ms);
  CHECK(g.state() == State::kDead);
}

TEST_CASE("every recorded transition is legal") {
  SandboxWait w(cfg());
  pause_at(w, 1, 0);
  w.on_response_started(1, 90 * ms);
  w.on_resume_done(true, 95 * ms);
  w.on_request_end(1, Outcome::kCompleted, 96 * ms);
  w.on_killed(100 * ms);
  REQUIRE(w.transitions().size() == 7);  // running waiting pausing paused resuming waiting running dead
  for (const auto& t : w.transitions()) CHECK(legal(t.from, t.to));
  CHECK(w.transitions().front().from == State::kRunning);
  CHECK(w.transitions().back().to == State::kDead);
}
