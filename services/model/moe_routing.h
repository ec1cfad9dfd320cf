// The MoE router on the host (the math: kernels/moe_route.h). The model routes on its backend
// (Backend::MoeRoute) when nothing on the host needs the routing within the forward; this is
// the host form for the paths that do (layer-major prefill, calibration, per-expert slot sources).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/moe_route.h"

namespace nq::model {

using MoeRoutingParams = kernels::MoeRouteParams;

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
