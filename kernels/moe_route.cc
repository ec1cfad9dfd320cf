#include "kernels/moe_route.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"

namespace nq::kernels {
namespace {

// Indices of the k largest values, descending, ties broken by lower index (as torch.topk
// does on CPU for distinct values; exact ties are measure-zero with float scores).
void TopK(std::span<const float> values, int k, std::vector<int>& out) {
  out.resize(values.size());
  std::iota(out.begin(), out.end(), 0);
  std::partial_sort(out.begin(), out.begin() + k, out.end(), [&](int a, int b) {
    return values[a] > values[b] || (values[a] == values[b] && a < b);
  });
  out.resize(k);
}

}  // namespace

absl::Status CheckMoeRouteParams(const MoeRouteParams& p) {
  if (p.num_experts <= 0 || p.top_k <= 0 || p.top_k > p.num_experts) {
    return absl::InvalidArgumentError(absl::StrCat("MoE routing: top_k ", p.top_k, " of ", p.num_experts, " experts"));
  }
  if (p.n_group <= 0 || p.num_experts % p.n_group != 0 || p.topk_group <= 0 || p.topk_group > p.n_group) {
    return absl::InvalidArgumentError(absl::StrCat("MoE routing: ", p.num_experts, " experts in ", p.n_group,
                                                   " groups, topk_group ", p.topk_group));
  }
  if (p.top_k > p.topk_group * (p.num_experts / p.n_group)) {
    return absl::InvalidArgumentError("MoE routing: top_k exceeds the experts of the kept groups");
  }
  return absl::OkStatus();
}

void RouteTokensHost(std::span<const float> logits, std::span<const float> bias, const MoeRouteParams& p,
                     std::span<std::int32_t> experts, std::span<float> weights) {
  const int E = p.num_experts;
  const size_t T = logits.size() / static_cast<size_t>(E);
  const int group_size = E / p.n_group;
  std::vector<float> scores(E), choice(E), group_scores(p.n_group);
  std::vector<int> order;
  std::vector<bool> keep(p.n_group);
  for (size_t t = 0; t < T; ++t) {
    for (int e = 0; e < E; ++e) {
      const float logit = logits[t * E + e];
      scores[e] = 1.0f / (1.0f + std::exp(-logit));
      choice[e] = scores[e] + (bias.empty() ? 0.0f : bias[e]);
    }
    if (p.n_group > 1) {
      for (int g = 0; g < p.n_group; ++g) {
        std::span<const float> members(choice.data() + g * group_size, group_size);
        TopK(members, std::min(2, group_size), order);
        group_scores[g] = 0;
        for (int i : order) group_scores[g] += members[i];
      }
      TopK(group_scores, p.topk_group, order);
      std::fill(keep.begin(), keep.end(), false);
      for (int g : order) keep[g] = true;
      for (int e = 0; e < E; ++e) {
        // Masked experts can never be chosen (HF fills them with 0 after sigmoid scores >= 0
        // plus bias; -inf keeps that true even with a negative bias).
        if (!keep[e / group_size]) choice[e] = -std::numeric_limits<float>::infinity();
      }
    }
    TopK(choice, p.top_k, order);
    float sum = 0;
    for (int j = 0; j < p.top_k; ++j) sum += scores[order[j]];
    for (int j = 0; j < p.top_k; ++j) {
      float w = scores[order[j]];
      if (p.norm_topk_prob) w /= (sum + 1e-20f);
      experts[t * p.top_k + j] = order[j];
      weights[t * p.top_k + j] = w * p.routed_scaling_factor;
    }
  }
}

}  // namespace nq::kernels
