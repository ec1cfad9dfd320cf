// DSA indexer selection (contract in kernels/backend.h), in two kernels per chunk of queries:
//  - IndexerScoresKernel: score[t, s] = sum_h weights[t, h] * relu(q[t, h, :] · k[s, :]) for
//    the visible keys s <= pos_t, into a device scratch matrix. A block covers one query and
//    kIndexerKeysPerBlock keys; each warp scores whole keys (lanes split the head dim, a warp sum
//    per head).
//  - IndexerTopKKernel: one block per query loads its visible scores into shared memory, sorts
//    them with a bitonic network by (score descending, key ascending) (a strict total order: NaN
//    scores rank as -inf, padding as -inf with an index past every key), and writes the first
//    top_k keys, -1 past the visible ones.
// Limit: at most kMaxIndexerKeys visible keys (start_pos + tokens), so one query's sort fits in
// shared memory (8 bytes a key, 128 KiB, opted into with cudaFuncSetAttribute). Longer contexts
// are InvalidArgumentError.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/reduce.cuh"

namespace nq::kernels::cuda {

inline constexpr int kMaxIndexerKeys = 16384;

struct IndexerTopKParams {
  const float* q = nullptr;          // [tokens, heads, dim]
  const float* k = nullptr;          // [keys, dim]
  const float* weights = nullptr;    // [tokens, heads]
  std::int32_t* selected = nullptr;  // [tokens, top_k]
  float* scores = nullptr;           // device scratch [score_rows, start_pos + tokens]
  int tokens = 0;
  int heads = 0;
  int dim = 0;
  int top_k = 0;
  int start_pos = 0;  // start_pos + tokens <= kMaxIndexerKeys
  // Rows of `scores`: queries are processed in chunks of this many.
  int score_rows = 0;
};

// Contract: shapes validated by Backend. InvalidArgumentError past kMaxIndexerKeys visible keys.
absl::Status LaunchIndexerTopK(const IndexerTopKParams& params, const LaunchContext& ctx);

// OK when queries that see up to `visible_keys` keys can be selected for (before scratch is
// sized for them); the InvalidArgumentError LaunchIndexerTopK would return otherwise.
absl::Status CheckIndexerKeys(std::int64_t visible_keys);

inline constexpr int kIndexerScoreThreads = 256;
inline constexpr int kIndexerKeysPerBlock = 32;
inline constexpr int kIndexerSortThreads = 1024;

// grid: (tokens of this chunk, key blocks). `p` describes the chunk: q, weights, start_pos and
// tokens already offset to it; scores row t belongs to its query t.
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    IndexerScoresKernel(const __grid_constant__ IndexerTopKParams p) {
  constexpr int kWarps = kThreads / kWarpSize;
  const int t = blockIdx.x;
  const int pos = p.start_pos + t;
  const int first_key = blockIdx.y * kIndexerKeysPerBlock;
  if (first_key > pos) return;  // the whole block is past the causal edge (no barriers below)
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int stride = p.start_pos + p.tokens;
  const float* q = p.q + std::int64_t{t} * p.heads * p.dim;
  const float* w = p.weights + std::int64_t{t} * p.heads;
  for (int key = first_key + warp; key < first_key + kIndexerKeysPerBlock && key <= pos;
       key += kWarps) {
    const float* k = p.k + std::int64_t{key} * p.dim;
    float score = 0.0f;
    for (int h = 0; h < p.heads; ++h) {
      const float* qh = q + std::int64_t{h} * p.dim;
      float partial = 0.0f;
      for (int i = lane; i < p.dim; i += kWarpSize) {
        partial = fmaf(__ldg(qh + i), __ldg(k + i), partial);
      }
      const float dot = WarpSum(partial);
      if (dot > 0.0f) score = fmaf(__ldg(w + h), dot, score);
    }
    if (lane == 0) p.scores[std::int64_t{t} * stride + key] = isnan(score) ? -INFINITY : score;
  }
}

// Whether (score a, key ia) comes before (score b, key ib) in the selection order.
__device__ __forceinline__ bool Before(float a, int ia, float b, int ib) {
  return a > b || (a == b && ia < ib);
}

// grid: (tokens of this chunk); dynamic shared memory: 8 bytes per key of the padded row.
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    IndexerTopKKernel(const __grid_constant__ IndexerTopKParams p) {
  extern __shared__ float sort_smem[];
  const int t = blockIdx.x;
  const int visible = p.start_pos + t + 1;
  int padded = 1;
  while (padded < visible) padded *= 2;
  float* score = sort_smem;                               // [padded]
  int* key = reinterpret_cast<int*>(sort_smem + padded);  // [padded]
  const float* row = p.scores + std::int64_t{t} * (p.start_pos + p.tokens);
  for (int i = threadIdx.x; i < padded; i += kThreads) {
    score[i] = i < visible ? row[i] : -INFINITY;
    key[i] = i < visible ? i : INT_MAX;
  }
  __syncthreads();
  // Bitonic sort into selection order.
  for (int size = 2; size <= padded; size *= 2) {
    for (int stride = size / 2; stride > 0; stride /= 2) {
      for (int i = threadIdx.x; i < padded; i += kThreads) {
        const int partner = i ^ stride;
        if (partner <= i) continue;
        // Runs with (i & size) == 0 end up in selection order, the others reversed.
        const bool forward = (i & size) == 0;
        const bool swap = forward ? Before(score[partner], key[partner], score[i], key[i])
                                  : Before(score[i], key[i], score[partner], key[partner]);
        if (swap) {
          const float s = score[i];
          score[i] = score[partner];
          score[partner] = s;
          const int k = key[i];
          key[i] = key[partner];
          key[partner] = k;
        }
      }
      __syncthreads();
    }
  }
  std::int32_t* out = p.selected + std::int64_t{t} * p.top_k;
  for (int j = threadIdx.x; j < p.top_k; j += kThreads) {
    out[j] = j < visible ? key[j] : -1;
  }
}

}  // namespace nq::kernels::cuda
