#include <algorithm>
#include <array>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/indexer_decode_select.cuh"
#include "kernels/cuda/indexer_one_block_select.cuh"
#include "kernels/cuda/indexer_scores.cuh"
#include "kernels/cuda/indexer_select.cuh"
#include "kernels/cuda/indexer_topk.cuh"
#include "services/common/status_macros.h"

namespace nq::kernels::cuda {
namespace {

// Dynamic shared memory of the selection kernels: the survivors' buffer, then candidates (then
// the key bitmap of WriteKeysAscending).
// With its ~8.4 KiB of static shared memory it stays under sm_90's 227 KiB per block.
constexpr int kSelectDynamicSmemBytes = 200 * 1024;

using ScoresKernel = void (*)(IndexerTopKParams, int, unsigned*);

// The scoring kernels of one k-step count: [key groups 1, 2, 4][scores only (chunked path),
// scores and the top-digit histograms (decode path)].
inline constexpr int kKeyGroupOptions[] = {1, 2, 4};
struct ScoresVariant {
  int k_steps;
  ScoresKernel kernels[3][2];
};

template <int kKSteps>
constexpr ScoresVariant MakeScoresVariant() {
  return {kKSteps,
          {{IndexerScoresKernel<kKSteps, 1, false>, IndexerScoresKernel<kKSteps, 1, true>},
           {IndexerScoresKernel<kKSteps, 2, false>, IndexerScoresKernel<kKSteps, 2, true>},
           {IndexerScoresKernel<kKSteps, 4, false>, IndexerScoresKernel<kKSteps, 4, true>}}};
}

// dim <= 8 x k_steps; the first that fits is used (fewer k steps: fewer MMAs and registers).
constexpr std::array<ScoresVariant, 3> kScoresVariants = {
    MakeScoresVariant<4>(), MakeScoresVariant<8>(), MakeScoresVariant<16>()};
static_assert(kScoresVariants.back().k_steps * 8 == kMaxIndexerDim);

absl::StatusOr<ScoresVariant> PickScoresVariant(int dim) {
  for (const ScoresVariant& v : kScoresVariants) {
    if (dim <= v.k_steps * 8) return v;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("IndexerTopK: head dim ", dim, " exceeds the ", kMaxIndexerDim,
                   " the CUDA scoring kernel holds in registers"));
}

// The select scratch of the decode path (IndexerSelectScratchBytes): the zeroed histograms and
// counts first, then the sure and candidate entry lists.
struct SelectScratchLayout {
  std::int64_t second_hist, counts, zeroed_bytes, sure, cand, total;
};

SelectScratchLayout MakeSelectScratchLayout(std::int64_t tokens, std::int64_t visible_max,
                                            std::int64_t top_k) {
  const auto align = [](std::int64_t bytes) { return (bytes + 15) / 16 * 16; };
  SelectScratchLayout l;
  const std::int64_t hist_bytes = tokens * kRadixBins * std::int64_t{sizeof(unsigned)};
  l.second_hist = hist_bytes;
  l.counts = 2 * hist_bytes;
  l.zeroed_bytes = l.counts + tokens * std::int64_t{sizeof(DecodeSelectCounts)};
  l.sure = align(l.zeroed_bytes);
  l.cand = align(l.sure + tokens * top_k * std::int64_t{sizeof(std::uint64_t)});
  l.total = l.cand + tokens * visible_max * std::int64_t{sizeof(std::uint64_t)};
  return l;
}

// The scoring launch of a chunk: its row warps each split into as many key groups as the block's
// warp limit allows (more warps per SM: the A fragments' registers cap how many fit), and
// enough key splits to fill the GPU at the kernel's occupancy; the groups of a decode chunk walk
// the same tiles at the same time, so a key read by one group is an L2 hit for the others.
struct ScoreLaunch {
  int queries_per_block;
  dim3 grid;
  int threads;
  int smem;
  ScoresKernel kernel;
};
absl::StatusOr<ScoreLaunch> MakeScoreLaunch(const IndexerTopKParams& chunk, const ScoresVariant& variant,
                                            bool histogram, const LaunchContext& ctx) {
  const int queries_per_block = std::min(chunk.tokens, kScoreMaxRows / chunk.heads);
  const int groups = static_cast<int>(CeilDiv(chunk.tokens, queries_per_block));
  const int row_warps = static_cast<int>(CeilDiv(queries_per_block * chunk.heads, kScoreWarpRows));
  int option = 0;
  while (option + 1 < static_cast<int>(std::size(kKeyGroupOptions)) &&
         row_warps * kKeyGroupOptions[option + 1] <= kScoreMaxWarps) {
    ++option;
  }
  ScoreLaunch l;
  l.queries_per_block = queries_per_block;
  l.threads = row_warps * kKeyGroupOptions[option] * kWarpSize;
  l.kernel = variant.kernels[option][histogram ? 1 : 0];
  l.smem = ScoreSmemBytes(variant.k_steps) + (histogram ? ScoreHistSmemBytes(queries_per_block) : 0);
  NQ_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(l.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, l.smem));
  int per_sm = 0;
  NQ_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, l.kernel, l.threads, l.smem));
  const std::int64_t tiles = CeilDiv(std::int64_t{chunk.start_pos} + chunk.tokens, kScoreTileKeys);
  const std::int64_t splits =
      std::clamp<std::int64_t>(CeilDiv(std::int64_t{std::max(per_sm, 1)} * ctx.num_sms, groups), 1, tiles);
  l.grid = dim3(static_cast<unsigned>(splits), static_cast<unsigned>(groups));
  return l;
}

