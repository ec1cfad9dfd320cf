// DSA indexer scoring on tensor cores: score[t, s] = sum_h weights[t, h] * relu(q[t, h, :] · k[s, :])
// for the visible keys s <= pos_t of a group of queries, into the scores scratch (row t of the
// chunk, stride start_pos + tokens). Launched by LaunchIndexerTopK (indexer_topk.cu).
//
// Why this shape: a key is 512 bytes and meets 64 heads x 128 dims = 8192 multiply-adds, 16 per
// byte, more than FP32 FFMA sustains at HBM bandwidth. So the (query, head) rows of a group of
// queries form the M dimension of mma.sync m16n8k8 TF32 (every key read once for all heads and
// all queries of a decode chunk), and each operand is split into TF32 hi + lo parts with
// a_hi*b_hi + a_hi*b_lo + a_lo*b_hi ("3xTF32"): near-FP32 products (the dropped a_lo*b_lo term is
// ~2^-22 relative), and exact for small-integer inputs, whose lo parts are zero.
//
// A block owns up to kScoreMaxWarps x 16 rows (whole queries: rows = queries x heads) held as
// A fragments in registers for the whole kernel, and walks key tiles of kScoreTileKeys keys
// (blockIdx.x, blockIdx.x + gridDim.x, ...) through a two-stage cp.async pipeline in shared
// memory. Its warps are row warps x kKeyGroups: each row warp's 16 rows are held by kKeyGroups
// warps that split a tile's 8-key N tiles between them. The A fragments take ~130 registers, so
// an SM holds few warps; with GLM-5's 32 indexer heads a decode block without key groups had 2
// warps and the kernel ran at 3-6 % occupancy, issue-bound on dependent MMA chains (ncu).
// Per tile: the MMAs, w * relu(dot) per row into shared memory (summed over a warp's 16 rows
// first when they are all one query's heads), then a sum over each query's parts in a fixed
// order (deterministic), written as the score. NaN scores are written as -inf and -0 as +0, so
// the selection's bit order matches the reference's comparison.
//
// kHistogram (the decode path, indexer_decode_select.cuh): the block also counts its scores'
// top radix digits (bits 31..21 of OrderedBits) per query in shared memory and adds them to the
// per-query global histogram `top_hist` [tokens][kRadixBins] (zeroed by the launcher), so the
// selection needs no pass of its own to find the first threshold digit.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/indexer_select.cuh"
#include "kernels/cuda/indexer_topk.cuh"
#include "kernels/cuda/launch_dependent.cuh"
#include "kernels/cuda/reduce.cuh"

namespace nq::kernels::cuda {

inline constexpr int kScoreTileKeys = 64;
inline constexpr int kScoreWarpRows = 16;  // M of m16n8k8
inline constexpr int kScoreMaxWarps = 8;
inline constexpr int kScoreMaxRows = kScoreMaxWarps * kScoreWarpRows;
inline constexpr int kScoreStages = 2;
inline constexpr int kScoreNTiles = kScoreTileKeys / 8;  // N = 8 keys per MMA
// Part rows are padded by 8 floats: the float2 epilogue stores of a warp's 8 row groups land on
// distinct bank pairs (row stride 72 = 8 mod 32 banks).
inline constexpr int kScorePartStride = kScoreTileKeys + 8;

// Key rows in shared memory: the kKSteps x 8 dims the MMAs read (zero past dim), plus 4 floats.
// A stride of 4 mod 8 words puts the 8 keys x 4 dims of one B-fragment load on 32 distinct banks.
__host__ __device__ constexpr int ScoreKeyStride(int k_steps) { return k_steps * 8 + 4; }

__host__ __device__ constexpr int ScoreSmemBytes(int k_steps) {
  return static_cast<int>(sizeof(float)) * (kScoreStages * kScoreTileKeys * ScoreKeyStride(k_steps) +
                                            kScoreMaxRows * kScorePartStride);
}
// With kHistogram: one top-digit histogram per query of the block after the tiles and parts.
__host__ __device__ constexpr int ScoreHistSmemBytes(int queries_per_block) {
  return queries_per_block * kRadixBins * static_cast<int>(sizeof(unsigned));
}

// The TF32 hi part of x (low 13 mantissa bits zero) and the TF32 rounding of the remainder.
__device__ __forceinline__ void SplitTf32(float x, std::uint32_t& hi, std::uint32_t& lo) {
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(hi) : "f"(x));
  const float rest = x - __uint_as_float(hi);
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(lo) : "f"(rest));
}

