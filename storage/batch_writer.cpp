// BatchWriter implementation.
#include "storage/batch_writer.h"

#include <chrono>

#include "base/log.h"

namespace sg::storage {

namespace {
constexpr size_t kMaxQueued = 100000;
constexpr size_t kBatch = 512;
}  // namespace

BatchWriter::BatchWriter(Store& store) : store_(store), thread_([this] { loop(); }) {}

BatchWriter::~BatchWriter() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

bool BatchWriter::wake_now() const {
  size_t n = usage_.size() + events_.size();
  return n == 1 || n >= kBatch;
}

void BatchWriter::add_usage(LlmUsageRow row) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (usage_.size() >= kMaxQueued) {
      LOG_WARN("model usage queue full: a row is dropped");
      return;
    }
    usage_.push_back(std::move(row));
    if (!wake_now()) return;
  }
  cv_.notify_one();
}

void BatchWriter::add_event(EventRow row) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (events_.size() >= kMaxQueued) return;
    events_.push_back(std::move(row));
    if (!wake_now()) return;
  }
  cv_.notify_one();
}

void BatchWriter::loop() {
  for (;;) {
    std::vector<LlmUsageRow> u;
    std::vector<EventRow> e;
    {
      std::unique_lock<std::mutex> l(mu_);
      cv_.wait(l, [&] { return stop_ || !usage_.empty() || !events_.empty(); });
      // Gather a batch (one SQLite transaction for many rows), at most 20 ms.
      cv_.wait_for(l, std::chrono::milliseconds(20), [&] { return stop_ || usage_.size() + events_.size() >= kBatch; });
      u.swap(usage_);
      e.swap(events_);
      if (u.empty() && e.empty() && stop_) return;
    }
    if (!u.empty())
      if (Status s = store_.insert_llm_usage(u); !s) LOG_ERROR("model usage: " << s.error().message());
    if (!e.empty())
      if (Status s = store_.add_events(e); !s) LOG_ERROR("wait events: " << s.error().message());
  }
}

}  // namespace sg::storage
