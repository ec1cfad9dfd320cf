// Synthetic routing traces for tests, benchmarks and replay experiments: per layer, experts
// are popular by a Zipf law over a per-layer random ranking, and the ranking drifts (random
// swaps of neighbouring ranks) as the sequence goes on, like topic shifts in a conversation.
#pragma once

#include <cstdint>

#include "services/streamer/routing_trace.h"

namespace nq::streamer {

struct SyntheticTraceOptions {
  uint32_t num_layers = 4;
  uint32_t experts_per_layer = 64;
  uint32_t top_k = 8;
  uint64_t num_tokens = 1024;
  // P(rank r) proportional to (r + 1)^-zipf_exponent; 0 is a uniform router.
  double zipf_exponent = 1.0;
  // Every drift_interval tokens (0: never), drift_swaps random swaps of ranks r and r + d
  // with d uniform in [1, drift_distance].
  uint32_t drift_interval = 0;
  uint32_t drift_swaps = 0;
  uint32_t drift_distance = 8;
  // Routing weights: each token's top_k weights are uniform(0.5, 1.5), normalised, and
  // multiplied by weight_scale (DeepSeek-V3's routed_scaling_factor is 2.5).
  float weight_scale = 2.5f;
  uint64_t seed = 1;
};

// Layer ids are 0..num_layers-1; top_k is clamped to [1, experts_per_layer].
RoutingTrace MakeSyntheticTrace(const SyntheticTraceOptions& options);

}  // namespace nq::streamer
