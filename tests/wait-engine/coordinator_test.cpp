// WaitCoordinator, the live owner of the wait state machines, with fake
// hooks: counters, a controllable idle answer, and pause/resume/idle hooks
// that can be made to fail or to block until the test releases them. The
// clock is the real monotonic clock (plus a jump the test may add), the
// grace 5 ms; every step waits on a condition with a deadline, never on a
// sleep.
#include <doctest/doctest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "wait-engine/coordinator/coordinator.h"
#include "base/sys.h"

using namespace sg;
using namespace sg::wait;
using namespace std::chrono_literals;

namespace {

constexpr TimeNs ms = 1'000'000;
constexpr TimeNs kGrace = 5 * ms;
constexpr TimeNs kBackoffCap = 10 * ms;

// Monotonic time plus an offset the test can bump ("a second passes").
struct TestClock {
  std::atomic<TimeNs> offset{0};
  TimeNs now() const { return sys::monotonic_ns() + offset.load(); }
};

// The gateway's side of the coordinator. Everything is guarded by mu and
// every change notifies cv, so tests wait for conditions on it. Never call
// the coordinator while holding mu: the transition hook takes mu under the
// sandbox's lock.
struct Fake {
  explicit Fake(TestClock& c) : clock(c) {}
  TestClock& clock;
  std::mutex mu;
  std::condition_variable cv;
  bool idle = true;
  bool fail_pause = false, fail_resume = false;
  bool block_pause = false, block_resume = false;
  int pauses = 0, pauses_returned = 0;
  int resumes = 0, resumes_returned = 0;
  int probes = 0;
  std::vector<std::string> killed;  // the kill hook's calls
  std::vector<TimeNs> probe_at;
  std::vector<std::pair<std::string, Transition>> log;

  CoordinatorHooks hooks() {
    CoordinatorHooks h;
    h.pause = [this](const std::string& sb) -> Status {
      std::unique_lock<std::mutex> l(mu);
      ++pauses;
      cv.notify_all();
      cv.wait(l, [&] { return !block_pause; });
      ++pauses_returned;
      cv.notify_all();
      if (fail_pause) return internal_error("freeze " + sb + ": injected failure");
      return Status::Ok();
    };
    h.resume = [this](const std::string& sb) -> Status {
      std::unique_lock<std::mutex> l(mu);
      ++resumes;
      cv.notify_all();
      cv.wait(l, [&] { return !block_resume; });
      ++resumes_returned;
      cv.notify_all();
      if (fail_resume) return internal_error("thaw " + sb + ": injected failure");
      return Status::Ok();
    };
    h.idle = [this](const std::string&) -> Result<bool> {
      std::lock_guard<std::mutex> l(mu);
      ++probes;
      probe_at.push_back(clock.now());
      cv.notify_all();
      return idle;
    };
    h.transition = [this](const std::string& sb, const Transition& t) {
      std::lock_guard<std::mutex> l(mu);
      log.emplace_back(sb, t);
      cv.notify_all();
    };
    h.kill = [this](const std::string& sb) {
      std::lock_guard<std::mutex> l(mu);
      killed.push_back(sb);
      cv.notify_all();
    };
    return h;
  }

  template <class Pred>
  bool until(Pred pred, std::chrono::milliseconds limit = 5000ms) {
    std::unique_lock<std::mutex> l(mu);
    return cv.wait_for(l, limit, pred);
  }
  // With mu held.
  int entered(const std::string& sb, State to) const {
    int n = 0;
    for (const auto& [s, t] : log)
      if (s == sb && t.to == to) ++n;
    return n;
  }
  std::vector<Transition> transitions_of(const std::string& sb) {
    std::lock_guard<std::mutex> l(mu);
    std::vector<Transition> out;
    for (const auto& [s, t] : log)
      if (s == sb) out.push_back(t);
    return out;
  }
  void set(bool Fake::*field, bool v) {
    {
      std::lock_guard<std::mutex> l(mu);
      this->*field = v;
    }
    cv.notify_all();
  }
  int get(int Fake::*field) {
    std::lock_guard<std::mutex> l(mu);
    return this->*field;
  }
};

CoordinatorConfig config(TimeNs cooldown = 10'000 * ms) {
  CoordinatorConfig c;
  c.wait.grace_ns = kGrace;
  // Long by default, so a sandbox resumed while a request is still out is
  // not paused again in the middle of a test.
  c.wait.cooldown_ns = cooldown;
  c.wait.idle_report_max_age_ns = 50 * ms;
  c.action_threads = 2;
  c.probe_backoff_max_ns = kBackoffCap;
  return c;
}

struct Rig {
  explicit Rig(CoordinatorConfig c = config()) : fake(clock) {
    co = std::make_unique<WaitCoordinator>(c, fake.hooks(), [this] { return clock.now(); });
  }
  TestClock clock;
  Fake fake;
  std::unique_ptr<WaitCoordinator> co;

