// The prefetch predictor on synthetic traces: each source alone predicts
// what it should, the throttle cuts the budget under a random trace and
// restores it when predictions become right again, memory stays bounded.
#include <doctest/doctest.h>

#include <algorithm>
#include <random>
#include <set>
#include <vector>

#include "wait-engine/memory/prefetch.h"

using namespace sg::memory;

namespace {

std::vector<uint64_t> range(uint64_t from, uint64_t n) {
  std::vector<uint64_t> v;
  for (uint64_t i = 0; i < n; ++i) v.push_back(from + i);
  return v;
}

PredictorConfig only(bool history, bool hot, bool stride) {
  PredictorConfig c;
  c.use_history = history;
  c.use_hot_set = hot;
  c.use_stride = stride;
  return c;
}

}  // namespace

TEST_CASE("history alone predicts the sandbox's last post-resume trace, in order") {
  Predictor p(only(true, false, false));
  p.record_trace("a", "c", 0, range(100, 10));
  p.record_trace("a", "c", 1, std::vector<uint64_t>{7, 3, 7, 9});
  CHECK(p.predict("a", "c", 2, 100) == std::vector<uint64_t>{7, 3, 9});
  CHECK(p.predict("a", "c", 2, 2) == std::vector<uint64_t>{7, 3});
  CHECK(p.predict("b", "c", 2, 100).empty());  // another sandbox has no history
  CHECK(p.predict("a", "c", 2, 0).empty());
}

TEST_CASE("hot set alone: pages k siblings touched at that tool-call index, not the sandbox's own") {
  PredictorConfig c = only(false, true, false);
  c.hot_min_sandboxes = 2;
  Predictor p(c);
  p.record_trace("s1", "c", 3, std::vector<uint64_t>{1, 2, 3, 50});
  p.record_trace("s2", "c", 3, std::vector<uint64_t>{2, 3, 4, 60});
  p.record_trace("s3", "c", 3, std::vector<uint64_t>{3, 4, 70});
  p.record_trace("s4", "c", 4, std::vector<uint64_t>{1000, 1001});  // other index
  p.record_trace("x1", "other", 3, std::vector<uint64_t>{500, 501});
  p.record_trace("x2", "other", 3, std::vector<uint64_t>{500, 501});
  // For a new sibling: 3 (three siblings) first, then 2 and 4 (two each).
  CHECK(p.predict("new", "c", 3, 100) == std::vector<uint64_t>{3, 2, 4});
  // For s3, its own trace does not count: 2 (s1, s2), 3 (s1, s2).
  auto own = p.predict("s3", "c", 3, 100);
  CHECK(std::set<uint64_t>(own.begin(), own.end()) == std::set<uint64_t>{2, 3});
  CHECK(p.predict("new", "c", 5, 100).empty());
  CHECK(p.predict("new", "other", 3, 100) == std::vector<uint64_t>{500, 501});
}

TEST_CASE("history and hot set combined: pages in both come first, no duplicates") {
  Predictor p(only(true, true, false));
  p.record_trace("s1", "c", 0, std::vector<uint64_t>{10, 11});
  p.record_trace("s2", "c", 0, std::vector<uint64_t>{10, 11});
  p.record_trace("me", "c", 0, std::vector<uint64_t>{99, 11});
  auto v = p.predict("me", "c", 0, 100);
  CHECK(v == std::vector<uint64_t>{11, 10, 99});
}

TEST_CASE("stride alone: three faults at a constant stride continue it") {
  Predictor p(only(false, false, true));
  p.begin_restore("a");
  CHECK(p.on_fault("a", 10).empty());
  CHECK(p.on_fault("a", 12).empty());
  auto v = p.on_fault("a", 14);
  REQUIRE(v.size() == p.config().stride_ahead);
  CHECK(v[0] == 16);
  CHECK(v[1] == 18);
  CHECK(p.on_fault("a", 15).empty());  // stride broken
  // Descending strides stop at page 0.
  p.begin_restore("a");
  p.on_fault("a", 5);
  p.on_fault("a", 4);
  CHECK(p.on_fault("a", 3) == std::vector<uint64_t>{2, 1, 0});
  // Strides above max_stride are not strides.
  p.begin_restore("a");
  p.on_fault("a", 0);
  p.on_fault("a", 100);
  CHECK(p.on_fault("a", 200).empty());
  // begin_restore forgets the window.
  p.on_fault("a", 1);
  p.on_fault("a", 2);
  p.begin_restore("a");
  CHECK(p.on_fault("a", 3).empty());
  // Stride off: nothing.
  Predictor q(only(true, true, false));
  q.on_fault("a", 1);
  q.on_fault("a", 2);
  CHECK(q.on_fault("a", 3).empty());
}

