// Multi-head latent attention in the absorbed form (contract in kernels/backend.h), fp32.
//
// One block per (token, head). The block
//   1. stages q_nope and q_pe in shared memory and forms q_lat = q_nope · w_uk[h] (each thread
//      owns latent columns and walks dn; the w_uk reads coalesce along c);
//   2. walks the query's candidate keys (every s <= pos, or the `selected` row) in tiles of
//      kMlaKeyTile: each warp scores whole keys (lanes split c and dr, then a warp sum), the
//      tile's scores land in shared memory, and the online-softmax recurrence rescales the
//      running latent output o_lat (in shared memory, each column owned by one thread) and adds
//      the tile's p * kv_latent rows;
//   3. writes out[t, h*dv + v] = w_uv[h, v, :] · o_lat / sum, one warp per v.
// Keys outside [0, pos] (and -1) score -inf and drop out; a query with none left gets zeros.
// No size limit on the number of keys; the shared memory holds dn + dr + 2c + 2 * kMlaKeyTile
// words and must fit the default 48 KiB (DeepSeek-V3: 128 + 64 + 2 * 512, ~5 KiB).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/kv_fp8.cuh"
#include "kernels/cuda/load.cuh"
#include "kernels/cuda/reduce.cuh"
#include "kernels/dtype.h"