  // A request on an idle sandbox, waited on until the sandbox is paused.
  WaitCoordinator::Ticket paused_request(const std::string& sb) {
    int before;
    {
      std::lock_guard<std::mutex> l(fake.mu);
      before = fake.entered(sb, State::kPaused);
    }
    WaitCoordinator::Ticket t = co->begin(sb, "tenant-a/model-x");
    REQUIRE(fake.until([&] { return fake.entered(sb, State::kPaused) > before; }));
    REQUIRE(co->state(sb) == State::kPaused);
    return t;
  }
};

// A delivery callback that records what the fake had seen when it fired.
// Shared, so a callback fired late (a failed test) touches nothing freed.
struct Delivery {
  struct Seen {
    std::atomic<int> fired{0};
    std::atomic<int> resumes_returned_then{-1};
  };
  std::shared_ptr<Seen> seen = std::make_shared<Seen>();
  int fired() const { return seen->fired.load(); }
  int resumes_returned_then() const { return seen->resumes_returned_then.load(); }
  std::function<void()> callback(Fake& f) {
    return [s = seen, &f] {
      {
        std::lock_guard<std::mutex> l(f.mu);
        s->resumes_returned_then = f.resumes_returned;
      }
      s->fired.fetch_add(1);
      f.cv.notify_all();
    };
  }
};

void check_chain(const std::vector<Transition>& ts) {
  REQUIRE_FALSE(ts.empty());
  CHECK(ts.front().from == State::kRunning);
  for (size_t i = 0; i < ts.size(); ++i) {
    CHECK_MESSAGE(legal(ts[i].from, ts[i].to), state_name(ts[i].from), " -> ", state_name(ts[i].to));
    if (i > 0) {
      CHECK(ts[i].from == ts[i - 1].to);
      CHECK(ts[i].at >= ts[i - 1].at);
    }
  }
}

std::vector<State> targets(const std::vector<Transition>& ts) {
  std::vector<State> out;
  for (const auto& t : ts) out.push_back(t.to);
  return out;
}

// The scheduler state of a thread of this process ('R', 'S', ...).
char thread_state(pid_t tid) {
  Result<std::string> stat = sys::read_file("/proc/self/task/" + std::to_string(tid) + "/stat");
  if (!stat) return '?';
  size_t p = stat->rfind(')');
  return p == std::string::npos || p + 2 >= stat->size() ? '?' : (*stat)[p + 2];
}

}  // namespace

TEST_CASE("an idle sandbox is paused while it waits and resumed before the response is delivered") {
  Rig r;
  Fake& f = r.fake;
  TimeNs began = r.clock.now();
  WaitCoordinator::Ticket t = r.co->begin("sb1", "tenant-a/model-x");
  REQUIRE(f.until([&] { return f.entered("sb1", State::kPaused) == 1; }));
  TimeNs seen_paused = r.clock.now();
  CHECK(r.co->state("sb1") == State::kPaused);
  CHECK(f.get(&Fake::probes) >= 1);
  CHECK(f.get(&Fake::pauses) == 1);
  CHECK(f.get(&Fake::resumes) == 0);
  {
    std::lock_guard<std::mutex> l(f.mu);
    REQUIRE_FALSE(f.probe_at.empty());
    CHECK(f.probe_at.front() >= began + kGrace);  // asked when the grace was over, not before
  }

  f.set(&Fake::block_resume, true);
  CHECK(r.co->response_started(t));  // it was stopped
  REQUIRE(f.until([&] { return f.resumes == 1; }));
  Delivery d;
  r.co->when_deliverable(t, d.callback(f));
  CHECK(d.fired() == 0);  // the resume has not returned
  CHECK(r.co->state("sb1") == State::kResuming);
  TimeNs released = r.clock.now();
  f.set(&Fake::block_resume, false);
  REQUIRE(f.until([&] { return d.fired() == 1; }));
  CHECK(d.resumes_returned_then() == 1);
  CHECK(r.co->state("sb1") == State::kWaiting);  // the request is still out

  TimeNs paused = r.co->end(t, Outcome::kCompleted);
  TimeNs ended = r.clock.now();
  CHECK(r.co->state("sb1") == State::kRunning);
  CHECK(paused >= released - seen_paused);  // stopped at least while the test held the resume
  CHECK(paused <= ended - began);
  CHECK(f.get(&Fake::pauses) == 1);
  CHECK(f.get(&Fake::resumes) == 1);
  CHECK(d.fired() == 1);

  std::vector<Transition> ts = f.transitions_of("sb1");
  check_chain(ts);
  CHECK(targets(ts) == std::vector<State>{State::kWaiting, State::kPausing, State::kPaused, State::kResuming,
                                          State::kWaiting, State::kRunning});
  WaitCoordinator::Totals tot = r.co->totals();
  CHECK(tot.pauses == 1);
  CHECK(tot.resumes == 1);
  CHECK(tot.waits_started == 1);
  CHECK(tot.waits_completed == 1);
  CHECK(tot.stopped_now == 0);
  CHECK(tot.sandboxes == 1);
  CHECK(tot.paused_seconds > 0);
}

TEST_CASE("a busy sandbox is never paused; the idle probes back off up to the cap") {
  Rig r;
  Fake& f = r.fake;
  f.set(&Fake::idle, false);
  TimeNs began = r.clock.now();
  WaitCoordinator::Ticket t = r.co->begin("busy", "tenant-a/model-x");
  constexpr int kProbes = 9;
  REQUIRE(f.until([&] { return f.probes >= kProbes; }));
  std::vector<TimeNs> at;
  {
    std::lock_guard<std::mutex> l(f.mu);
    at = f.probe_at;
  }
  CHECK(at[0] >= began + kGrace);
  // Each probe is at least the current backoff after the previous one:
  // grace, then doubling, capped. Without the cap the 8th gap would be 640 ms.
  TimeNs backoff = kGrace;
  for (int i = 1; i < kProbes; ++i) {
    TimeNs gap = at[i] - at[i - 1];
    CHECK_MESSAGE(gap >= backoff, "probe ", i, " came ", gap / 1000, " us after the last; backoff ", backoff / 1000);
    backoff = std::min(kBackoffCap, backoff * 2);
  }
  CHECK(at[kProbes - 1] - at[kProbes - 2] < 300 * ms);
  CHECK(f.get(&Fake::pauses) == 0);
  CHECK(r.co->state("busy") == State::kWaiting);
  CHECK(r.co->end(t, Outcome::kCompleted) == 0);
  CHECK(r.co->state("busy") == State::kRunning);
  CHECK(r.co->totals().probes >= static_cast<uint64_t>(kProbes));
}

