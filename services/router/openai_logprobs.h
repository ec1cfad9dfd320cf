// OpenAI's `logprobs` response objects, built from the worker's TokenLogprob messages.
//
// Chat (/v1/chat/completions, `logprobs: true`, `top_logprobs: 0..20`): a choice's `logprobs`
// is {"content": [entry...], "refusal": null}, one entry per generated token:
//   {"token": text, "logprob": float, "bytes": [uint8...], "top_logprobs": [{token, logprob, bytes}...]}
// In a stream every chunk carries the entries of the tokens whose text it brings.
//
// Completions (/v1/completions, `logprobs: n` with n in 0..20): a choice's `logprobs` is
//   {"tokens": [text...], "token_logprobs": [float...], "top_logprobs": [{text: logprob}...],
//    "text_offset": [int...]}
// where each top_logprobs object holds the n most likely tokens and always the sampled one (so
// up to n + 1 keys, as OpenAI documents), and text_offset[i] is where token i's text starts in
// the choice's text, counted in Unicode code points from the start of the generated text (the
// prompt is not echoed). A stream's chunks continue the offsets of the earlier chunks.
//
// What the numbers mean is the worker's contract (services/worker/sampler.h): natural-log
// probabilities of the model's distribution at temperature 1 after logit_bias and penalties.
// JSON has no -infinity, so a zero-probability token reports kMinLogprob, as OpenAI does.
//
// Token text: the token's bytes as the tokenizer decodes them, special tokens included (so an
// end-of-sequence token shows as its own string); a token that ends inside a UTF-8 character
// has invalid text (dumped as U+FFFD) and its exact bytes in `bytes`.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>

#include <nlohmann/json.hpp>

#include "nq/v1/sampling.pb.h"

namespace nq::router {

// What a request asked for. `enabled` without alternatives still reports each sampled token.
struct LogprobsRequest {
  bool enabled = false;
  int top = 0;  // alternatives per token, 0..20
};

// OpenAI's stand-in for the logprob of a token that cannot be sampled.
inline constexpr float kMinLogprob = -9999.0f;

// The bytes one token id contributes to a decoding (special tokens included); empty for an id
// the tokenizer does not know. `text_bytes` is what it contributes to the returned text
// (empty for skipped special tokens), for the completions text offsets.
struct TokenText {
  std::function<std::string(int32_t)> bytes;
  std::function<std::string(int32_t)> text_bytes;
};

// Chat: the entries of `tokens`, an array to put under {"content": ...}.
nlohmann::json ChatLogprobContent(std::span<const nq::v1::TokenLogprob> tokens, const TokenText& text);

// Completions: one logprobs object per response (non-streamed) or per chunk (streamed), the
// text offsets continuing across calls.
class CompletionLogprobs {
 public:
  CompletionLogprobs(TokenText text, int top) : text_(std::move(text)), top_(top) {}
  nlohmann::json Next(std::span<const nq::v1::TokenLogprob> tokens);

 private:
  TokenText text_;
  int top_;
  int64_t offset_ = 0;  // code points of generated text before the next token
};

}  // namespace nq::router