// Scores then selects for one chunk of queries (q, weights, selected, start_pos, tokens already
// offset to it).
absl::Status LaunchChunk(const IndexerTopKParams& chunk, const ScoresVariant& scores,
                         int candidate_capacity, int select_smem, const LaunchContext& ctx) {
  ASSIGN_OR_RETURN(const ScoreLaunch sl, MakeScoreLaunch(chunk, scores, /*histogram=*/false, ctx));
  sl.kernel<<<sl.grid, sl.threads, sl.smem, ctx.stream>>>(chunk, sl.queries_per_block, nullptr);
  RETURN_IF_ERROR(CheckLaunch("IndexerScoresKernel"));
  IndexerSelectKernel<<<static_cast<unsigned>(chunk.tokens), kSelectThreads, select_smem,
                        ctx.stream>>>(chunk, candidate_capacity);
  return CheckLaunch("IndexerSelectKernel");
}

// The decode path (indexer_decode_select.cuh): a memset, scores with the top-digit histograms,
// the multi-block filter, the per-query resolve; or one selection block per query after the
// scores (indexer_one_block_select.cuh; IndexerDecodeSelect says when). All of p's queries in
// one chunk.
absl::Status LaunchDecode(const IndexerTopKParams& p, const ScoresVariant& scores,
                          int candidate_capacity, int select_smem, const LaunchContext& ctx) {
  const std::int64_t visible_max = std::int64_t{p.start_pos} + p.tokens;
  const SelectScratchLayout l = MakeSelectScratchLayout(p.tokens, visible_max, p.top_k);
  auto* base = static_cast<std::byte*>(p.select_scratch);
  const DecodeSelectScratch s{
      .top_hist = reinterpret_cast<unsigned*>(base),
      .second_hist = reinterpret_cast<unsigned*>(base + l.second_hist),
      .counts = reinterpret_cast<DecodeSelectCounts*>(base + l.counts),
      .sure = reinterpret_cast<std::uint64_t*>(base + l.sure),
      .cand = reinterpret_cast<std::uint64_t*>(base + l.cand),
      .cand_stride = visible_max};
  NQ_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(base, 0, static_cast<std::size_t>(l.zeroed_bytes), ctx.stream));
  ASSIGN_OR_RETURN(const ScoreLaunch sl, MakeScoreLaunch(p, scores, /*histogram=*/true, ctx));
  sl.kernel<<<sl.grid, sl.threads, sl.smem, ctx.stream>>>(p, sl.queries_per_block, s.top_hist);
  RETURN_IF_ERROR(CheckLaunch("IndexerScoresKernel (histogram)"));
  const bool one_block = p.decode_select == IndexerDecodeSelect::kOneBlock ||
                         (p.decode_select == IndexerDecodeSelect::kAuto && p.tokens == 1 &&
                          visible_max <= kOneBlockSelectChunkKeys);
  if (one_block) {
    // A row of at most one chunk stays in registers between the selection's two passes over it.
    const auto kernel = visible_max <= kOneBlockSelectChunkKeys ? IndexerOneBlockSelectKernel<true>
                                                                : IndexerOneBlockSelectKernel<false>;
    NQ_CUDA_RETURN_IF_ERROR(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, select_smem));
    const int bucket_capacity = select_smem / static_cast<int>(sizeof(std::uint64_t));
    RETURN_IF_ERROR(LaunchProgrammaticDependent(kernel, dim3(static_cast<unsigned>(p.tokens)),
                                                dim3(kDecodeSelectThreads), static_cast<std::size_t>(select_smem),
                                                ctx, p, static_cast<const unsigned*>(s.top_hist), bucket_capacity,
                                                candidate_capacity));
    return CheckLaunch("IndexerOneBlockSelectKernel");
  }
  const dim3 filter_grid(static_cast<unsigned>(CeilDiv(visible_max, kFilterKeysPerBlock)),
                         static_cast<unsigned>(p.tokens));
  RETURN_IF_ERROR(
      LaunchProgrammaticDependent(IndexerFilterKernel, filter_grid, dim3(kDecodeSelectThreads), 0, ctx, p, s));
  RETURN_IF_ERROR(CheckLaunch("IndexerFilterKernel"));
  RETURN_IF_ERROR(LaunchProgrammaticDependent(IndexerResolveKernel, dim3(static_cast<unsigned>(p.tokens)),
                                              dim3(kDecodeSelectThreads), static_cast<std::size_t>(select_smem), ctx,
                                              p, s, candidate_capacity));
  return CheckLaunch("IndexerResolveKernel");
}

}  // namespace