TEST_CASE("a response that comes while the sandbox is pausing resumes it right after the pause") {
  Rig r;
  Fake& f = r.fake;
  f.set(&Fake::block_pause, true);
  WaitCoordinator::Ticket t = r.co->begin("sb1", "tenant-a/model-x");
  REQUIRE(f.until([&] { return f.pauses == 1; }));
  CHECK(r.co->state("sb1") == State::kPausing);
  CHECK(r.co->response_started(t));
  Delivery d;
  r.co->when_deliverable(t, d.callback(f));
  CHECK(d.fired() == 0);
  CHECK(f.get(&Fake::resumes) == 0);  // not while the pause is in progress

  f.set(&Fake::block_resume, true);
  f.set(&Fake::block_pause, false);
  REQUIRE(f.until([&] { return f.resumes == 1; }));
  CHECK(d.fired() == 0);
  CHECK(r.co->state("sb1") == State::kResuming);
  f.set(&Fake::block_resume, false);
  REQUIRE(f.until([&] { return d.fired() == 1; }));
  CHECK(d.resumes_returned_then() == 1);
  CHECK(r.co->end(t, Outcome::kCompleted) > 0);

  std::vector<Transition> ts = f.transitions_of("sb1");
  check_chain(ts);
  CHECK(targets(ts) ==
        std::vector<State>{State::kWaiting, State::kPausing, State::kResuming, State::kWaiting, State::kRunning});
}

TEST_CASE("ensure_running") {
  Rig r;
  Fake& f = r.fake;

  SUBCASE("an unknown sandbox is running") {
    CHECK(r.co->ensure_running("nobody", 1000ms));
    CHECK(f.get(&Fake::resumes) == 0);
  }

  SUBCASE("a sandbox that is not stopped needs nothing") {
    f.set(&Fake::idle, false);
    WaitCoordinator::Ticket t = r.co->begin("sb1", "k");
    CHECK(r.co->ensure_running("sb1", 1000ms));
    CHECK(f.get(&Fake::resumes) == 0);
    r.co->end(t, Outcome::kCompleted);
  }

  SUBCASE("a paused sandbox is resumed, and ensure_running returns only then") {
    WaitCoordinator::Ticket t = r.paused_request("sb1");
    f.set(&Fake::block_resume, true);
    std::atomic<bool> done{false};
    std::atomic<int> returned_then{-1};
    Status result = Status::Ok();
    std::thread other([&] {
      result = r.co->ensure_running("sb1", 5000ms);
      returned_then = f.get(&Fake::resumes_returned);
      done = true;
      f.cv.notify_all();
    });
    CHECK(f.until([&] { return f.resumes == 1; }));
    CHECK_FALSE(done.load());
    f.set(&Fake::block_resume, false);
    other.join();
    CHECK(result.ok());
    CHECK(returned_then == 1);
    CHECK(r.co->state("sb1") == State::kWaiting);
    r.co->end(t, Outcome::kCompleted);
    CHECK(r.co->state("sb1") == State::kRunning);
  }

  SUBCASE("a resume that takes longer than the timeout is a kTimeout") {
    WaitCoordinator::Ticket t = r.paused_request("sb1");
    f.set(&Fake::block_resume, true);
    Status s = r.co->ensure_running("sb1", 20ms);
    REQUIRE_FALSE(s.ok());
    CHECK(s.error().kind() == ErrorKind::kTimeout);
    CHECK(s.error().message().find("sb1") != std::string::npos);
    CHECK(f.get(&Fake::resumes) == 1);
    f.set(&Fake::block_resume, false);
    REQUIRE(f.until([&] { return f.entered("sb1", State::kWaiting) == 2; }));
    CHECK(r.co->ensure_running("sb1", 1000ms));
    r.co->end(t, Outcome::kCompleted);
  }
}

