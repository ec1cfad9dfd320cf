// The DeepSeek-V3 / GLM-5 MoE router ("noaux_tc"), on the host: router logits are a few
// hundred floats per token, and the selected experts decide which weights run next.
//
//   scores  = sigmoid(logits)                                   [T, E]
//   choice  = scores + e_score_correction_bias                  (selection only)
//   groups  : E experts in n_group groups; a group's score is the sum of its top-2 choice
//             scores; keep the best topk_group groups, mask the rest
//   experts = top-k of the masked choice scores
//   weights = scores[experts] (/ their sum when norm_topk_prob) * routed_scaling_factor
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"

namespace nq::model {

struct MoeRoutingParams {
  int num_experts = 0;
  int top_k = 0;
  int n_group = 1;
  int topk_group = 1;
  bool norm_topk_prob = true;
  float routed_scaling_factor = 1.0f;
};

// Routing of T tokens: experts[t * top_k + j] with weights[t * top_k + j], experts of a token
// ordered by descending choice score (ties: lower expert id first).
struct MoeRouting {
  int num_tokens = 0;
  int top_k = 0;
  std::vector<int32_t> experts;
  std::vector<float> weights;
  // Per token, the squared L2 norm of the router's input (the normed hidden state the experts
  // read): the predictor's salience signal. Filled by Model::Route; empty from RouteTokens.
  std::vector<float> input_sq_norms;
};

// logits: [T, num_experts] row-major; bias: [num_experts] (empty: no correction bias).
absl::StatusOr<MoeRouting> RouteTokens(std::span<const float> logits, std::span<const float> bias,
                                       const MoeRoutingParams& params);

}  // namespace nq::model
