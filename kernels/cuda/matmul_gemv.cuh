// MatMulGemvKernel: y[m, n] = x[m, k] · w[n, k]^T for decode-sized m (1 to kGemvMaxRows), where
// reading w once at memory bandwidth is the whole cost.
//
// Why it is shaped this way (bench/README.md "Backend ops": the previous one-row-per-warp kernel
// fell to 0.36 of copy bandwidth at m = 4 because every warp re-read all of x through L1/L2):
//  - A block of kGemvWarps warps owns kGemvRowsPerBlock consecutive rows of w; each warp streams
//    kGemvRowsPerWarp whole rows side by side with 16-byte loads (lane l reads elements
//    [l * kElems, (l + 1) * kElems) of each row per step), and issues the next step's loads before
//    it multiplies the current ones, so 2 * kGemvRowsPerWarp loads per lane are in flight.
//  - x is staged in shared memory once per block, in chunks of GemvChunkCols(m) columns (32 KiB),
//    and each float4 of x read there serves all kGemvRowsPerWarp rows: the shared-memory traffic
//    per weight byte is m / kGemvRowsPerWarp of what one row per warp would need.
//  - The m tokens are a template parameter, so all of them are served by each weight read and the
//    accumulators (m x kGemvRowsPerWarp fp32) stay in registers.
//  - FP8 block-scaled weights: a block's rows lie in one 128-row scale block, so the scale of
//    column block p / 128 is folded into x as it is staged (x[p] * scale_inv[rb, p / 128]); the
//    inner loop is then the same as for plain weights.
//  - Staged x is stored with an XOR swizzle of its float4 index so that the lanes of a quarter
//    warp, which read float4s kElems / 4 apart, hit distinct banks.
//  - Split k: a matrix with few rows (a latent down-projection of 576 rows, an indexer key
//    projection of 128, a router of 8) gives too few 32-row blocks to keep the SMs' memory pipes
//    busy, so its columns are split into up to kGemvMaxSplits ranges (gridDim.y), one block
//    each, launched as one thread-block cluster per 32 rows. Each block sums its range; the
//    cluster's first block adds the others' partial sums from their shared memory in rank order
//    (deterministic, no scratch, no atomics) and stores y (GemvSplits chooses the split count).
//  - Several matrices over one x (MatMulParams::extra, Backend::MatMulSharedInput): their row
//    blocks follow each other in one grid, so five small projections of one hidden state fill
//    the SMs together instead of each launching a mostly idle grid of its own.
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/launch_dependent.cuh"
#include "kernels/cuda/load.cuh"
#include "kernels/cuda/matmul_params.h"
#include "kernels/cuda/reduce.cuh"
#include "kernels/dtype.h"