TEST_CASE("a failed resume leaves the sandbox dead, and pending deliveries still fire") {
  Rig r;
  Fake& f = r.fake;
  WaitCoordinator::Ticket t = r.paused_request("sb1");
  f.set(&Fake::fail_resume, true);
  f.set(&Fake::block_resume, true);
  CHECK(r.co->response_started(t));
  REQUIRE(f.until([&] { return f.resumes == 1; }));
  Delivery d;
  r.co->when_deliverable(t, d.callback(f));
  CHECK(d.fired() == 0);
  f.set(&Fake::block_resume, false);
  REQUIRE(f.until([&] { return d.fired() == 1; }));
  CHECK(r.co->state("sb1") == State::kDead);
  CHECK(r.co->totals().resume_failures == 1);
  CHECK(r.co->totals().stopped_now == 0);
  // Other traffic must not be told the sandbox runs: it is frozen.
  Status s = r.co->ensure_running("sb1", 1000ms);
  REQUIRE_FALSE(s.ok());
  CHECK(s.error().kind() == ErrorKind::kUnavailable);
  r.co->end(t, Outcome::kUpstreamError);
  // A later response on the dead sandbox goes out at once (its write fails there).
  WaitCoordinator::Ticket t2 = r.co->begin("sb1", "k");
  Delivery d2;
  r.co->when_deliverable(t2, d2.callback(f));
  CHECK(d2.fired() == 1);
  r.co->end(t2, Outcome::kCompleted);
  check_chain(f.transitions_of("sb1"));
  CHECK(f.get(&Fake::resumes) == 1);
  // The owner was told to kill the sandbox it cannot resume, once.
  REQUIRE(f.until([&] { return f.killed.size() == 1; }));
  std::lock_guard<std::mutex> l(f.mu);
  CHECK(f.killed == std::vector<std::string>{"sb1"});
}

TEST_CASE("a failed pause goes back to waiting, is counted, and does not hold the response") {
  Rig r;
  Fake& f = r.fake;
  f.set(&Fake::fail_pause, true);
  WaitCoordinator::Ticket t = r.co->begin("sb1", "k");
  REQUIRE(f.until([&] { return f.entered("sb1", State::kWaiting) == 2; }));
  CHECK(r.co->state("sb1") == State::kWaiting);
  CHECK(r.co->totals().pause_failures == 1);
  Delivery d;
  r.co->when_deliverable(t, d.callback(f));
  CHECK(d.fired() == 1);
  r.co->end(t, Outcome::kCompleted);
  CHECK(f.get(&Fake::resumes) == 0);
  std::vector<Transition> ts = f.transitions_of("sb1");
  check_chain(ts);
  CHECK(targets(ts) == std::vector<State>{State::kWaiting, State::kPausing, State::kWaiting, State::kRunning});
}

TEST_CASE("forget() during a wait fires pending deliveries; the pause that returns later changes nothing") {
  Rig r;
  Fake& f = r.fake;
  f.set(&Fake::block_pause, true);
  WaitCoordinator::Ticket t = r.co->begin("sb1", "k");
  REQUIRE(f.until([&] { return f.pauses == 1; }));
  r.co->response_started(t);
  Delivery d;
  r.co->when_deliverable(t, d.callback(f));
  CHECK(d.fired() == 0);
  r.co->forget("sb1");
  CHECK(d.fired() == 1);  // before forget returned
  CHECK_FALSE(r.co->state("sb1").has_value());
  CHECK(r.co->ensure_running("sb1", 1000ms));  // gone: nothing to wait for
  f.set(&Fake::block_pause, false);
  REQUIRE(f.until([&] { return f.pauses_returned == 1; }));
  r.co->end(t, Outcome::kClientGone);  // a ticket of a forgotten sandbox is harmless
  WaitCoordinator::Totals tot = r.co->totals();
  CHECK(tot.sandboxes == 0);
  CHECK(tot.pauses == 1);  // kept from the forgotten entry
  CHECK(tot.waits_started == 1);
  r.co.reset();  // joins the action threads: whatever the late pause result did is done
  CHECK(d.fired() == 1);
  CHECK(f.get(&Fake::resumes) == 0);
  std::vector<Transition> ts = f.transitions_of("sb1");
  check_chain(ts);
  CHECK(ts.back().to == State::kDead);
}

TEST_CASE("the destructor fires deliveries still pending") {
  Rig r;
  Fake& f = r.fake;
  f.set(&Fake::block_pause, true);
  WaitCoordinator::Ticket t = r.co->begin("sb1", "k");
  REQUIRE(f.until([&] { return f.pauses == 1; }));
  Delivery d;
  r.co->when_deliverable(t, d.callback(f));  // held: the sandbox is pausing
  CHECK(d.fired() == 0);
  std::atomic<pid_t> tid{0};
  std::thread destroyer([&] {
    tid = ::gettid();
    r.co.reset();
  });
  // The destructor has stopped the coordinator once it sleeps joining the
  // action thread that is stuck in the pause hook.
  auto limit = std::chrono::steady_clock::now() + 5s;
  while ((tid == 0 || thread_state(tid) != 'S') && std::chrono::steady_clock::now() < limit)
    std::this_thread::yield();
  CHECK(tid != 0);
  CHECK(thread_state(tid) == 'S');
  f.set(&Fake::block_pause, false);
  destroyer.join();
  CHECK(d.fired() == 1);
  CHECK(f.get(&Fake::resumes) == 0);  // the resume after the pause was dropped: the destructor delivered
}

TEST_CASE("two requests on one sandbox: one pause, resumed by the first response, waiting until both end") {
  Rig r;
  Fake& f = r.fake;
  WaitCoordinator::Ticket t1 = r.co->begin("sb1", "k");
  WaitCoordinator::Ticket t2 = r.co->begin("sb1", "k");
  REQUIRE(f.until([&] { return f.entered("sb1", State::kPaused) == 1; }));
  CHECK(r.co->response_started(t1));
  REQUIRE(f.until([&] { return f.entered("sb1", State::kWaiting) == 2; }));
  Delivery d1;
  r.co->when_deliverable(t1, d1.callback(f));
  CHECK(d1.fired() == 1);
  r.co->end(t1, Outcome::kCompleted);
  CHECK(r.co->state("sb1") == State::kWaiting);
  CHECK_FALSE(r.co->response_started(t2));  // running by now
  Delivery d2;
  r.co->when_deliverable(t2, d2.callback(f));
  CHECK(d2.fired() == 1);
  r.co->end(t2, Outcome::kCompleted);
  CHECK(r.co->state("sb1") == State::kRunning);
  CHECK(f.get(&Fake::pauses) == 1);
  CHECK(f.get(&Fake::resumes) == 1);
  CHECK(r.co->totals().waits_started == 2);
  CHECK(r.co->totals().waits_completed == 2);
  check_chain(f.transitions_of("sb1"));
}

