// Backend::MoeRoute on the GPU (the math and its reference: kernels/moe_route.h): one block per
// token, a thread per expert. Ranks replace sorting: an expert's (or a group's) place in the
// descending order is the count of entries that beat it (greater, or equal with a lower index),
// which gives exactly the host's partial_sort order, ties included. The token's weights are
// summed in the order of its experts by one thread, as the host sums them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/moe_route.h"

namespace nq::kernels::cuda {

struct MoeRouteLaunch {
  const float* logits = nullptr;  // [tokens, E]
  const float* bias = nullptr;    // [E] or null
  std::int32_t* ids = nullptr;    // [tokens, top_k]
  float* weights = nullptr;       // [tokens, top_k]
  std::int64_t tokens = 0;
  MoeRouteParams params;
};

// Contract: arguments validated by Backend::MoeRoute (E <= kMaxRoutedExperts, tokens < 2^31).
absl::Status LaunchMoeRoute(const MoeRouteLaunch& launch, const LaunchContext& ctx);

}  // namespace nq::kernels::cuda
