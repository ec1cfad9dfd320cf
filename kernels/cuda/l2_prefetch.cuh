// Pulling the weights a decode GEMV reads first into L2 ahead of it (Backend::PrefetchMatMulWeights).
//
// Why: a decode step's attention ends in a chain of latency-bound kernels (the indexer's scores
// and one-block selection, MLA's absorb, split, merge and output: about 60 us a GLM-5 layer, a few
// MB read) and then o_proj, the layer's largest GEMV (201 MB at GLM-5's shapes), which streams at
// the bandwidth limit. HBM sits mostly idle during the chain; prefetching the start of each of
// o_proj's rows then lets every GEMV block begin on cached weights.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"

namespace nq::kernels::cuda {

struct L2PrefetchParams {
  const std::byte* base = nullptr;  // row 0 of the matrix
  std::int64_t rows = 0;
  std::int64_t row_bytes = 0;  // bytes of a row (the matrix is rows x row_bytes, contiguous)
  // The row's equal ranges a split-k GEMV streams at once (GemvSplits; 1 unsplit): each range's
  // first prefix_bytes are prefetched.
  int ranges = 1;
  std::int64_t prefix_bytes = 0;
  // The lines are marked evict-last (kept over lines read since, until read by the GEMV).
  bool evict_last = false;
};

// Stream-ordered, capturable, no allocation; asynchronous (the kernel issues bulk prefetches and
// ends; the lines arrive as the memory system serves them). Nothing for prefix_bytes < 16.
absl::Status LaunchL2Prefetch(const L2PrefetchParams& p, const LaunchContext& ctx);

}  // namespace nq::kernels::cuda