TEST_CASE("after a resume with a request still out, the next pause waits for the cooldown") {
  constexpr TimeNs kCooldown = 40 * ms;
  Rig r(config(kCooldown));
  Fake& f = r.fake;
  WaitCoordinator::Ticket t1 = r.co->begin("sb1", "k");
  WaitCoordinator::Ticket t2 = r.co->begin("sb1", "k");
  REQUIRE(f.until([&] { return f.entered("sb1", State::kPaused) == 1; }));
  r.co->response_started(t1);
  r.co->end(t1, Outcome::kCompleted);
  REQUIRE(f.until([&] { return f.entered("sb1", State::kPaused) == 2; }));
  std::vector<Transition> ts = f.transitions_of("sb1");
  check_chain(ts);
  TimeNs resumed = 0, repaused = 0;
  for (const Transition& x : ts) {
    if (x.from == State::kResuming && !resumed) resumed = x.at;
    if (x.to == State::kPausing && resumed) repaused = x.at;
  }
  REQUIRE(resumed);
  REQUIRE(repaused);
  CHECK(repaused - resumed >= kCooldown);
  r.co->end(t2, Outcome::kCancelled);  // the last request ending resumes it
  REQUIRE(f.until([&] { return f.entered("sb1", State::kRunning) == 1; }));
  CHECK(f.get(&Fake::resumes) == 2);
}

TEST_CASE("end() returns the time the sandbox was stopped while that request was out") {
  Rig r;
  Fake& f = r.fake;

  SUBCASE("a request that ends while the sandbox is still paused") {
    WaitCoordinator::Ticket t = r.paused_request("sb1");
    r.clock.offset += 1000 * ms;
    TimeNs p = r.co->end(t, Outcome::kCancelled);
    CHECK(p >= 1000 * ms);
    CHECK(p < 1500 * ms);
    REQUIRE(f.until([&] { return f.entered("sb1", State::kRunning) == 1; }));
  }

  SUBCASE("a request that begins while the sandbox is already paused (regression: counted the pause before it)") {
    WaitCoordinator::Ticket t1 = r.paused_request("sb1");
    r.clock.offset += 1000 * ms;
    TimeNs begun = r.clock.now();
    WaitCoordinator::Ticket t2 = r.co->begin("sb1", "k");
    r.co->response_started(t2);
    REQUIRE(f.until([&] { return f.entered("sb1", State::kWaiting) == 2; }));
    TimeNs p2 = r.co->end(t2, Outcome::kCompleted);
    TimeNs ended = r.clock.now();
    TimeNs p1 = r.co->end(t1, Outcome::kCompleted);
    CHECK(p1 >= 1000 * ms);
    CHECK(p2 <= ended - begun);
  }

  SUBCASE("a request that never paused") {
    f.set(&Fake::idle, false);
    WaitCoordinator::Ticket t = r.co->begin("sb1", "k");
    REQUIRE(f.until([&] { return f.probes >= 1; }));
    CHECK(r.co->end(t, Outcome::kCompleted) == 0);
  }
}

