#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/indexer_topk.cuh"
#include "services/common/status_macros.h"

namespace nq::kernels::cuda {

absl::Status CheckIndexerKeys(std::int64_t visible_keys) {
  if (visible_keys <= kMaxIndexerKeys) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("IndexerTopK: ", visible_keys, " visible keys (start_pos + tokens); the CUDA ",
                   "top-k sorts at most ", kMaxIndexerKeys, " keys per query"));
}

absl::Status LaunchIndexerTopK(const IndexerTopKParams& p, const LaunchContext& ctx) {
  if (p.tokens < 0 || p.heads < 0 || p.dim < 0 || p.top_k < 1 || p.start_pos < 0 ||
      (p.tokens > 0 && p.score_rows < 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "IndexerTopK: unsupported size tokens=", p.tokens, " heads=", p.heads, " dim=", p.dim,
        " top_k=", p.top_k, " start_pos=", p.start_pos, " score_rows=", p.score_rows));
  }
  const std::int64_t visible_max = std::int64_t{p.start_pos} + p.tokens;
  RETURN_IF_ERROR(CheckIndexerKeys(visible_max));
  if (p.tokens == 0) return absl::OkStatus();
  int padded = 1;
  while (padded < visible_max) padded *= 2;
  const std::size_t sort_bytes =
      std::size_t{static_cast<unsigned>(padded)} * (sizeof(float) + sizeof(int));
  NQ_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(IndexerTopKKernel<kIndexerSortThreads>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(sort_bytes)));
  const unsigned key_blocks = static_cast<unsigned>(CeilDiv(visible_max, kIndexerKeysPerBlock));
  for (int first = 0; first < p.tokens; first += p.score_rows) {
    IndexerTopKParams chunk = p;
    chunk.tokens = std::min(p.score_rows, p.tokens - first);
    chunk.start_pos = p.start_pos + first;
    chunk.q = p.q + std::int64_t{first} * p.heads * p.dim;
    chunk.weights = p.weights + std::int64_t{first} * p.heads;
    chunk.selected = p.selected + std::int64_t{first} * p.top_k;
    const dim3 score_grid(static_cast<unsigned>(chunk.tokens), key_blocks);
    IndexerScoresKernel<kIndexerScoreThreads>
        <<<score_grid, kIndexerScoreThreads, 0, ctx.stream>>>(chunk);
    RETURN_IF_ERROR(CheckLaunch("IndexerScoresKernel"));
    const dim3 sort_grid(static_cast<unsigned>(chunk.tokens));
    IndexerTopKKernel<kIndexerSortThreads>
        <<<sort_grid, kIndexerSortThreads, sort_bytes, ctx.stream>>>(chunk);
    RETURN_IF_ERROR(CheckLaunch("IndexerTopKKernel"));
  }
  return absl::OkStatus();
}

}  // namespace nq::kernels::cuda
