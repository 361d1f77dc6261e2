// Token usage from model API responses (issue 5: "token usage taken from
// the responses, including the final usage chunk of a stream"), for the
// OpenAI-compatible APIs (chat completions, completions, responses,
// embeddings) and Anthropic's messages API. Responses are upstream bytes:
// parsing never throws, bounds what it buffers, and a body it cannot read
// yields found = false rather than a guess.
//
// Where the numbers are:
//   OpenAI JSON: usage.{prompt_tokens, completion_tokens} (chat, completions,
//     embeddings) or usage.{input_tokens, output_tokens} (responses);
//     cached input in usage.{prompt,input}_tokens_details.cached_tokens.
//   OpenAI stream: the chunk whose "usage" is an object (chat with
//     stream_options.include_usage), or the response.completed event's
//     response.usage (responses).
//   Anthropic JSON: usage.{input_tokens, output_tokens,
//     cache_read_input_tokens, cache_creation_input_tokens}.
//   Anthropic stream: message_start's message.usage, then each
//     message_delta's usage (output_tokens is cumulative: the last wins).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace sg::llm {

enum class Provider { kOpenAI, kAnthropic };

struct TokenUsage {
  uint64_t input = 0, output = 0, cache_read = 0, cache_write = 0;
  bool found = false;
};

TokenUsage usage_from_json(Provider p, std::string_view body);

// Incremental server-sent-events scanner: feed the response bytes as they
// pass (in chunks of any size); usage() is what the stream reported so far.
// Lines longer than max_line are skipped (overflowed() says so) instead of
// buffered.
class SseUsageScanner {
 public:
  explicit SseUsageScanner(Provider p, size_t max_line = 1 << 20) : p_(p), max_line_(max_line) {}
  void feed(std::string_view bytes);
  // Ends a stream that did not finish with a blank line.
  void finish();
  const TokenUsage& usage() const { return usage_; }
  bool overflowed() const { return overflowed_; }
  uint64_t events() const { return events_; }

 private:
  void line(std::string_view l);
  void dispatch();

  Provider p_;
  size_t max_line_;
  std::string partial_;  // an incomplete line
  bool skipping_ = false;
  std::string data_;     // the current event's data lines
  TokenUsage usage_;
  bool overflowed_ = false;
  uint64_t events_ = 0;
};

}  // namespace sg::llm