TEST_CASE("render_metrics is Prometheus text and its counters match totals()") {
  Rig r;
  Fake& f = r.fake;
  // One completed pause/resume cycle, one failed pause, one upstream error.
  WaitCoordinator::Ticket t = r.paused_request("sb1");
  r.co->response_started(t);
  REQUIRE(f.until([&] { return f.entered("sb1", State::kWaiting) == 2; }));
  r.co->end(t, Outcome::kCompleted);
  f.set(&Fake::fail_pause, true);
  WaitCoordinator::Ticket u = r.co->begin("sb2", "k");
  REQUIRE(f.until([&] { return f.entered("sb2", State::kWaiting) == 2; }));
  r.co->end(u, Outcome::kUpstreamError);

  std::string text;
  r.co->render_metrics(text);
  WaitCoordinator::Totals tot = r.co->totals();
  REQUIRE_FALSE(text.empty());
  CHECK(text.back() == '\n');

  static const std::regex sample(
      R"(^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*"(?:,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*")*\})? ([^ ]+)$)");
  static const std::regex type_line(R"(^# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge|histogram|summary|untyped)$)");
  std::map<std::string, std::string> types;  // family -> type
  std::map<std::string, double> values;      // name{labels} -> value
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    CAPTURE(line);
    REQUIRE_FALSE(line.empty());
    if (line[0] == '#') {
      std::smatch m;
      if (std::regex_match(line, m, type_line)) {
        CHECK(types.count(m[1]) == 0);  // one TYPE per family
        types[m[1]] = m[2];
      } else {
        CHECK(line.rfind("# HELP ", 0) == 0);
      }
      continue;
    }
    std::smatch m;
    REQUIRE(std::regex_match(line, m, sample));
    std::string name = m[1], value = m[3];
    std::string family = name;
    for (const char* suffix : {"_bucket", "_sum", "_count"}) {
      std::string s = suffix;
      if (family.size() > s.size() && family.compare(family.size() - s.size(), s.size(), s) == 0 &&
          types.count(family.substr(0, family.size() - s.size())))
        family = family.substr(0, family.size() - s.size());
    }
    CHECK_MESSAGE(types.count(family) == 1, "no # TYPE before ", name);
    double v;
    if (value == "+Inf") v = INFINITY;
    else {
      char* end = nullptr;
      v = std::strtod(value.c_str(), &end);
      CHECK(*end == '\0');
    }
    values[name + std::string(m[2])] = v;
  }
  CHECK(values.at("sandgate_wait_pauses_total") == tot.pauses);
  CHECK(values.at("sandgate_wait_resumes_total") == tot.resumes);
  CHECK(values.at("sandgate_wait_action_failures_total{action=\"pause\"}") == tot.pause_failures);
  CHECK(values.at("sandgate_wait_action_failures_total{action=\"resume\"}") == tot.resume_failures);
  CHECK(values.at("sandgate_wait_idle_probes_total") == tot.probes);
  CHECK(values.at("sandgate_wait_stopped_sandboxes") == tot.stopped_now);
  CHECK(values.at("sandgate_wait_paused_seconds_total") == doctest::Approx(tot.paused_seconds).epsilon(1e-6));
  CHECK(values.at("sandgate_waits_total{outcome=\"started\"}") == tot.waits_started);
  CHECK(values.at("sandgate_waits_total{outcome=\"completed\"}") == tot.waits_completed);
  CHECK(values.at("sandgate_waits_total{outcome=\"upstream_error\"}") == tot.waits_upstream_error);
  CHECK(values.at("sandgate_waits_total{outcome=\"client_gone\"}") == tot.waits_client_gone);
  CHECK(values.at("sandgate_waits_total{outcome=\"cancelled\"}") == tot.waits_cancelled);
  CHECK(tot.pauses == 2);
  CHECK(tot.pause_failures == 1);
  CHECK(tot.waits_started == 2);
  CHECK(tot.waits_upstream_error == 1);
  // Every pause attempt is timed; each stop that ended is one paused duration.
  CHECK(values.at("sandgate_wait_pause_latency_seconds_count") == tot.pauses);
  CHECK(values.at("sandgate_wait_pause_latency_seconds_bucket{le=\"+Inf\"}") == tot.pauses);
  CHECK(values.at("sandgate_wait_resume_latency_seconds_count") == tot.resumes);
  CHECK(values.at("sandgate_wait_paused_duration_seconds_count") == 2);
  CHECK(types.at("sandgate_wait_pause_latency_seconds") == "histogram");
  CHECK(types.at("sandgate_wait_stopped_sandboxes") == "gauge");
  CHECK(types.at("sandgate_waits_total") == "counter");
}

// ---- Offload (the memory engine's hook) ----

namespace {

// An offload hook that can succeed, fail, or run until it is cancelled
// (a stand-in for encoding pages, checking the flag between them).
struct OffloadFake {
  std::mutex mu;
  std::condition_variable cv;
  enum class Mode { kSucceed, kFail, kNoSlot, kUntilCancelled, kOneSlot } mode = Mode::kSucceed;
  int calls = 0, returned = 0, saw_cancel = 0;
  int running = 0;       // kOneSlot: offloads holding the one slot
  bool release = false;  // kOneSlot: the slot's holder may finish

  void install(CoordinatorHooks& h) {
    h.offload = [this](const std::string&, const std::atomic<bool>& cancel) -> Status {
      std::unique_lock<std::mutex> l(mu);
      ++calls;
      cv.notify_all();
      Status s = Status::Ok();
      if (mode == Mode::kFail) {
        s = Error(ErrorKind::kUnavailable, "pool full (injected)");
      } else if (mode == Mode::kNoSlot) {
        s = Error(ErrorKind::kQuota, "memory offload: CPU budget in use by other offloads");
      } else if (mode == Mode::kOneSlot) {
        if (running > 0) {
          s = Error(ErrorKind::kQuota, "memory offload: CPU budget in use by other offloads");
        } else {
          ++running;
          cv.wait_for(l, 5s, [&] { return release; });
          --running;
        }
      } else if (mode == Mode::kUntilCancelled) {
        // Polls the flag as the engine does between pages (nothing
        // notifies a flag), with a deadline.
        auto deadline = std::chrono::steady_clock::now() + 5s;
        while (!cancel.load() && std::chrono::steady_clock::now() < deadline) cv.wait_for(l, 1ms);
        bool stopped = cancel.load();
        if (stopped) ++saw_cancel;
        s = stopped ? Status(Error(ErrorKind::kConflict, "offload cancelled")) : Status::Ok();
      }
      ++returned;
      cv.notify_all();
      return s;
    };
  }
  template <class Pred>
  bool until(Pred pred) {
    std::unique_lock<std::mutex> l(mu);
    return cv.wait_for(l, 5s, pred);
  }
};

struct OffloadRig {
  explicit OffloadRig(OffloadFake::Mode mode, std::function<bool()> wanted = {}) : fake(clock) {
    off.mode = mode;
    CoordinatorConfig c = config();
    c.wait.offload_enabled = true;
    c.wait.offload_min_remaining_ns = 0;  // every pause offloads
    CoordinatorHooks h = fake.hooks();
    off.install(h);
    h.offload_wanted = std::move(wanted);
    co = std::make_unique<WaitCoordinator>(c, std::move(h), [this] { return clock.now(); });
  }
  ~OffloadRig() {
    // Wake a hook still polling so the coordinator's threads can join.
    off.cv.notify_all();
  }
  TestClock clock;
  Fake fake;
  OffloadFake off;
  std::unique_ptr<WaitCoordinator> co;
};

}  // namespace