std::int64_t IndexerSelectScratchBytes(std::int64_t tokens, std::int64_t visible_max,
                                       std::int64_t top_k) {
  if (tokens < 1 || tokens > kIndexerDecodeMaxQueries) return 0;
  return MakeSelectScratchLayout(tokens, visible_max, top_k).total;
}

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
        "holds at most ", kMaxIndexerSurvivors, " selected keys per query"));
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
  if (p.position != nullptr && p.tokens > p.score_rows) {
    return absl::InvalidArgumentError(absl::StrCat("IndexerTopK: a device position needs the ", p.tokens,
                                                   " queries in one chunk of score rows (", p.score_rows, ")"));
  }
  ASSIGN_OR_RETURN(const ScoresVariant scores, PickScoresVariant(p.dim));
  // The survivors' buffer holds them padded to a power of two; candidates get the rest.
  int survivors = 1;
  while (survivors < std::min<std::int64_t>(p.top_k, visible_max)) survivors *= 2;
  const int sort_bytes = survivors * static_cast<int>(sizeof(std::uint64_t));
  const int candidate_capacity =
      (kSelectDynamicSmemBytes - sort_bytes) / static_cast<int>(sizeof(std::uint64_t));
  NQ_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(IndexerSelectKernel,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               kSelectDynamicSmemBytes));
  if (p.select_scratch != nullptr && p.tokens <= kIndexerDecodeMaxQueries &&
      p.tokens <= p.score_rows) {
    NQ_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(IndexerResolveKernel,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 kSelectDynamicSmemBytes));
    return LaunchDecode(p, scores, candidate_capacity, kSelectDynamicSmemBytes, ctx);
  }
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