namespace nq::kernels::cuda {

inline constexpr int kGemvWarps = 8;
inline constexpr int kGemvThreads = kGemvWarps * kWarpSize;
inline constexpr int kGemvRowsPerWarp = 4;
inline constexpr int kGemvRowsPerBlock = kGemvWarps * kGemvRowsPerWarp;
// Two blocks per SM caps registers at 128 per thread; the m = 8 accumulators need 32 of them.
inline constexpr int kGemvMinBlocksPerSm = 2;
// Staged x per block (32 KiB, under the 48 KiB that needs no opt-in attribute).
inline constexpr int kGemvSmemFloats = 8192;
// Chunks are a multiple of the widest warp step (32 lanes x 16 FP8 values), so every lane of every
// warp crosses a chunk boundary at the same step and the block can stage the next chunk together.
inline constexpr int kGemvColStep = kWarpSize * 16;

static_assert(kWeightScaleBlock % kGemvRowsPerBlock == 0,
              "a block's rows must share one 128-row block of FP8 scales");

// Column ranges per 32-row block: at most a portable thread-block cluster. (16, a non-portable
// cluster, was measured on GLM-5's router, 8 row blocks: 7.6 us in 8 splits and in 16 alike; the
// few-row GEMV is bound by its latency, not by idle SMs.)
inline constexpr int kGemvMaxSplits = 8;

__host__ __device__ constexpr int GemvChunkCols(int m) {
  return kGemvSmemFloats / m / kGemvColStep * kGemvColStep;
}

// A lane's share of one weight row per step, and how it is widened to fp32.
template <typename WeightT, bool kVectorized>
struct GemvVector;

// 16-byte loads: 4 F32, 8 BF16 / F16 or 16 FP8 values; widened 4 at a time (group g).
template <typename WeightT>
struct GemvVector<WeightT, true> {
  static constexpr int kElems = kVec16<WeightT>;
  using Raw = uint4;
  static __device__ __forceinline__ Raw Load(const WeightT* p) {
    return __ldg(reinterpret_cast<const uint4*>(p));
  }
  static __device__ __forceinline__ std::uint32_t Word(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
  }
  static __device__ __forceinline__ void Widen4(const Raw& raw, int g, float* out) {
    if constexpr (std::is_same_v<WeightT, float>) {
      out[0] = __uint_as_float(raw.x);
      out[1] = __uint_as_float(raw.y);
      out[2] = __uint_as_float(raw.z);
      out[3] = __uint_as_float(raw.w);
    } else if constexpr (sizeof(WeightT) == 2) {
      Widen2(Word(raw, 2 * g), WeightT{}, out);
      Widen2(Word(raw, 2 * g + 1), WeightT{}, out + 2);
    } else {
      cuda::Widen4(Word(raw, g), WeightT{}, out);
    }
  }
};

// Unaligned rows or k not a multiple of the vector: one element per lane per step.
template <typename WeightT>
struct GemvVector<WeightT, false> {
  static constexpr int kElems = 1;
  using Raw = float;
  static __device__ __forceinline__ Raw Load(const WeightT* p) { return LoadFloat(p); }
};

// The float4 slot of staged x holding float4 `q` of its row (see the file comment). Vectorised
// lanes read float4s kElems / 4 apart; flipping the low bits by q / 8 spreads each quarter warp
// over all 32 banks.
template <int kElems>
__device__ __forceinline__ int GemvSwizzle(int q) {
  constexpr int kMask = kElems / 4 - 1;
  return q ^ ((q >> 3) & kMask);
}

// xs[mi][cc] = x[mi, c0 + cc] (times the FP8 column-block scale) for cc < cols, by all threads.
template <int kM, bool kVectorized, int kElems>
__device__ __forceinline__ void GemvStageX(const MatMulParams& p, int c0, int cols,
                                           const float* scale_row, float* xs) {
  constexpr int kChunk = GemvChunkCols(kM);
#pragma unroll
  for (int mi = 0; mi < kM; ++mi) {
    const float* x_row = p.x + std::int64_t{mi} * p.k + c0;
    if constexpr (kVectorized) {
      float4* dst = reinterpret_cast<float4*>(xs + mi * kChunk);
      for (int q = threadIdx.x; q < cols / 4; q += kGemvThreads) {
        float4 v = __ldg(reinterpret_cast<const float4*>(x_row) + q);
        if (scale_row != nullptr) {
          // 4 | 128: the four columns share one scale.
          const float s = __ldg(scale_row + (c0 + 4 * q) / kWeightScaleBlock);
          v.x *= s;
          v.y *= s;
          v.z *= s;
          v.w *= s;
        }
        dst[GemvSwizzle<kElems>(q)] = v;
      }
    } else {
      for (int cc = threadIdx.x; cc < cols; cc += kGemvThreads) {
        float v = __ldg(x_row + cc);
        if (scale_row != nullptr) v *= __ldg(scale_row + (c0 + cc) / kWeightScaleBlock);
        xs[mi * kChunk + cc] = v;
      }
    }
  }
}

// acc[mi][r] += w_r[cc .. cc + kElems) · xs[mi][cc .. cc + kElems).
template <typename WeightT, int kM, bool kVectorized>
__device__ __forceinline__ void GemvAccumulate(
    const typename GemvVector<WeightT, kVectorized>::Raw (&raw)[kGemvRowsPerWarp], const float* xs,
    int cc, float (&acc)[kM][kGemvRowsPerWarp]) {
  using Vec = GemvVector<WeightT, kVectorized>;
  constexpr int kChunk = GemvChunkCols(kM);
  if constexpr (kVectorized) {
#pragma unroll
    for (int g = 0; g < Vec::kElems / 4; ++g) {
      float wf[kGemvRowsPerWarp][4];
#pragma unroll
      for (int r = 0; r < kGemvRowsPerWarp; ++r) Vec::Widen4(raw[r], g, wf[r]);
#pragma unroll
      for (int mi = 0; mi < kM; ++mi) {
        const float4 xv = reinterpret_cast<const float4*>(
            xs + mi * kChunk)[GemvSwizzle<Vec::kElems>(cc / 4 + g)];
#pragma unroll
        for (int r = 0; r < kGemvRowsPerWarp; ++r) {
          acc[mi][r] = fmaf(wf[r][0], xv.x, acc[mi][r]);
          acc[mi][r] = fmaf(wf[r][1], xv.y, acc[mi][r]);
          acc[mi][r] = fmaf(wf[r][2], xv.z, acc[mi][r]);
          acc[mi][r] = fmaf(wf[r][3], xv.w, acc[mi][r]);
        }
      }
    }
  } else {
#pragma unroll
    for (int mi = 0; mi < kM; ++mi) {
      const float xv = xs[mi * kChunk + cc];
#pragma unroll
      for (int r = 0; r < kGemvRowsPerWarp; ++r) acc[mi][r] = fmaf(raw[r], xv, acc[mi][r]);
    }
  }
}

// The matrix a block's rows belong to: w itself, or one of p.extra (MatMulSharedInput), whose
// 32-row blocks follow w's in blockIdx.x.
struct GemvMatrix {
  const void* w;
  const float* w_scale;
  float* y;
  int n;
  int block_row0;  // the block's first row within this matrix
};

__device__ __forceinline__ GemvMatrix GemvMatrixOf(const MatMulParams& p, int block) {
  GemvMatrix m{p.w, p.w_scale, p.y, p.n, 0};
  int first = 0;  // the first block of matrix m
  int blocks = (p.n + kGemvRowsPerBlock - 1) / kGemvRowsPerBlock;
  for (int e = 0; e < p.num_extra && block >= first + blocks; ++e) {
    first += blocks;
    const MatMulExtra& extra = p.extra[e];
    m = GemvMatrix{extra.w, extra.w_scale, extra.y, extra.n, 0};
    blocks = (extra.n + kGemvRowsPerBlock - 1) / kGemvRowsPerBlock;
  }
  m.block_row0 = (block - first) * kGemvRowsPerBlock;
  return m;
}

// Split k (gridDim.y > 1): every block of the cluster has its partial sums [kM][32 rows] in
// `partial` (shared memory); the cluster's first block adds them in rank order (deterministic, no
// scratch, no atomics) and stores y. No block leaves while its shared memory may still be read.
template <int kM>
__device__ __forceinline__ void GemvClusterSum(float* partial, const GemvMatrix& mat) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every block's partial sums are written
  if (cluster.block_rank() == 0) {
    for (int i = threadIdx.x; i < kM * kGemvRowsPerBlock; i += kGemvThreads) {
      float sum = 0.0f;
      for (unsigned rank = 0; rank < cluster.num_blocks(); ++rank) sum += cluster.map_shared_rank(partial, rank)[i];
      const int mi = i / kGemvRowsPerBlock, row = mat.block_row0 + i % kGemvRowsPerBlock;
      if (row < mat.n) mat.y[std::int64_t{mi} * mat.n + row] = sum;
    }
  }
  cluster.sync();
}

