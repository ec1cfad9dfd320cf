#include "services/streamer/routing_trace_synthetic.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

namespace nq::streamer {

RoutingTrace MakeSyntheticTrace(const SyntheticTraceOptions& options) {
  const uint32_t layers = options.num_layers;
  const uint32_t experts = std::max(1u, options.experts_per_layer);
  const uint32_t k = std::clamp(options.top_k, 1u, experts);
  std::mt19937_64 rng(options.seed);
  RoutingTrace trace;
  trace.layer_ids.resize(layers);
  std::iota(trace.layer_ids.begin(), trace.layer_ids.end(), 0u);
  trace.experts_per_layer = experts;
  trace.top_k = k;
  trace.experts.reserve(options.num_tokens * layers * k);
  trace.weights.reserve(options.num_tokens * layers * k);

  std::vector<double> rank_weight(experts);
  for (uint32_t r = 0; r < experts; ++r) {
    rank_weight[r] = std::pow(static_cast<double>(r + 1), -options.zipf_exponent);
  }
  std::discrete_distribution<uint32_t> pick_rank(rank_weight.begin(), rank_weight.end());
  // ranking[l][r]: the expert at popularity rank r of layer l.
  std::vector<std::vector<uint32_t>> ranking(layers, std::vector<uint32_t>(experts));
  for (auto& order : ranking) {
    std::iota(order.begin(), order.end(), 0u);
    std::shuffle(order.begin(), order.end(), rng);
  }
  std::uniform_real_distribution<float> raw_weight(0.5f, 1.5f);
  std::uniform_int_distribution<uint32_t> pick_any(0, experts - 1);
  std::uniform_int_distribution<uint32_t> pick_distance(1, std::max(1u, options.drift_distance));
  std::vector<uint32_t> chosen(k);
  std::vector<float> w(k);
  for (uint64_t t = 0; t < options.num_tokens; ++t) {
    if (options.drift_interval != 0 && t != 0 && t % options.drift_interval == 0) {
      for (auto& order : ranking) {
        for (uint32_t s = 0; s < options.drift_swaps; ++s) {
          const uint32_t a = pick_any(rng);
          const uint32_t b = std::min(experts - 1, a + pick_distance(rng));
          std::swap(order[a], order[b]);
        }
      }
    }
    for (uint32_t l = 0; l < layers; ++l) {
      // k distinct ranks by rejection (k is small against experts).
      for (uint32_t j = 0; j < k; ++j) {
        uint32_t r;
        do {
          r = pick_rank(rng);
        } while (std::find(chosen.begin(), chosen.begin() + j, ranking[l][r]) !=
                 chosen.begin() + j);
        chosen[j] = ranking[l][r];
      }
      float sum = 0;
      for (uint32_t j = 0; j < k; ++j) sum += (w[j] = raw_weight(rng));
      for (uint32_t j = 0; j < k; ++j) {
        trace.experts.push_back(chosen[j]);
        trace.weights.push_back(w[j] / sum * options.weight_scale);
      }
    }
  }
  return trace;
}

}  // namespace nq::streamer
