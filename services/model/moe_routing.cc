#include "services/model/moe_routing.h"

#include "absl/strings/str_cat.h"

namespace nq::model {

absl::StatusOr<MoeRouting> RouteTokens(std::span<const float> logits, std::span<const float> bias,
                                       const MoeRoutingParams& p) {
  if (absl::Status s = kernels::CheckMoeRouteParams(p); !s.ok()) return s;
  if (logits.size() % static_cast<size_t>(p.num_experts) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("MoE routing: ", logits.size(), " logits is not a multiple of ", p.num_experts));
  }
  if (!bias.empty() && bias.size() != static_cast<size_t>(p.num_experts)) {
    return absl::InvalidArgumentError(absl::StrCat("MoE routing: bias of ", bias.size(), " for ", p.num_experts, " experts"));
  }
  MoeRouting routing;
  routing.num_tokens = static_cast<int>(logits.size() / p.num_experts);
  routing.top_k = p.top_k;
  routing.experts.resize(static_cast<size_t>(routing.num_tokens) * p.top_k);
  routing.weights.resize(routing.experts.size());
  kernels::RouteTokensHost(logits, bias, p, routing.experts, routing.weights);
  return routing;
}

}  // namespace nq::model