namespace nq::kernels::cuda {

struct MlaAttentionParams {
  const float* q_nope = nullptr;     // [tokens, heads, dn]
  const float* q_pe = nullptr;       // [tokens, heads, dr]
  // [keys, c] of kv_dtype (F32 or BF16), or U8 [keys, KvFp8RowBytes(c)]: packed FP8 rows
  // (kernels/kv_fp8.h)
  const void* kv_latent = nullptr;
  const void* k_pe = nullptr;  // [keys, dr], kv_dtype's (BF16 beside FP8 rows)
  DType kv_dtype = DType::kF32;
  const void* w_uk = nullptr;        // [heads, dn, c], elements of w_uk_dtype (F32 or BF16)
  DType w_uk_dtype = DType::kF32;
  const void* w_uv = nullptr;  // [heads, dv, c], elements of w_uv_dtype (F32 or BF16)
  DType w_uv_dtype = DType::kF32;
  const std::int32_t* selected = nullptr;  // [tokens, top_k], or null: every causal key
  float* out = nullptr;                    // [tokens, heads * dv]
  int tokens = 0;
  int heads = 0;
  int dn = 0;
  int dr = 0;
  int c = 0;
  int dv = 0;
  int top_k = 0;      // columns of `selected`
  int start_pos = 0;  // start_pos + tokens <= keys < 2^31
  // When set, the position of query 0 is read from here when the kernels run (a captured step
  // graph; kernels/step_position.h) and start_pos is only its bound (it sizes the launch).
  const std::int32_t* position = nullptr;
  float scale = 1.0f;
};

// Contract: shapes validated by Backend; tokens * heads < 2^31. InvalidArgumentError for weight
// dtypes other than F32 / BF16 or dims whose shared memory exceeds kMlaMaxSharedBytes.
absl::Status LaunchMlaAttention(const MlaAttentionParams& params, const LaunchContext& ctx);

inline constexpr int kMlaThreads = 256;
inline constexpr int kMlaWarps = kMlaThreads / kWarpSize;
inline constexpr int kMlaKeyTile = 32;
// The default dynamic shared memory limit (no cudaFuncSetAttribute opt-in needed).
inline constexpr std::size_t kMlaMaxSharedBytes = 48 * 1024;

// Dynamic shared memory of one block: q_nope, q_pe, q_lat, o_lat and the key tile.
constexpr std::size_t MlaSharedBytes(std::size_t dn, std::size_t dr, std::size_t c) {
  return sizeof(float) * (dn + dr + 2 * c + 2 * kMlaKeyTile);
}

// The latent cache's rows as the kernel reads them: element i of key `key` as a float.
template <typename KvT>
struct LatentRows {
  using Rope = KvT;  // the rope key's element type
  const KvT* base;
  int c;
  __device__ LatentRows(const void* kv_latent, int c) : base(static_cast<const KvT*>(kv_latent)), c(c) {}
  __device__ float At(std::int64_t key, int i) const { return LoadFloat(base + key * c + i); }
};
template <>
struct LatentRows<KvFp8> {
  using Rope = Bf16;
  const std::uint8_t* base;
  int c;
  std::int64_t width;
  __device__ LatentRows(const void* kv_latent, int c)
      : base(static_cast<const std::uint8_t*>(kv_latent)), c(c), width(KvFp8RowBytes(c)) {}
  __device__ float At(std::int64_t key, int i) const { return KvFp8Value(base + key * width, c, i); }
};

template <typename KvT, typename UkT, typename UvT>
__global__ void __launch_bounds__(kMlaThreads)
    MlaAttentionKernel(const __grid_constant__ MlaAttentionParams p) {
  using RopeT = typename LatentRows<KvT>::Rope;
  const LatentRows<KvT> kv_latent(p.kv_latent, p.c);
  const RopeT* k_pe = static_cast<const RopeT*>(p.k_pe);
  extern __shared__ float smem[];
  float* q_nope = smem;         // [dn]
  float* q_pe = q_nope + p.dn;  // [dr]
  float* q_lat = q_pe + p.dr;   // [c]
  float* o_lat = q_lat + p.c;   // [c], unnormalised
  float* tile_p = o_lat + p.c;  // [kMlaKeyTile] scores, then probabilities
  int* tile_key = reinterpret_cast<int*>(tile_p + kMlaKeyTile);  // [kMlaKeyTile], -1 = masked

  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
  const int t = blockIdx.x / p.heads;
  const int h = blockIdx.x % p.heads;
  const int pos = (p.position != nullptr ? *p.position : p.start_pos) + t;
  const std::int64_t row = std::int64_t{t} * p.heads + h;

  for (int j = tid; j < p.dn; j += kMlaThreads) q_nope[j] = __ldg(p.q_nope + row * p.dn + j);
  for (int j = tid; j < p.dr; j += kMlaThreads) q_pe[j] = __ldg(p.q_pe + row * p.dr + j);
  __syncthreads();

  // 1. q_lat = q_nope · w_uk[h]; the same thread later owns o_lat[i].
  const UkT* w_uk = static_cast<const UkT*>(p.w_uk) + std::int64_t{h} * p.dn * p.c;
  for (int i = tid; i < p.c; i += kMlaThreads) {
    float acc = 0.0f;
    for (int j = 0; j < p.dn; ++j) {
      acc = fmaf(q_nope[j], LoadFloat(w_uk + std::int64_t{j} * p.c + i), acc);
    }
    q_lat[i] = acc;
    o_lat[i] = 0.0f;
  }
  __syncthreads();

  // 2. Online softmax over the candidate keys, a tile at a time.
  const int candidates = p.selected != nullptr ? p.top_k : pos + 1;
  const std::int32_t* selected_row =
      p.selected != nullptr ? p.selected + std::int64_t{t} * p.top_k : nullptr;
  float run_max = -INFINITY;
  float run_sum = 0.0f;
  for (int base = 0; base < candidates; base += kMlaKeyTile) {
    for (int k = warp; k < kMlaKeyTile; k += kMlaWarps) {
      int key = -1;
      if (base + k < candidates) {
        key = selected_row != nullptr ? selected_row[base + k] : base + k;
        if (key > pos) key = -1;  // not visible (and -1 stays -1)
      }
      float score = -INFINITY;
      if (key >= 0) {
        const RopeT* kp = k_pe + std::int64_t{key} * p.dr;
        float partial = 0.0f;
        for (int i = lane; i < p.c; i += kWarpSize) {
          partial = fmaf(q_lat[i], kv_latent.At(key, i), partial);
        }
        for (int i = lane; i < p.dr; i += kWarpSize) {
          partial = fmaf(q_pe[i], LoadFloat(kp + i), partial);
        }
        score = WarpSum(partial) * p.scale;
      }
      if (lane == 0) {
        tile_p[k] = score;
        tile_key[k] = key < 0 ? -1 : key;
      }
    }
    __syncthreads();
    float tile_max = -INFINITY;
    for (int k = 0; k < kMlaKeyTile; ++k) tile_max = fmaxf(tile_max, tile_p[k]);
    const float new_max = fmaxf(run_max, tile_max);
    // Every thread read the whole tile before the scores become probabilities.
    __syncthreads();
    if (new_max == -INFINITY) continue;  // nothing visible so far; uniform across the block
    if (tid < kMlaKeyTile) {
      tile_p[tid] = tile_key[tid] >= 0 ? expf(tile_p[tid] - new_max) : 0.0f;
    }
    __syncthreads();
    const float correction = expf(run_max - new_max);  // 0 while run_max is -inf
    float tile_sum = 0.0f;
    for (int k = 0; k < kMlaKeyTile; ++k) tile_sum += tile_p[k];
    run_sum = run_sum * correction + tile_sum;
    run_max = new_max;
    for (int i = tid; i < p.c; i += kMlaThreads) {
      float acc = o_lat[i] * correction;
      for (int k = 0; k < kMlaKeyTile; ++k) {
        const int key = tile_key[k];
        if (key >= 0) {
          acc = fmaf(tile_p[k], kv_latent.At(key, i), acc);
        }
      }
      o_lat[i] = acc;
    }
    // The tile is consumed (and o_lat written) before the next one overwrites tile_p.
    __syncthreads();
  }

  // 3. out = w_uv[h] · o_lat / sum; zeros when no key was visible.
  const float inv_sum = run_sum > 0.0f ? 1.0f / run_sum : 0.0f;
  const UvT* w_uv = static_cast<const UvT*>(p.w_uv) + std::int64_t{h} * p.dv * p.c;
  float* out = p.out + row * p.dv;
  for (int v = warp; v < p.dv; v += kMlaWarps) {
    const UvT* w_row = w_uv + std::int64_t{v} * p.c;
    float partial = 0.0f;
    for (int i = lane; i < p.c; i += kWarpSize) {
      partial = fmaf(LoadFloat(w_row + i), o_lat[i], partial);
    }
    partial = WarpSum(partial);
    if (lane == 0) out[v] = partial * inv_sum;
  }
}

}  // namespace nq::kernels::cuda