TEST_CASE("offload: a paused sandbox is offloaded; the response resumes it from offloaded before delivery") {
  OffloadRig r(OffloadFake::Mode::kSucceed);
  auto t = r.co->begin("sb", "tenant-a/model-x");
  REQUIRE(r.fake.until([&] { return r.fake.entered("sb", State::kOffloaded) == 1; }));
  CHECK(r.co->state("sb") == State::kOffloaded);
  Delivery d;
  r.co->response_started(t);
  r.co->when_deliverable(t, d.callback(r.fake));
  REQUIRE(r.fake.until([&] { return d.fired() == 1; }));
  CHECK(d.resumes_returned_then() == 1);
  r.co->end(t, Outcome::kCompleted);
  auto ts = r.fake.transitions_of("sb");
  check_chain(ts);
  std::vector<State> to;
  for (auto& x : ts) to.push_back(x.to);
  CHECK(to == std::vector<State>{State::kWaiting, State::kPausing, State::kPaused, State::kOffloading,
                                 State::kOffloaded, State::kResuming, State::kWaiting, State::kRunning});
  std::string m;
  r.co->render_metrics(m);
  CHECK(m.find("sandgate_wait_offloads_total{result=\"done\"} 1") != std::string::npos);
}

TEST_CASE("offload: a response during the offload cancels it; the sandbox resumes, whole") {
  OffloadRig r(OffloadFake::Mode::kUntilCancelled);
  auto t = r.co->begin("sb", "tenant-a/model-x");
  REQUIRE(r.off.until([&] { return r.off.calls == 1; }));
  CHECK(r.co->state("sb") == State::kOffloading);
  Delivery d;
  r.co->response_started(t);
  r.co->when_deliverable(t, d.callback(r.fake));
  // The flag reaches the hook (no timeout), it stops, the sandbox resumes.
  REQUIRE(r.off.until([&] { return r.off.returned == 1; }));
  CHECK(r.off.saw_cancel == 1);
  REQUIRE(r.fake.until([&] { return d.fired() == 1; }));
  CHECK(r.fake.get(&Fake::resumes_returned) == 1);
  CHECK(r.fake.entered("sb", State::kOffloaded) == 0);
  r.co->end(t, Outcome::kCompleted);
  std::string m;
  r.co->render_metrics(m);
  CHECK(m.find("sandgate_wait_offloads_total{result=\"cancelled\"} 1") != std::string::npos);
}

TEST_CASE("offload: other traffic and kill cancel a running offload too") {
  SUBCASE("ensure_running") {
    OffloadRig r(OffloadFake::Mode::kUntilCancelled);
    auto t = r.co->begin("sb", "tenant-a/model-x");
    REQUIRE(r.off.until([&] { return r.off.calls == 1; }));
    Status er = r.co->ensure_running("sb", 5000ms);
    CHECK_MESSAGE(er, (er ? "" : er.error().message()));
    CHECK(r.off.saw_cancel == 1);
    CHECK(r.co->state("sb") == State::kWaiting);
    r.co->end(t, Outcome::kCompleted);
  }
  SUBCASE("forget") {
    OffloadRig r(OffloadFake::Mode::kUntilCancelled);
    auto t = r.co->begin("sb", "tenant-a/model-x");
    REQUIRE(r.off.until([&] { return r.off.calls == 1; }));
    r.co->forget("sb");
    REQUIRE(r.off.until([&] { return r.off.returned == 1; }));
    CHECK(r.off.saw_cancel == 1);
    CHECK_FALSE(r.co->state("sb"));
    r.co->end(t, Outcome::kCancelled);
  }
}

TEST_CASE("offload: a failed offload leaves the sandbox paused; the response resumes it") {
  OffloadRig r(OffloadFake::Mode::kFail);
  auto t = r.co->begin("sb", "tenant-a/model-x");
  REQUIRE(r.off.until([&] { return r.off.returned == 1; }));
  REQUIRE(r.fake.until([&] {
    return r.fake.entered("sb", State::kPaused) == 2;  // paused, offloading, paused again
  }));
  CHECK(r.co->state("sb") == State::kPaused);
  Delivery d;
  r.co->response_started(t);
  r.co->when_deliverable(t, d.callback(r.fake));
  REQUIRE(r.fake.until([&] { return d.fired() == 1; }));
  r.co->end(t, Outcome::kCompleted);
  std::string m;
  r.co->render_metrics(m);
  CHECK(m.find("sandgate_wait_offloads_total{result=\"failed\"} 1") != std::string::npos);
}