__device__ __forceinline__ void MmaTf32(float (&c)[4], const std::uint32_t (&a)[4],
                                        std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16-byte (or 4-byte) asynchronous copy global -> shared; src_bytes 0 writes zeros.
__device__ __forceinline__ void CpAsync16(float* dst, const float* src, int src_bytes) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void CpAsync4(float* dst, const float* src, int src_bytes) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(d), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void CpAsyncWaitOne() { asm volatile("cp.async.wait_group 1;"); }

// Stages keys [first, first + kScoreTileKeys) into `tile` (rows of `stride` floats); keys past
// `last` and columns in [dim, padded) are zero. `vec4`: dim % 4 == 0 and k 16-byte aligned.
__device__ __forceinline__ void LoadKeyTile(float* tile, const float* k, int dim, int padded,
                                            int stride, int first, int last, bool vec4) {
  if (vec4) {
    const int chunks = padded / 4;
    for (int i = threadIdx.x; i < kScoreTileKeys * chunks; i += blockDim.x) {
      const int row = i / chunks, col = (i % chunks) * 4;
      const int key = first + row;
      const bool valid = key <= last && col < dim;
      const float* src = valid ? k + std::int64_t{key} * dim + col : k;
      CpAsync16(tile + row * stride + col, src, valid ? 16 : 0);
    }
  } else {
    for (int i = threadIdx.x; i < kScoreTileKeys * padded; i += blockDim.x) {
      const int row = i / padded, col = i % padded;
      const int key = first + row;
      const bool valid = key <= last && col < dim;
      const float* src = valid ? k + std::int64_t{key} * dim + col : k;
      CpAsync4(tile + row * stride + col, src, valid ? 4 : 0);
    }
  }
}

// grid: (key splits, query groups of `queries_per_block`); block: ceil(rows / 16) x kKeyGroups
// warps <= kScoreMaxWarps, rows = queries of the group x heads <= kScoreMaxRows; dynamic shared
// memory ScoreSmemBytes(kKSteps).
// kKSteps * 8 >= dim (A fragments are registers, so a compile-time count). With kHistogram, add
// ScoreHistSmemBytes(queries_per_block) of dynamic shared memory; top_hist is unused without.
template <int kKSteps, int kKeyGroups, bool kHistogram>
__global__ void __launch_bounds__(kScoreMaxWarps* kWarpSize)
    IndexerScoresKernel(const __grid_constant__ IndexerTopKParams p, int queries_per_block,
                        unsigned* top_hist) {
  extern __shared__ float score_smem[];
  constexpr int stride = ScoreKeyStride(kKSteps);
  constexpr int padded = kKSteps * 8;
  float* tiles = score_smem;                                       // [stages][64][stride]
  float* part = score_smem + kScoreStages * kScoreTileKeys * stride;  // [rows][72]
  unsigned* hist = reinterpret_cast<unsigned*>(part + kScoreMaxRows * kScorePartStride);

  const int q0 = blockIdx.y * queries_per_block;
  const int queries = min(queries_per_block, p.tokens - q0);
  const int rows = queries * p.heads;
  const int last_key = IndexerStart(p) + q0 + queries - 1;  // the group's last visible key
  // Every query of the group sees at most top_k keys and selects them all without scores
  // (WriteAllVisibleKeys). Block-uniform, before any barrier.
  if (last_key < p.top_k) return;
  static_assert(kScoreNTiles % kKeyGroups == 0);
  constexpr int kGroupNTiles = kScoreNTiles / kKeyGroups;  // this warp's N tiles of a key tile
  const int row_warps = static_cast<int>(blockDim.x) / (kWarpSize * kKeyGroups);
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize % row_warps;  // its rows' warp
  const int n_first = static_cast<int>(threadIdx.x) / (kWarpSize * row_warps) * kGroupNTiles;
  const int lane = threadIdx.x % kWarpSize;
  const int g = lane / 4, t4 = lane % 4;  // fragment coordinates (PTX ISA m16n8k8 layouts)
  // A warp's 16 rows are one query's heads when heads % 16 == 0: its parts are summed in-warp.
  const bool warp_is_one_query = p.heads % kScoreWarpRows == 0;
  const int parts_per_query = warp_is_one_query ? p.heads / kScoreWarpRows : p.heads;

  // The first key tile is in flight (HBM) while the query fragments load (L2) below.
  const bool vec4 = p.dim % 4 == 0 && reinterpret_cast<std::uintptr_t>(p.k) % 16 == 0;
  const int tiles_total = last_key / kScoreTileKeys + 1;
  const std::int64_t row_stride = std::int64_t{p.start_pos} + p.tokens;  // the bound's
  int tile = blockIdx.x;
  if (tile < tiles_total) {
    LoadKeyTile(tiles, p.k, p.dim, padded, stride, tile * kScoreTileKeys, last_key, vec4);
  }
  CpAsyncCommit();
  // The selection after this kernel (launched as its programmatic dependent) waits for it to
  // complete before reading anything; letting it launch now hides its launch latency.
  LetDependentsLaunch();
  if constexpr (kHistogram) {
    // Ordered before the first epilogue's counts by the loop's first barrier.
    for (int i = threadIdx.x; i < queries * kRadixBins; i += blockDim.x) hist[i] = 0;
  }

  // This warp's rows r0 = 16 warp + g and r1 = r0 + 8 of the group: A fragments and weights.
  const float* q = p.q + std::int64_t{q0} * p.heads * p.dim;
  const int r0 = warp * kScoreWarpRows + g, r1 = r0 + 8;
  std::uint32_t a_hi[kKSteps][4], a_lo[kKSteps][4];
#pragma unroll
  for (int s = 0; s < kKSteps; ++s) {
    const int c0 = s * 8 + t4, c1 = c0 + 4;
    const int row_of[4] = {r0, r1, r0, r1};
    const int col_of[4] = {c0, c0, c1, c1};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const bool valid = row_of[j] < rows && col_of[j] < p.dim;
      const float v = valid ? q[std::int64_t{row_of[j]} * p.dim + col_of[j]] : 0.0f;
      SplitTf32(v, a_hi[s][j], a_lo[s][j]);
    }
  }
  const float* w = p.weights + std::int64_t{q0} * p.heads;
  const float w0 = r0 < rows ? w[r0] : 0.0f, w1 = r1 < rows ? w[r1] : 0.0f;

  for (int it = 0; tile < tiles_total; ++it, tile += gridDim.x) {
    // Prefetch the next tile into the other stage (read last iteration, before its barriers).
    const int next = tile + gridDim.x;
    if (next < tiles_total) {
      LoadKeyTile(tiles + ((it + 1) % kScoreStages) * kScoreTileKeys * stride, p.k, p.dim, padded,
                  stride, next * kScoreTileKeys, last_key, vec4);
    }
    CpAsyncCommit();
    CpAsyncWaitOne();
    __syncthreads();
    const float* keys = tiles + (it % kScoreStages) * kScoreTileKeys * stride;

    // Independent accumulators (one per 8-key N tile of this warp's group) keep the tensor pipe busy.
    float acc[kGroupNTiles][4] = {};
#pragma unroll
    for (int s = 0; s < kKSteps; ++s) {
#pragma unroll
      for (int n = 0; n < kGroupNTiles; ++n) {
        const float* b = keys + ((n_first + n) * 8 + g) * stride + s * 8 + t4;
        std::uint32_t b0_hi, b0_lo, b1_hi, b1_lo;
        SplitTf32(b[0], b0_hi, b0_lo);
        SplitTf32(b[4], b1_hi, b1_lo);
        MmaTf32(acc[n], a_lo[s], b0_hi, b1_hi);  // small terms first
        MmaTf32(acc[n], a_hi[s], b0_lo, b1_lo);
        MmaTf32(acc[n], a_hi[s], b0_hi, b1_hi);
      }
    }
    // Epilogue: w * relu(dot) (a NaN dot adds nothing, as in the reference), per row or summed
    // over the warp's 16 rows. c0, c1: row r0, keys 2 t4, 2 t4 + 1 of the N tile; c2, c3: row r1.
#pragma unroll
    for (int n = 0; n < kGroupNTiles; ++n) {
      float v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = acc[n][j] > 0.0f ? (j < 2 ? w0 : w1) * acc[n][j] : 0.0f;
      const int col = (n_first + n) * 8 + 2 * t4;
      if (warp_is_one_query) {
        float s0 = v[0] + v[2], s1 = v[1] + v[3];
#pragma unroll
        for (int offset = 4; offset < kWarpSize; offset *= 2) {
          s0 += __shfl_xor_sync(kFullWarpMask, s0, offset);
          s1 += __shfl_xor_sync(kFullWarpMask, s1, offset);
        }
        if (g == 0) *reinterpret_cast<float2*>(part + warp * kScorePartStride + col) = {s0, s1};
      } else {
        *reinterpret_cast<float2*>(part + r0 * kScorePartStride + col) = {v[0], v[1]};
        *reinterpret_cast<float2*>(part + r1 * kScorePartStride + col) = {v[2], v[3]};
      }
    }
    __syncthreads();
    // One thread per (query, key): the query's parts in order; only keys it sees.
    const int first_key = tile * kScoreTileKeys;
    for (int i = threadIdx.x; i < queries * kScoreTileKeys; i += blockDim.x) {
      const int ql = i / kScoreTileKeys, col = i % kScoreTileKeys;
      const int key = first_key + col;
      const int pos = IndexerStart(p) + q0 + ql;
      if (key > pos) continue;
      const float* src = part + ql * parts_per_query * kScorePartStride + col;
      float score = 0.0f;
      for (int j = 0; j < parts_per_query; ++j) score += src[j * kScorePartStride];
      score = isnan(score) ? -INFINITY : (score == 0.0f ? 0.0f : score);
      p.scores[(q0 + ql) * row_stride + key] = score;
      if constexpr (kHistogram) {
        atomicAdd(&hist[ql * kRadixBins + (OrderedBits(score) >> kTopDigitShift)], 1u);
      }
    }
    // The next iteration's barrier (after its wait) orders these reads before the next epilogue.
  }
  if constexpr (kHistogram) {
    __syncthreads();
    for (int i = threadIdx.x; i < queries * kRadixBins; i += blockDim.x) {
      if (hist[i] != 0) atomicAdd(&top_hist[q0 * kRadixBins + i], hist[i]);
    }
  }
}

}  // namespace nq::kernels::cuda