// kM: rows of x (p.m == kM). kVectorized: rows of w and x are 16-byte aligned and k is a multiple
// of the vector (checked by the launcher). F8E4M3 weights need p.w_scale.
template <typename WeightT, int kM, bool kVectorized>
__global__ void __launch_bounds__(kGemvThreads, kGemvMinBlocksPerSm)
    MatMulGemvKernel(const __grid_constant__ MatMulParams p) {
  using Vec = GemvVector<WeightT, kVectorized>;
  constexpr int kElems = Vec::kElems;
  constexpr int kStep = kWarpSize * kElems;  // columns a warp covers per step
  constexpr int kChunk = GemvChunkCols(kM);
  constexpr int kStepsPerChunk = kChunk / kStep;
  static_assert(kChunk % kStep == 0 && kStepsPerChunk >= 1);
  __shared__ __align__(16) float xs[kM * kChunk];

  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const GemvMatrix mat = GemvMatrixOf(p, static_cast<int>(blockIdx.x));
  const int block_row0 = mat.block_row0;
  const int row0 = block_row0 + warp * kGemvRowsPerWarp;
  // Rows past n (last block only) re-read row n - 1 and are not stored: every warp must reach the
  // block's barriers.
  const WeightT* w_rows[kGemvRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kGemvRowsPerWarp; ++r) {
    w_rows[r] = static_cast<const WeightT*>(mat.w) + std::int64_t{min(row0 + r, mat.n - 1)} * p.k;
  }
  const float* scale_row = nullptr;
  if constexpr (std::is_same_v<WeightT, F8E4M3>) {
    const int scale_cols = (p.k + kWeightScaleBlock - 1) / kWeightScaleBlock;
    scale_row = mat.w_scale + std::int64_t{block_row0 / kWeightScaleBlock} * scale_cols;
  }

  // This block's columns: whole warp steps [col_begin, col_end), the split's share of k.
  const int total_steps = (p.k + kStep - 1) / kStep;
  const int steps_per_split = (total_steps + gridDim.y - 1) / gridDim.y;
  const int col_begin = min(p.k, static_cast<int>(blockIdx.y) * steps_per_split * kStep);
  const int col_end = min(p.k, col_begin + steps_per_split * kStep);

  float acc[kM][kGemvRowsPerWarp] = {};
  typename Vec::Raw cur[kGemvRowsPerWarp] = {};
  typename Vec::Raw next[kGemvRowsPerWarp] = {};
  int c = col_begin + lane * kElems;  // this lane's column at the current step
  if (c < col_end) {
#pragma unroll
    for (int r = 0; r < kGemvRowsPerWarp; ++r) cur[r] = Vec::Load(w_rows[r] + c);
  }
  // Launched as a programmatic dependent (matmul.cu): the weights above are constants, but x
  // may still be being written, and y read, by the kernel before this one.
  WaitForPrerequisiteGrid();
  // A grid resident at once lets the next kernel launch now (MatMulParams::early_dependents): it
  // still waits for this whole GEMV, and its launch still implies this GEMV's prerequisite is done.
  if (p.early_dependents) LetDependentsLaunch();
  const int steps = (col_end - col_begin + kStep - 1) / kStep;
  for (int s = 0; s < steps; ++s) {
    const int c_next = c + kStep;
    if (c_next < col_end) {
#pragma unroll
      for (int r = 0; r < kGemvRowsPerWarp; ++r) next[r] = Vec::Load(w_rows[r] + c_next);
    }
    const int chunk = s / kStepsPerChunk;
    const int c0 = col_begin + chunk * kChunk;
    if (s == chunk * kStepsPerChunk) {  // first step of a chunk: stage its x
      __syncthreads();  // every warp is done with the previous chunk
      GemvStageX<kM, kVectorized, kElems>(p, c0, min(kChunk, col_end - c0), scale_row, xs);
      __syncthreads();
    }
    if (c < col_end) GemvAccumulate<WeightT, kM, kVectorized>(cur, xs, c - c0, acc);
#pragma unroll
    for (int r = 0; r < kGemvRowsPerWarp; ++r) cur[r] = next[r];
    c = c_next;
  }
  LetDependentsLaunch();  // only the sums are left: the next kernel may start its own preamble

  if (gridDim.y == 1) {
#pragma unroll
    for (int mi = 0; mi < kM; ++mi) {
#pragma unroll
      for (int r = 0; r < kGemvRowsPerWarp; ++r) {
        const float sum = WarpSum(acc[mi][r]);  // every lane holds the total
        // One lane per output, spread over the warp, stores it.
        if (lane == (mi * kGemvRowsPerWarp + r) % kWarpSize && row0 + r < mat.n) {
          mat.y[std::int64_t{mi} * mat.n + row0 + r] = sum;
        }
      }
    }
    return;
  }

  // Split k: the partial sums of this block's rows, then the cluster's first block adds them.
  __shared__ float partial[kM * kGemvRowsPerBlock];
#pragma unroll
  for (int mi = 0; mi < kM; ++mi) {
#pragma unroll
    for (int r = 0; r < kGemvRowsPerWarp; ++r) {
      const float sum = WarpSum(acc[mi][r]);
      if (lane == (mi * kGemvRowsPerWarp + r) % kWarpSize) {
        partial[mi * kGemvRowsPerBlock + warp * kGemvRowsPerWarp + r] = sum;
      }
    }
  }
  GemvClusterSum<kM>(partial, mat);
}

}  // namespace nq::kernels::cuda
