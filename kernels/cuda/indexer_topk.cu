#include <algorithm>
#include <array>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/indexer_scores.cuh"
#include "kernels/cuda/indexer_select.cuh"
#include "kernels/cuda/indexer_topk.cuh"
#include "services/common/status_macros.h"

namespace nq::kernels::cuda {
namespace {

// Dynamic shared memory of the selection kernel: the survivors' sort buffer, then candidates.
// With its ~8.4 KiB of static shared memory it stays under sm_90's 227 KiB per block.
constexpr int kSelectDynamicSmemBytes = 200 * 1024;
// Score blocks resident per SM at 4 warps (T = 1, 64 heads): ~104 KiB of shared memory each.
constexpr int kScoreBlocksPerSm = 2;

using ScoresKernel = void (*)(IndexerTopKParams, int);

struct ScoresVariant {
  int k_steps;
  ScoresKernel kernel;
};

// dim <= 8 x k_steps; the first that fits is used (fewer k steps: fewer MMAs and registers).
constexpr std::array<ScoresVariant, 3> kScoresVariants = {{
    {4, IndexerScoresKernel<4>},
    {8, IndexerScoresKernel<8>},
    {16, IndexerScoresKernel<16>},
}};
static_assert(kScoresVariants.back().k_steps * 8 == kMaxIndexerDim);

absl::StatusOr<ScoresVariant> PickScoresVariant(int dim) {
  for (const ScoresVariant& v : kScoresVariants) {
    if (dim <= v.k_steps * 8) return v;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("IndexerTopK: head dim ", dim, " exceeds the ", kMaxIndexerDim,
                   " the CUDA scoring kernel holds in registers"));
}

// Scores then selects for one chunk of queries (q, weights, selected, start_pos, tokens already
// offset to it).
absl::Status LaunchChunk(const IndexerTopKParams& chunk, const ScoresVariant& scores,
                         int candidate_capacity, int select_smem, const LaunchContext& ctx) {
  const int queries_per_block = std::min(chunk.tokens, kScoreMaxRows / chunk.heads);
  const int groups = static_cast<int>(CeilDiv(chunk.tokens, queries_per_block));
  const int warps = static_cast<int>(CeilDiv(queries_per_block * chunk.heads, kScoreWarpRows));
  const std::int64_t tiles = CeilDiv(std::int64_t{chunk.start_pos} + chunk.tokens, kScoreTileKeys);
  // Enough key splits to fill the GPU; the groups of a decode chunk walk the same tiles at the
  // same time, so a key read by one group is an L2 hit for the others.
  const std::int64_t splits = std::clamp<std::int64_t>(
      CeilDiv(std::int64_t{kScoreBlocksPerSm} * ctx.num_sms, groups), 1, tiles);
  const dim3 score_grid(static_cast<unsigned>(splits), static_cast<unsigned>(groups));
  scores.kernel<<<score_grid, warps * kWarpSize, ScoreSmemBytes(scores.k_steps), ctx.stream>>>(
      chunk, queries_per_block);
  RETURN_IF_ERROR(CheckLaunch("IndexerScoresKernel"));
  IndexerSelectKernel<<<static_cast<unsigned>(chunk.tokens), kSelectThreads, select_smem,
                        ctx.stream>>>(chunk, candidate_capacity);
  return CheckLaunch("IndexerSelectKernel");
}

}  // namespace

absl::Status CheckIndexerShape(std::int64_t visible_keys, std::int64_t heads, std::int64_t dim,
                               std::int64_t top_k) {
  if (heads > kMaxIndexerHeads) {
    return absl::InvalidArgumentError(
        absl::StrCat("IndexerTopK: ", heads, " indexer heads; the CUDA scoring kernel holds at most ",
                     kMaxIndexerHeads, " (query, head) rows per block"));
  }
  if (dim > kMaxIndexerDim) {
    return absl::InvalidArgumentError(absl::StrCat("IndexerTopK: head dim ", dim, " exceeds the ",
                                                   kMaxIndexerDim,
                                                   " the CUDA scoring kernel holds in registers"));
  }
  if (std::min(top_k, visible_keys) > kMaxIndexerSurvivors) {
    return absl::InvalidArgumentError(absl::StrCat(
        "IndexerTopK: top_k ", top_k, " of ", visible_keys, " visible keys; the CUDA selection ",
        "sorts at most ", kMaxIndexerSurvivors, " selected keys per query"));
  }
  return absl::OkStatus();
}

absl::Status LaunchIndexerTopK(const IndexerTopKParams& p, const LaunchContext& ctx) {
  if (p.tokens < 0 || p.heads < 1 || p.dim < 1 || p.top_k < 1 || p.start_pos < 0 ||
      (p.tokens > 0 && p.score_rows < 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "IndexerTopK: unsupported size tokens=", p.tokens, " heads=", p.heads, " dim=", p.dim,
        " top_k=", p.top_k, " start_pos=", p.start_pos, " score_rows=", p.score_rows));
  }
  const std::int64_t visible_max = std::int64_t{p.start_pos} + p.tokens;
  RETURN_IF_ERROR(CheckIndexerShape(visible_max, p.heads, p.dim, p.top_k));
  if (p.tokens == 0) return absl::OkStatus();
  ASSIGN_OR_RETURN(const ScoresVariant scores, PickScoresVariant(p.dim));
  NQ_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(scores.kernel,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               ScoreSmemBytes(scores.k_steps)));
  // The sort buffer holds the survivors padded to a power of two; candidates get the rest.
  int survivors = 1;
  while (survivors < std::min<std::int64_t>(p.top_k, visible_max)) survivors *= 2;
  const int sort_bytes = survivors * static_cast<int>(sizeof(std::uint64_t));
  const int candidate_capacity =
      (kSelectDynamicSmemBytes - sort_bytes) / static_cast<int>(sizeof(std::uint64_t));
  NQ_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(IndexerSelectKernel,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               kSelectDynamicSmemBytes));
  for (int first = 0; first < p.tokens; first += p.score_rows) {
    IndexerTopKParams chunk = p;
    chunk.tokens = std::min(p.score_rows, p.tokens - first);
    chunk.start_pos = p.start_pos + first;
    chunk.q = p.q + std::int64_t{first} * p.heads * p.dim;
    chunk.weights = p.weights + std::int64_t{first} * p.heads;
    chunk.selected = p.selected + std::int64_t{first} * p.top_k;
    RETURN_IF_ERROR(
        LaunchChunk(chunk, scores, candidate_capacity, kSelectDynamicSmemBytes, ctx));
  }
  return absl::OkStatus();
}

}  // namespace nq::kernels::cuda
