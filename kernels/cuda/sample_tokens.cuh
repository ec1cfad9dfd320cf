// Backend::SampleTokens on the GPU (the math and its host reference: kernels/sample_tokens.h):
// a cluster of 8 blocks per row, each over its own chunk, combining through distributed shared
// memory; each id's weight is computed once into shared memory. Greedy is one argmax pass. A draw finds its id without sorting: top-k, the
// top-p cut and the draw itself are each "the first id, in descending-logit order, whose running
// weight exceeds a point", found by a radix descent over the 32-bit logit key (11 + 11 + 10
// bits: per pass, a histogram of weight per digit over the ids still in play, and the digit
// the point falls in), then the id among equal logits by a scan in id order. Weights are
// integers, so every sum is exact and the id equals SampleRowHost's whatever order the
// atomics add in.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/sample_tokens.h"

namespace nq::kernels::cuda {

struct SampleTokensLaunch {
  const float* logits = nullptr;        // [rows, vocab]
  const SampleParams* params = nullptr;  // [rows]
  std::int32_t* ids = nullptr;           // [rows]
  std::int64_t rows = 0;
  std::int64_t vocab = 0;                // < 2^24
};

// Contract: arguments validated by Backend::SampleTokens.
absl::Status LaunchSampleTokens(const SampleTokensLaunch& launch, const LaunchContext& ctx);

}  // namespace nq::kernels::cuda