TEST_CASE("offload: without the hook, or with a history that does not pay, a wait only pauses") {
  SUBCASE("no hook") {
    CoordinatorConfig c = config();
    c.wait.offload_enabled = true;
    c.wait.offload_min_remaining_ns = 0;
    Rig r(c);
    auto t = r.paused_request("sb");
    CHECK(r.co->state("sb") == State::kPaused);
    r.co->end(t, Outcome::kCancelled);
    std::lock_guard<std::mutex> l(r.fake.mu);
    CHECK(r.fake.entered("sb", State::kOffloading) == 0);
  }
  SUBCASE("unknown history with a minimum wait") {
    OffloadFake off;
    TestClock clock;
    Fake fake(clock);
    CoordinatorConfig c = config();
    c.wait.offload_enabled = true;
    c.wait.offload_min_remaining_ns = 2000 * ms;
    CoordinatorHooks h = fake.hooks();
    off.install(h);
    WaitCoordinator co(c, std::move(h), [&] { return clock.now(); });
    auto t = co.begin("sb", "tenant-a/model-x");
    REQUIRE(fake.until([&] { return fake.entered("sb", State::kPaused) == 1; }));
    CHECK(co.state("sb") == State::kPaused);
    co.end(t, Outcome::kCancelled);
    CHECK(off.calls == 0);
  }
}

TEST_CASE("offload: a sandbox that found no CPU slot offloads when the offload holding it ends") {
  OffloadRig r(OffloadFake::Mode::kOneSlot);
  auto ta = r.co->begin("a", "tenant-a/model-x");
  REQUIRE(r.off.until([&] { return r.off.running == 1; }));  // a holds the slot
  auto tb = r.co->begin("b", "tenant-a/model-x");
  REQUIRE(r.off.until([&] { return r.off.returned == 1; }));  // b found none
  REQUIRE(r.fake.until([&] { return r.fake.entered("b", State::kPaused) == 2; }));
  CHECK(r.co->state("b") == State::kPaused);
  {
    std::lock_guard<std::mutex> l(r.off.mu);
    r.off.release = true;
  }
  r.off.cv.notify_all();
  REQUIRE(r.fake.until([&] { return r.fake.entered("a", State::kOffloaded) == 1; }));
  REQUIRE(r.fake.until([&] { return r.fake.entered("b", State::kOffloaded) == 1; }));
  CHECK(r.co->state("b") == State::kOffloaded);
  check_chain(r.fake.transitions_of("b"));
  std::string m;
  r.co->render_metrics(m);
  CHECK(m.find("sandgate_wait_offloads_total{result=\"skipped\"} 1") != std::string::npos);
  CHECK(m.find("sandgate_wait_offloads_total{result=\"done\"} 2") != std::string::npos);
  r.co->end(ta, Outcome::kCancelled);
  r.co->end(tb, Outcome::kCancelled);
}

TEST_CASE("offload: a sandbox resumed while it waited for a slot is not offloaded when one comes free") {
  OffloadRig r(OffloadFake::Mode::kOneSlot);
  auto ta = r.co->begin("a", "tenant-a/model-x");
  REQUIRE(r.off.until([&] { return r.off.running == 1; }));
  auto tb = r.co->begin("b", "tenant-a/model-x");
  REQUIRE(r.off.until([&] { return r.off.returned == 1; }));
  REQUIRE(r.fake.until([&] { return r.fake.entered("b", State::kPaused) == 2; }));
  r.co->end(tb, Outcome::kCancelled);  // b's wait is over: it resumes
  REQUIRE(r.fake.until([&] { return r.fake.entered("b", State::kRunning) >= 1; }));
  {
    std::lock_guard<std::mutex> l(r.off.mu);
    r.off.release = true;
  }
  r.off.cv.notify_all();
  REQUIRE(r.fake.until([&] { return r.fake.entered("a", State::kOffloaded) == 1; }));
  r.co->end(ta, Outcome::kCancelled);
  REQUIRE(r.fake.until([&] { return r.fake.entered("a", State::kRunning) >= 1; }));
  std::lock_guard<std::mutex> l(r.off.mu);
  CHECK(r.off.calls == 2);  // a's, and b's refused one: none after
  CHECK(r.fake.entered("b", State::kOffloading) == 1);
}

TEST_CASE("offload: no CPU slot is 'skipped' (the sandbox stays paused); a gate that says no means no offload") {
  SUBCASE("no slot") {
    OffloadRig r(OffloadFake::Mode::kNoSlot);
    auto t = r.co->begin("sb", "tenant-a/model-x");
    REQUIRE(r.off.until([&] { return r.off.returned == 1; }));
    REQUIRE(r.fake.until([&] { return r.fake.entered("sb", State::kPaused) == 2; }));
    CHECK(r.co->state("sb") == State::kPaused);
    r.co->end(t, Outcome::kCancelled);
    std::string m;
    r.co->render_metrics(m);
    CHECK(m.find("sandgate_wait_offloads_total{result=\"skipped\"} 1") != std::string::npos);
    CHECK(m.find("sandgate_wait_offloads_total{result=\"failed\"} 0") != std::string::npos);
  }
  SUBCASE("gate closed") {
    std::atomic<int> asked{0};
    OffloadRig r(OffloadFake::Mode::kSucceed, [&] {
      asked.fetch_add(1);
      return false;
    });
    auto t = r.co->begin("sb", "tenant-a/model-x");
    REQUIRE(r.fake.until([&] { return r.fake.entered("sb", State::kPaused) == 1; }));
    CHECK(r.co->state("sb") == State::kPaused);
    CHECK(asked.load() == 1);
    r.co->end(t, Outcome::kCancelled);
    std::lock_guard<std::mutex> l(r.off.mu);
    CHECK(r.off.calls == 0);
  }
}
