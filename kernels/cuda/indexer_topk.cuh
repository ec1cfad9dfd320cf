// DSA indexer selection (contract in kernels/backend.h). Decode (tokens <= kIndexerDecodeMaxQueries,
// with select_scratch) takes indexer_decode_select.cuh's path: the selection spread over many
// blocks. Otherwise two kernels per chunk of queries:
//  - IndexerScoresKernel (indexer_scores.cuh): score[t, s] for the visible keys s <= pos_t on
//    tensor cores (3xTF32, near-FP32), each key read once for all heads of a group of queries,
//    into a device scratch matrix [score_rows, start_pos + tokens].
//  - IndexerSelectKernel (indexer_select.cuh): one block per query finds the top_k by radix
//    select on the scores' bits (no sort; NaN as -inf, ties to the lower key) and writes their
//    keys in ascending order, padded with -1.
// Both are stream-ordered and allocate nothing: a decode step's call can be graph-captured.
// Limits: heads <= kMaxIndexerHeads and dim <= kMaxIndexerDim (A fragments in registers);
// min(top_k, visible keys) <= kMaxIndexerSurvivors (the survivors are held in shared memory).
// Visible keys are limited only by the caller's scores scratch (one row per query of a chunk).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"

namespace nq::kernels::cuda {

inline constexpr int kMaxIndexerHeads = 128;
inline constexpr int kMaxIndexerDim = 128;
inline constexpr int kMaxIndexerSurvivors = 16384;
// Up to this many queries (decode, MTP verification) select on the decode path.
inline constexpr int kIndexerDecodeMaxQueries = 4;

// How a decode call (select_scratch set) selects after scoring: the many-block filter and a
// one-block resolve (indexer_decode_select.cuh), or one block per query over the score row
// (indexer_one_block_select.cuh). kAuto takes the one-block selection for one query whose row
// fits its registers (at most 16384 keys) and the filter otherwise: on the H200 it is 7 % faster
// at 4000 keys, 15 % below top_k and even at 16384; with 4 queries 3 % slower at 16384 keys, and
// past 16384 keys (a row read twice by one block) twice as slow (bench/README.md, "DSA indexer").
enum class IndexerDecodeSelect { kAuto, kFiltered, kOneBlock };

struct IndexerTopKParams {
  const float* q = nullptr;          // [tokens, heads, dim]
  const float* k = nullptr;          // [keys, dim], keys >= start_pos + tokens
  const float* weights = nullptr;    // [tokens, heads]
  std::int32_t* selected = nullptr;  // [tokens, top_k]
  float* scores = nullptr;           // device scratch [score_rows, start_pos + tokens]
  int tokens = 0;
  int heads = 0;
  int dim = 0;
  int top_k = 0;
  // Position of query 0; with `position` set, only its bound: strides, grids and scratch are
  // sized by it, and the kernels read the real position from `position` when they run (a
  // captured step graph; kernels/step_position.h).
  int start_pos = 0;
  const std::int32_t* position = nullptr;
  // Rows of `scores`: queries are processed in chunks of this many.
  int score_rows = 0;
  // Device scratch of IndexerSelectScratchBytes(tokens, start_pos + tokens, top_k) bytes
  // (16-byte aligned) for the decode path; null, or tokens > score_rows, takes the chunked path.
  void* select_scratch = nullptr;
  IndexerDecodeSelect decode_select = IndexerDecodeSelect::kAuto;
};

// Bytes of select_scratch for `tokens` queries that see up to `visible_max` keys; 0 when the call
// takes the chunked path (tokens > kIndexerDecodeMaxQueries).
std::int64_t IndexerSelectScratchBytes(std::int64_t tokens, std::int64_t visible_max,
                                       std::int64_t top_k);

// The position of query 0 as the kernels see it when they run.
__device__ __forceinline__ int IndexerStart(const IndexerTopKParams& p) {
  return p.position != nullptr ? *p.position : p.start_pos;
}

// Contract: shapes validated by Backend (and CheckIndexerShape). Enqueues on ctx.stream only.
// A device position needs the queries in one chunk (tokens <= score_rows).
absl::Status LaunchIndexerTopK(const IndexerTopKParams& params, const LaunchContext& ctx);

// OK when queries of `heads` x `dim` that see up to `visible_keys` keys can be selected for
// with `top_k` (call before sizing scratch); else the InvalidArgumentError LaunchIndexerTopK
// would return.
absl::Status CheckIndexerShape(std::int64_t visible_keys, std::int64_t heads, std::int64_t dim,
                               std::int64_t top_k);

}  // namespace nq::kernels::cuda
