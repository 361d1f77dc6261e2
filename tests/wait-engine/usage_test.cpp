// Token usage from OpenAI and Anthropic responses, JSON and SSE.
#include <doctest/doctest.h>

#include <string>

#include "wait-engine/llm/usage.h"

using namespace sg::llm;

TEST_CASE("OpenAI JSON bodies: chat, responses, embeddings; garbage finds nothing") {
  auto u = usage_from_json(Provider::kOpenAI,
                           R"({"id":"c","usage":{"prompt_tokens":12,"completion_tokens":5,"total_tokens":17,"prompt_tokens_details":{"cached_tokens":4}}})");
  CHECK(u.found);
  CHECK(u.input == 12);
  CHECK(u.output == 5);
  CHECK(u.cache_read == 4);
  u = usage_from_json(Provider::kOpenAI, R"({"object":"response","usage":{"input_tokens":9,"output_tokens":3}})");
  CHECK((u.found && u.input == 9 && u.output == 3));
  u = usage_from_json(Provider::kOpenAI, R"({"data":[],"usage":{"prompt_tokens":7,"total_tokens":7}})");
  CHECK((u.found && u.input == 7 && u.output == 0));
  for (const char* bad : {"", "{", "[]", R"({"usage":null})", R"({"usage":{"prompt_tokens":-1}})", R"({"usage":{"prompt_tokens":"12"}})"})
    CHECK_FALSE(usage_from_json(Provider::kOpenAI, bad).found);
}

TEST_CASE("Anthropic JSON body with cache counts") {
  auto u = usage_from_json(Provider::kAnthropic,
                           R"({"type":"message","usage":{"input_tokens":20,"output_tokens":8,"cache_read_input_tokens":10,"cache_creation_input_tokens":2}})");
  CHECK(u.found);
  CHECK(u.input == 20);
  CHECK(u.output == 8);
  CHECK(u.cache_read == 10);
  CHECK(u.cache_write == 2);
}

TEST_CASE("OpenAI chat stream: the final usage chunk, fed one byte at a time and in one piece") {
  std::string s =
      "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n"
      "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":11,\"completion_tokens\":2}}\r\n\r\n"
      "data: [DONE]\n\n";
  SseUsageScanner a(Provider::kOpenAI);
  for (char c : s) a.feed(std::string_view(&c, 1));
  CHECK(a.usage().found);
  CHECK(a.usage().input == 11);
  CHECK(a.usage().output == 2);
  CHECK(a.events() == 3);
  SseUsageScanner b(Provider::kOpenAI);
  b.feed(s);
  CHECK(b.usage().input == 11);
}

TEST_CASE("OpenAI responses stream: response.completed carries the usage") {
  SseUsageScanner sc(Provider::kOpenAI);
  sc.feed("event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"x\"}\n\n");
  CHECK_FALSE(sc.usage().found);
  sc.feed("event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":4,\"output_tokens\":6}}}\n");
  sc.finish();  // no trailing blank line
  CHECK(sc.usage().found);
  CHECK(sc.usage().output == 6);
}

TEST_CASE("Anthropic stream: input from message_start, cumulative output from the last message_delta") {
  SseUsageScanner sc(Provider::kAnthropic);
  sc.feed("event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1,\"cache_read_input_tokens\":5}}}\n\n");
  sc.feed("event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"a\"}}\n\n");
  sc.feed("event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":7}}\n\n");
  sc.feed("event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":15}}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n");
  CHECK(sc.usage().input == 25);
  CHECK(sc.usage().cache_read == 5);
  CHECK(sc.usage().output == 15);
}

TEST_CASE("an oversized line is skipped, not buffered, and the stream goes on") {
  SseUsageScanner sc(Provider::kOpenAI, 64);
  sc.feed("data: " + std::string(200, 'x'));
  sc.feed(std::string(200, 'y') + "\n\n");
  CHECK(sc.overflowed());
  sc.feed("data: {\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1}}\n\n");
  CHECK(sc.usage().found);
}
