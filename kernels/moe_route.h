// The DeepSeek-V3 / GLM-5 MoE router ("noaux_tc"), as HF transformers computes it:
//
//   scores  = sigmoid(logits)                                   [T, E]
//   choice  = scores + e_score_correction_bias                  (selection only)
//   groups  : E experts in n_group groups; a group's score is the sum of its top-2 choice
//             scores; keep the best topk_group groups, mask the rest
//   experts = top-k of the masked choice scores, descending (ties: lower expert id first)
//   weights = scores[experts] (/ their sum when norm_topk_prob) * routed_scaling_factor
//
// Backend::MoeRoute runs it where the logits are (on the GPU no routing crosses to the host
// within a step); RouteTokensHost is the reference both backends follow, summing a token's
// weights in the order of its experts so the CPU result is reproduced bit for bit.
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/status.h"

namespace nq::kernels {

struct MoeRouteParams {
  int num_experts = 0;
  int top_k = 0;
  int n_group = 1;
  int topk_group = 1;
  bool norm_topk_prob = true;
  float routed_scaling_factor = 1.0f;
};

// The largest expert count one GPU routing block handles (a thread per expert).
inline constexpr int kMaxRoutedExperts = 1024;

// InvalidArgumentError naming what is wrong with `p` (counts, groups, top_k beyond the experts
// the kept groups hold).
absl::Status CheckMoeRouteParams(const MoeRouteParams& p);

// logits: [tokens, num_experts]; bias: [num_experts] or empty; experts, weights: [tokens, top_k].
// `p` must pass CheckMoeRouteParams.
void RouteTokensHost(std::span<const float> logits, std::span<const float> bias, const MoeRouteParams& p,
                     std::span<std::int32_t> experts, std::span<float> weights);

}  // namespace nq::kernels
