// Next-token sampling in the leader worker: greedy, temperature, top-k and top-p (nucleus),
// seeded so a request with a seed is reproducible, with log-probabilities for the API.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "absl/status/statusor.h"

namespace nq::worker {

struct SamplingConfig {
  float temperature = 1.0f;  // 0: greedy
  float top_p = 1.0f;        // (0, 1]
  int top_k = 0;             // 0: off
  uint64_t seed = 0;
  int top_logprobs = 0;      // alternatives to report per token (0..20)
};

struct SampledToken {
  int32_t id = 0;
  // log p(id) under the temperature-scaled full distribution (greedy: temperature 1), before
  // top-k / top-p truncation, as OpenAI-compatible servers report it.
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;  // most likely first
};

class Sampler {
 public:
  // INVALID_ARGUMENT for a negative or non-finite temperature, top_p outside (0, 1], a
  // negative top_k, or top_logprobs outside 0..20.
  static absl::StatusOr<Sampler> Create(const SamplingConfig& config);

  // Picks the next token from one row of logits. Non-finite logits count as -inf; a row with
  // no finite logit is INVALID_ARGUMENT.
  absl::StatusOr<SampledToken> Sample(std::span<const float> logits);

 private:
  explicit Sampler(const SamplingConfig& config) : config_(config), rng_(config.seed) {}

  SamplingConfig config_;
  std::mt19937_64 rng_;
  std::vector<int32_t> order_;  // scratch
  std::vector<double> probs_;   // scratch
};

}  // namespace nq::worker
