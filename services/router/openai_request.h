// Parsing and validating OpenAI-compatible request bodies (/v1/completions,
// /v1/chat/completions) into the router's request form. Every rule broken is an
// INVALID_ARGUMENT naming the field, so the client gets a precise 400. OpenAI fields this
// server does not implement (response_format) are accepted only at their default value; any
// other value is refused by name, never silently ignored.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nq/v1/inference.pb.h"
#include "services/router/openai_logprobs.h"

namespace nq::router {

struct OpenAiRequest {
  bool chat = false;
  std::string model;
  // Completions: the prompt text, or token ids. Chat: the conversation.
  std::optional<std::string> prompt_text;
  std::vector<int32_t> prompt_ids;
  nq::v1::Chat chat_input;
  nq::v1::SamplingParams sampling;  // sampling.top_logprobs mirrors logprobs.top
  LogprobsRequest logprobs;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
};

// `body` is the raw request body. max_stop_strings bounds `stop`.
absl::StatusOr<OpenAiRequest> ParseCompletionRequest(const std::string& body);
absl::StatusOr<OpenAiRequest> ParseChatRequest(const std::string& body);

}  // namespace nq::router
