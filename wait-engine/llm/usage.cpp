// Token usage extraction from JSON bodies and SSE streams.
#include "wait-engine/llm/usage.h"

#include <nlohmann/json.hpp>

namespace sg::llm {

namespace {

// The "type" of a JSON object, or "" if it has none or it is not a string
// (json::value would throw on a non-string: the bytes are untrusted).
std::string type_of(const nlohmann::json& j) {
  auto it = j.find("type");
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
}

using json = nlohmann::json;

uint64_t num(const json& o, const char* k) {
  auto it = o.find(k);
  if (it == o.end() || !it->is_number_unsigned()) return 0;
  return it->get<uint64_t>();
}

bool has_num(const json& o, const char* k) {
  auto it = o.find(k);
  return it != o.end() && it->is_number_unsigned();
}

// Fills u from one "usage" object; true if it held token counts.
bool from_usage(Provider p, const json& usage, TokenUsage* u, bool cumulative_output_only) {
  if (!usage.is_object()) return false;
  if (p == Provider::kOpenAI) {
    if (has_num(usage, "prompt_tokens") || has_num(usage, "completion_tokens")) {
      u->input = num(usage, "prompt_tokens");
      u->output = num(usage, "completion_tokens");
      if (auto d = usage.find("prompt_tokens_details"); d != usage.end() && d->is_object()) u->cache_read = num(*d, "cached_tokens");
      u->found = true;
      return true;
    }
    if (has_num(usage, "input_tokens") || has_num(usage, "output_tokens")) {
      u->input = num(usage, "input_tokens");
      u->output = num(usage, "output_tokens");
      if (auto d = usage.find("input_tokens_details"); d != usage.end() && d->is_object()) u->cache_read = num(*d, "cached_tokens");
      u->found = true;
      return true;
    }
    return false;
  }
  // Anthropic.
  if (!has_num(usage, "input_tokens") && !has_num(usage, "output_tokens")) return false;
  if (!cumulative_output_only || has_num(usage, "input_tokens")) {
    if (has_num(usage, "input_tokens")) u->input = num(usage, "input_tokens");
    if (has_num(usage, "cache_read_input_tokens")) u->cache_read = num(usage, "cache_read_input_tokens");
    if (has_num(usage, "cache_creation_input_tokens")) u->cache_write = num(usage, "cache_creation_input_tokens");
  }
  if (has_num(usage, "output_tokens")) u->output = num(usage, "output_tokens");
  u->found = true;
  return true;
}

}  // namespace

TokenUsage usage_from_json(Provider p, std::string_view body) {
  TokenUsage u;
  // Keep only the top-level "usage" member: a response body can be many
  // megabytes (embeddings, long outputs) and is read on an io thread, so
  // nothing else is built into a document.
  json::parser_callback_t keep_usage = [](int depth, json::parse_event_t event, json& parsed) {
    return !(depth == 1 && event == json::parse_event_t::key && parsed != "usage");
  };
  json j = json::parse(body.begin(), body.end(), keep_usage, /*allow_exceptions=*/false);
  if (!j.is_object()) return u;
  if (auto it = j.find("usage"); it != j.end()) from_usage(p, *it, &u, false);
  return u;
}

void SseUsageScanner::dispatch() {
  if (data_.empty()) return;
  ++events_;
  json j = json::parse(data_, nullptr, /*allow_exceptions=*/false);
  data_.clear();
  if (!j.is_object()) return;  // "[DONE]" and anything else that is not an object
  if (p_ == Provider::kOpenAI) {
    if (auto it = j.find("usage"); it != j.end() && it->is_object()) from_usage(p_, *it, &usage_, false);
    if (auto r = j.find("response"); r != j.end() && r->is_object())
      if (auto it = r->find("usage"); it != r->end() && it->is_object()) from_usage(p_, *it, &usage_, false);
    return;
  }
  std::string type = type_of(j);
  if (type == "message_start") {
    if (auto m = j.find("message"); m != j.end() && m->is_object())
      if (auto it = m->find("usage"); it != m->end()) from_usage(p_, *it, &usage_, false);
  } else if (type == "message_delta") {
    if (auto it = j.find("usage"); it != j.end()) from_usage(p_, *it, &usage_, true);
  }
}

void SseUsageScanner::line(std::string_view l) {
  if (!l.empty() && l.back() == '\r') l.remove_suffix(1);
  if (l.empty()) {
    dispatch();
    return;
  }
  if (l.substr(0, 5) == "data:") {
    std::string_view v = l.substr(5);
    if (!v.empty() && v.front() == ' ') v.remove_prefix(1);
    if (data_.size() + v.size() + 1 > max_line_) {
      overflowed_ = true;
      data_.clear();
      return;
    }
    if (!data_.empty()) data_.push_back('\n');
    data_.append(v);
  }
  // event:, id:, retry: and comments carry no usage.
}

void SseUsageScanner::feed(std::string_view bytes) {
  while (!bytes.empty()) {
    size_t nl = bytes.find('\n');
    std::string_view piece = nl == std::string_view::npos ? bytes : bytes.substr(0, nl);
    if (skipping_) {
      if (nl != std::string_view::npos) skipping_ = false;
    } else if (partial_.size() + piece.size() > max_line_) {
      overflowed_ = true;
      partial_.clear();
      data_.clear();
      skipping_ = nl == std::string_view::npos;
    } else if (nl == std::string_view::npos) {
      partial_.append(piece);
    } else if (partial_.empty()) {
      line(piece);
    } else {
      partial_.append(piece);
      std::string whole = std::move(partial_);
      partial_.clear();
      line(whole);
    }
    if (nl == std::string_view::npos) break;
    bytes.remove_prefix(nl + 1);
  }
}

void SseUsageScanner::finish() {
  if (!partial_.empty() && !skipping_) {
    std::string whole = std::move(partial_);
    partial_.clear();
    line(whole);
  }
  dispatch();
}

}  // namespace sg::llm