TEST_CASE("throttle: a random trace shrinks the budget; right predictions restore it") {
  Predictor p;
  std::mt19937_64 rng(42);
  std::uniform_int_distribution<uint64_t> page(0, 1 << 20);
  auto random_trace = [&] {
    std::vector<uint64_t> v;
    for (int i = 0; i < 200; ++i) v.push_back(page(rng));
    return v;
  };
  p.record_trace("a", "c", 0, random_trace());
  CHECK(p.predict("a", "c", 0, 200).size() == 200);
  for (int i = 0; i < 10; ++i) {
    auto pred = p.predict("a", "c", 0, 200);
    auto touched = random_trace();
    p.report_outcome("a", pred, touched);
    p.record_trace("a", "c", 0, touched);
  }
  CHECK(p.scale("a") < 0.05);
  CHECK(p.predict("a", "c", 0, 200).size() < 10);
  auto st = p.stats("a");
  CHECK(st.wasted > 0);
  CHECK(st.missed > 0);
  CHECK(st.used + st.wasted == st.prefetched);
  // Now the sandbox repeats itself: the budget recovers to the full 200.
  auto fixed = range(0, 200);
  p.record_trace("a", "c", 0, fixed);
  for (int i = 0; i < 20; ++i) {
    auto pred = p.predict("a", "c", 0, 200);
    p.report_outcome("a", pred, fixed);
  }
  CHECK(p.scale("a") == doctest::Approx(1.0));
  CHECK(p.predict("a", "c", 0, 200).size() == 200);
  // Another sandbox is not throttled by a's misses.
  CHECK(p.scale("b") == doctest::Approx(1.0));
}

TEST_CASE("throttle off: the budget stays whatever the precision") {
  PredictorConfig c;
  c.throttle = false;
  Predictor p(c);
  p.record_trace("a", "c", 0, range(0, 100));
  for (int i = 0; i < 10; ++i) p.report_outcome("a", range(0, 100), range(1000, 100));
  CHECK(p.predict("a", "c", 0, 100).size() == 100);
}

TEST_CASE("memory is bounded: traces, sandboxes, keys and members are capped") {
  PredictorConfig c;
  c.max_trace_pages = 64;
  c.max_sandboxes = 10;
  c.max_hot_keys = 5;
  c.max_hot_members = 3;
  Predictor p(c);
  for (int s = 0; s < 100; ++s)
    for (uint32_t i = 0; i < 20; ++i)
      p.record_trace("s" + std::to_string(s), "c" + std::to_string(s % 7), i, range(s * 1000, 1000));
  auto m = p.memory();
  CHECK(m.sandboxes <= 10);
  CHECK(m.hot_keys <= 5);
  CHECK(m.stored_pages <= (10 + 5 * 3) * 64);
  CHECK(p.predict("s99", "c1", 19, 1000).size() <= 64 * 4);
  // The newest sandbox's history survived eviction.
  CHECK(p.predict("s99", "nocohort", 0, 1000) == range(99 * 1000, 64));
}

TEST_CASE("deterministic: the same inputs give the same predictions") {
  auto run = [] {
    Predictor p;
    std::mt19937_64 rng(7);
    std::vector<std::vector<uint64_t>> out;
    for (int r = 0; r < 30; ++r) {
      std::vector<uint64_t> t;
      for (int i = 0; i < 50; ++i) t.push_back(rng() % 500);
      std::string sb = "s" + std::to_string(r % 4);
      out.push_back(p.predict(sb, "c", r % 3, 40));
      p.report_outcome(sb, out.back(), t);
      p.record_trace(sb, "c", r % 3, t);
    }
    return out;
  };
  CHECK(run() == run());
}

TEST_CASE("throttle is per source: a wasteful history does not shrink a precise hot set") {
  PredictorConfig c = only(true, true, false);
  Predictor p(c);
  auto hot = range(0, 100);
  for (int r = 0; r < 10; ++r) {
    // Siblings keep touching 0..99 at index 0; "me" touches 0..99 plus a
    // new 100 pages each time, so its history is half wrong next time.
    p.record_trace("s1", "c", 0, hot);
    p.record_trace("s2", "c", 0, hot);
    auto pred = p.predict("me", "c", 0, 400);
    auto touched = hot;
    for (uint64_t i = 0; i < 100; ++i) touched.push_back(10000 * (r + 1) + i);
    p.report_outcome("me", pred, touched);
    p.record_trace("me", "c", 0, touched);
  }
  CHECK(p.scale("me", PrefetchSource::kHotSet) == doctest::Approx(1.0));
  CHECK(p.scale("me", PrefetchSource::kHistory) < 0.05);
  CHECK(p.scale("me") == p.scale("me", PrefetchSource::kHistory));
  auto pred = p.predict("me", "c", 0, 400);
  std::set<uint64_t> got(pred.begin(), pred.end());
  for (uint64_t i = 0; i < 100; ++i) CHECK(got.count(i) == 1);  // the whole hot set still comes
  CHECK(pred.size() < 100 + 20);                                 // the history's extra pages mostly do not
}

TEST_CASE("throttle: a stride that keeps being wrong shortens the stride run") {
  Predictor p(only(false, false, true));
  for (int r = 0; r < 10; ++r) {
    p.predict("a", "c", 0, 0);  // opens the outcome window
    p.begin_restore("a");
    p.on_fault("a", 1);
    p.on_fault("a", 2);
    auto more = p.on_fault("a", 3);
    p.report_outcome("a", more, std::vector<uint64_t>{1, 2, 3});
  }
  CHECK(p.scale("a", PrefetchSource::kStride) < 0.1);
  p.begin_restore("a");
  p.on_fault("a", 1);
  p.on_fault("a", 2);
  CHECK(p.on_fault("a", 3).size() == 1);
}
