// Next-token sampling in the leader worker: OpenAI's logit_bias and presence/frequency
// penalties on the raw logits, then greedy, temperature, top-k and top-p (nucleus), seeded so
// a request with a seed is reproducible, with log-probabilities for the API. One Sampler per
// sequence: it counts the tokens it has sampled, which the penalties read.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"

namespace nq::worker {

struct SamplingConfig {
  float temperature = 1.0f;  // 0: greedy
  float top_p = 1.0f;        // (0, 1]
  int top_k = 0;             // 0: off
  uint64_t seed = 0;
  int top_logprobs = 0;      // alternatives to report per token (0..20)
  float presence_penalty = 0;   // [-2, 2]
  float frequency_penalty = 0;  // [-2, 2]
  std::vector<std::pair<int32_t, float>> logit_bias;  // (token id, bias in [-100, 100])
};

// The log-probabilities a Sampler reports are those of the model's next-token distribution
// as the request adjusted it: log_softmax(logits + logit_bias - penalties) at temperature 1,
// over the whole vocabulary (before top-k / top-p). Temperature, top-k and top-p shape only
// how the token is drawn, so the reported values do not depend on them (greedy included), as
// OpenAI documents logprobs ("the log probability of this token") and vLLM reports them by
// default. A token with zero probability reports -infinity.
struct SampledToken {
  int32_t id = 0;
  float logprob = 0;
  // The top_logprobs most likely tokens with their log-probabilities, most likely first
  // (ties: lower id first).
  std::vector<std::pair<int32_t, float>> top;
};

class Sampler {
 public:
  // INVALID_ARGUMENT for a negative or non-finite temperature, top_p outside (0, 1], a
  // negative top_k, top_logprobs outside 0..20, a penalty outside [-2, 2], or a logit_bias
  // entry with a negative id or a bias outside [-100, 100].
  static absl::StatusOr<Sampler> Create(const SamplingConfig& config);

  // Picks the next token from one row of logits. Non-finite logits count as -inf; a row with
  // no finite logit, or a logit_bias id outside the row, is INVALID_ARGUMENT. The reported
  // log-probabilities are those of SampledToken's contract.
  absl::StatusOr<SampledToken> Sample(std::span<const float> logits);

 private:
  explicit Sampler(const SamplingConfig& config) : config_(config), rng_(config.seed) {}
  // The logits with logit_bias and the penalties applied (`logits` itself when none apply).
  std::span<const float> Adjust(std::span<const float> logits);
  void Count(int32_t id);

  SamplingConfig config_;
  std::mt19937_64 rng_;
  std::vector<int32_t> order_;  // scratch
  std::vector<double> probs_;   // scratch
  std::vector<float> adjusted_;  // scratch: the logits after bias and penalties
  std::unordered_map<int32_t, int> counts_;  // token id -> times sampled in this sequence
};

}  // namespace nq::worker
