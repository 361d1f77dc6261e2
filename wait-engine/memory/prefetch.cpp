// Prefetch predictor (prefetch.h). Everything here is bounded by the caps
// in PredictorConfig; no clock, no randomness.
#include "wait-engine/memory/prefetch.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <unordered_set>

namespace sg::memory {

namespace {

// First occurrences, in order, at most cap.
std::vector<uint64_t> dedup_capped(std::span<const uint64_t> pages, size_t cap) {
  std::vector<uint64_t> out;
  std::unordered_set<uint64_t> seen;
  for (uint64_t p : pages) {
    if (out.size() >= cap) break;
    if (seen.insert(p).second) out.push_back(p);
  }
  return out;
}

}  // namespace

Predictor::Predictor(PredictorConfig cfg) : cfg_(cfg) {}

Predictor::SandboxState& Predictor::sandbox(const std::string& id) {
  auto& s = sandboxes_[id];
  s.last_use = ++clock_;
  return s;
}

void Predictor::evict() {
  while (sandboxes_.size() > cfg_.max_sandboxes) {
    auto victim = std::min_element(sandboxes_.begin(), sandboxes_.end(),
                                   [](auto& a, auto& b) { return a.second.last_use < b.second.last_use; });
    sandboxes_.erase(victim);
  }
  while (hot_.size() > cfg_.max_hot_keys) {
    auto victim =
        std::min_element(hot_.begin(), hot_.end(), [](auto& a, auto& b) { return a.second.last_use < b.second.last_use; });
    hot_.erase(victim);
  }
}

void Predictor::record_trace(const std::string& sb, const std::string& cohort, uint32_t idx,
                             std::span<const uint64_t> pages) {
  auto trace = dedup_capped(pages, cfg_.max_trace_pages);
  sandbox(sb).history = trace;
  auto& key = hot_[Key{cohort, idx}];
  key.last_use = ++clock_;
  key.members[sb] = std::move(trace);
  key.member_seq[sb] = clock_;
  while (key.members.size() > cfg_.max_hot_members) {
    auto oldest = std::min_element(key.member_seq.begin(), key.member_seq.end(),
                                   [](auto& a, auto& b) { return a.second < b.second; });
    key.members.erase(oldest->first);
    key.member_seq.erase(oldest);
  }
  evict();
}

size_t Predictor::budget_for(const SandboxState& s, PrefetchSource src, size_t budget) const {
  if (budget == 0) return 0;
  if (!cfg_.throttle) return budget;
  double scale = s.st.source_scale[static_cast<size_t>(src)];
  auto b = static_cast<size_t>(std::floor(static_cast<double>(budget) * scale));
  return std::max<size_t>(b, 1);
}

void Predictor::issue(SandboxState& s, uint64_t page, PrefetchSource src) const {
  if (s.issued.size() < 2 * cfg_.max_trace_pages) s.issued.emplace(page, src);
}

std::vector<uint64_t> Predictor::predict(const std::string& sb, const std::string& cohort, uint32_t idx,
                                         size_t budget_pages) {
  auto& s = sandbox(sb);
  s.issued.clear();
  const size_t hot_budget = budget_for(s, PrefetchSource::kHotSet, budget_pages);
  const size_t hist_budget = budget_for(s, PrefetchSource::kHistory, budget_pages);
  std::vector<uint64_t> hot;  // ordered: most siblings first, then first seen
  if (cfg_.use_hot_set) {
    auto it = hot_.find(Key{cohort, idx});
    if (it != hot_.end()) {
      it->second.last_use = ++clock_;
      std::map<uint64_t, std::pair<uint32_t, uint64_t>> count;  // page -> (siblings, first position)
      uint64_t pos = 0;
      for (auto& [member, trace] : it->second.members) {
        if (member == sb) continue;
        for (uint64_t p : trace) {
          auto [c, inserted] = count.try_emplace(p, 0, pos);
          ++c->second.first;
          ++pos;
        }
      }
      std::vector<std::pair<uint64_t, std::pair<uint32_t, uint64_t>>> v;
      for (auto& e : count)
        if (e.second.first >= cfg_.hot_min_sandboxes) v.push_back(e);
      std::sort(v.begin(), v.end(), [](auto& a, auto& b) {
        if (a.second.first != b.second.first) return a.second.first > b.second.first;
        return a.second.second < b.second.second;
      });
      for (auto& e : v) hot.push_back(e.first);
    }
  }
  const std::vector<uint64_t> empty;
  const auto& hist = cfg_.use_history ? s.history : empty;
  std::vector<uint64_t> out;
  std::unordered_set<uint64_t> taken;
  size_t n_hot = 0, n_hist = 0;
  auto add = [&](uint64_t p, PrefetchSource src) {
    size_t& n = src == PrefetchSource::kHotSet ? n_hot : n_hist;
    size_t cap = src == PrefetchSource::kHotSet ? hot_budget : hist_budget;
    if (out.size() >= budget_pages || n >= cap || taken.count(p)) return;
    taken.insert(p);
    out.push_back(p);
    ++n;
    issue(s, p, src);
  };
  std::unordered_set<uint64_t> hotset(hot.begin(), hot.end());
  for (uint64_t p : hist)
    if (hotset.count(p)) add(p, PrefetchSource::kHotSet);
  for (uint64_t p : hot) add(p, PrefetchSource::kHotSet);
  for (uint64_t p : hist) add(p, PrefetchSource::kHistory);
  return out;
}

void Predictor::begin_restore(const std::string& sb) { sandbox(sb).n_recent = 0; }

std::vector<uint64_t> Predictor::on_fault(const std::string& sb, uint64_t page) {
  auto& s = sandbox(sb);
  s.recent[0] = s.recent[1];
  s.recent[1] = s.recent[2];
  s.recent[2] = page;
  s.n_recent = std::min(s.n_recent + 1, 3);
  std::vector<uint64_t> out;
  if (!cfg_.use_stride || s.n_recent < 3) return out;
  int64_t d1 = static_cast<int64_t>(s.recent[1] - s.recent[0]);
  int64_t d2 = static_cast<int64_t>(s.recent[2] - s.recent[1]);
  int64_t mag = d1 < 0 ? -d1 : d1;
  if (d1 != d2 || mag < 1 || mag > static_cast<int64_t>(cfg_.max_stride)) return out;
  size_t n = budget_for(s, PrefetchSource::kStride, cfg_.stride_ahead);
  uint64_t p = page;
  for (size_t i = 0; i < n; ++i) {
    if (d1 < 0 && p < static_cast<uint64_t>(mag)) break;
    p += static_cast<uint64_t>(d1);
    out.push_back(p);
    issue(s, p, PrefetchSource::kStride);
  }
  return out;
}

void Predictor::report_outcome(const std::string& sb, std::span<const uint64_t> prefetched,
                               std::span<const uint64_t> touched) {
  auto& s = sandbox(sb);
  std::unordered_set<uint64_t> t(touched.begin(), touched.end());
  std::unordered_set<uint64_t> pf(prefetched.begin(), prefetched.end());
  uint64_t used = 0;
  for (uint64_t p : pf) used += t.count(p);
  s.st.prefetched += pf.size();
  s.st.used += used;
  s.st.wasted += pf.size() - used;
  s.st.missed += t.size() - used;
  std::array<uint64_t, kPrefetchSources> src_pf{}, src_used{};
  for (uint64_t p : pf) {
    auto it = s.issued.find(p);
    if (it == s.issued.end()) continue;  // not ours (the caller's own): overall counters only
    auto i = static_cast<size_t>(it->second);
    ++src_pf[i];
    src_used[i] += t.count(p);
  }
  s.issued.clear();
  if (pf.empty()) return;  // nothing learned about precision
  const double w = cfg_.precision_weight;
  auto ewma = [w](double& acc, double x) { acc = w * x + (1 - w) * acc; };
  ewma(s.st.precision, static_cast<double>(used) / static_cast<double>(pf.size()));
  for (size_t i = 0; i < kPrefetchSources; ++i) {
    if (src_pf[i] == 0) continue;
    double& prec = s.st.source_precision[i];
    double& scale = s.st.source_scale[i];
    ewma(prec, static_cast<double>(src_used[i]) / static_cast<double>(src_pf[i]));
    if (prec < cfg_.throttle_low)
      scale = std::max(cfg_.min_scale, scale / 2);
    else if (prec > cfg_.throttle_high)
      scale = std::min(1.0, scale * 2);
  }
  s.st.scale = *std::min_element(s.st.source_scale.begin(), s.st.source_scale.end());
}

PrefetchOutcomeStats Predictor::stats(const std::string& sb) const {
  auto it = sandboxes_.find(sb);
  return it == sandboxes_.end() ? PrefetchOutcomeStats{} : it->second.st;
}

double Predictor::scale(const std::string& sb) const { return stats(sb).scale; }

double Predictor::scale(const std::string& sb, PrefetchSource src) const {
  return stats(sb).source_scale[static_cast<size_t>(src)];
}

PredictorMemory Predictor::memory() const {
  PredictorMemory m;
  m.sandboxes = sandboxes_.size();
  m.hot_keys = hot_.size();
  for (auto& [id, s] : sandboxes_) m.stored_pages += s.history.size();
  for (auto& [k, h] : hot_)
    for (auto& [id, t] : h.members) m.stored_pages += t.size();
  return m;
}

void Predictor::forget(const std::string& sb) { sandboxes_.erase(sb); }

}  // namespace sg::memory
