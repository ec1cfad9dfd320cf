// MatMul, the linear layer: y[m, n] = x[m, k] · w[n, k]^T, fp32 activations and accumulation,
// weights F32 / BF16 / F16, or FP8 E4M3 with 128 x 128 block scales, widened (and scaled) to fp32
// as they are loaded.
//
// Two kernels, chosen per call by LaunchMatMul:
//  - for m <= kGemvMaxRows (decode, MTP verification), a GEMV: x staged in shared memory, each
//    warp streaming weight rows; memory-bound, so it aims at bandwidth. BF16 matrices of whole
//    16-byte rows with enough rows to fill the SMs run on the tensor cores (MatMulGemvMmaKernel,
//    matmul_gemv_mma.cuh: x split into bf16 hi + lo), every other matrix through fp32 FMAs
//    (MatMulGemvKernel, matmul_gemv.cuh).
//  - MatMulTiledKernel otherwise (prefill): a classic shared-memory SIMT GEMM. A block computes a
//    kBlockM x kBlockN tile of y, staging kBlockK-wide slices of x and w in shared memory
//    (transposed, so the inner loop reads contiguous m and n); each thread owns a
//    kThreadM x kThreadN micro-tile of accumulators. The next slice is fetched from global memory
//    into registers while the current one is multiplied. No tensor cores: the result stays
//    plain fp32 (TF32 would cost ~3 decimal digits).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/load.cuh"
#include "kernels/cuda/matmul_gemv.cuh"
#include "kernels/cuda/matmul_params.h"
#include "kernels/cuda/reduce.cuh"
#include "kernels/dtype.h"

namespace nq::kernels::cuda {

// Contract: 0 <= m, n, k < 2^31 (Backend checks the int range); x, w, y (and w_scale for F8E4M3)
// allocations of at least the sizes in MatMulParams. Any alignment and any k work; 16-byte aligned
// rows (k a multiple of 4 for F32, of 8 for 16-bit, of 16 for FP8 weights) take the vectorised
// GEMV path. InvalidArgumentError for a bad dtype, FP8 weights without scales, or more than
// kMaxGridY * 128 rows; launch failures as CudaStatus. Enqueues only: no host sync, no
// allocation, so a CUDA graph can capture it.
absl::Status LaunchMatMul(const MatMulParams& params, const LaunchContext& ctx);

// Rows of x the GEMV kernel handles in one pass (one instantiation per m); larger m goes to the
// tiled kernel.
inline constexpr int kGemvMaxRows = 8;

// Tile policy of MatMulTiledKernel.
template <int kBlockM_, int kBlockN_, int kBlockK_, int kThreadM_, int kThreadN_,
          int kMinBlocksPerSm_>
struct GemmTile {
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kBlockK = kBlockK_;
  static constexpr int kThreadM = kThreadM_;
  static constexpr int kThreadN = kThreadN_;
  static constexpr int kMinBlocksPerSm = kMinBlocksPerSm_;
  static constexpr int kThreadsM = kBlockM / kThreadM;
  static constexpr int kThreadsN = kBlockN / kThreadN;
  static constexpr int kThreads = kThreadsM * kThreadsN;
  // Elements of the x and w slices each thread stages per k step.
  static constexpr int kLoadsX = kBlockM * kBlockK / kThreads;
  static constexpr int kLoadsW = kBlockN * kBlockK / kThreads;
  // Shared rows padded by one float4: keeps float4 reads aligned, spreads the transposing stores
  // over more banks.
  static constexpr int kPad = 4;

  static_assert(kThreadM % 4 == 0 && kThreadN % 4 == 0, "micro-tiles are read as float4");
  static_assert(kBlockM % kThreadM == 0 && kBlockN % kThreadN == 0);
  static_assert(kLoadsX * kThreads == kBlockM * kBlockK, "x slice must split evenly");
  static_assert(kLoadsW * kThreads == kBlockN * kBlockK, "w slice must split evenly");
  static_assert(kThreads % kWarpSize == 0 && kThreads <= 1024);
};

// 128 x 128 tiles, 8 x 8 per thread, 2 blocks per SM: large problems.
using GemmTileLarge = GemmTile<128, 128, 16, 8, 8, 2>;
// 64 x 64 tiles, 4 x 4 per thread: problems too small to fill the GPU with large tiles.
using GemmTileSmall = GemmTile<64, 64, 16, 4, 4, 4>;

template <typename Tile, typename WeightT>
__global__ void __launch_bounds__(Tile::kThreads, Tile::kMinBlocksPerSm)
    MatMulTiledKernel(const __grid_constant__ MatMulParams p) {
  constexpr int kBM = Tile::kBlockM;
  constexpr int kBN = Tile::kBlockN;
  constexpr int kBK = Tile::kBlockK;
  constexpr int kTM = Tile::kThreadM;
  constexpr int kTN = Tile::kThreadN;
  __shared__ __align__(16) float xs[kBK][kBM + Tile::kPad];  // x slice, transposed: [k][m]
  __shared__ __align__(16) float ws[kBK][kBN + Tile::kPad];  // w slice, transposed: [k][n]

  const int tid = threadIdx.x;
  const int tm = tid / Tile::kThreadsN;
  const int tn = tid % Tile::kThreadsN;
  const int m0 = blockIdx.y * kBM;
  const int n0 = blockIdx.x * kBN;
  const WeightT* w = static_cast<const WeightT*>(p.w);
  // FP8: the scale row of this thread's staged weight rows (one 128-row block per kRowStep row).
  const int scale_cols = (p.k + kWeightScaleBlock - 1) / kWeightScaleBlock;

  // Each thread stages one k column (tid % kBK) of rows tid / kBK + j * kRowStep: a warp reads
  // runs of kBK consecutive k, i.e. whole 32-byte sectors.
  constexpr int kRowStep = Tile::kThreads / kBK;
  static_assert(Tile::kThreads % kBK == 0);
  const int stage_col = tid % kBK;
  const int stage_row = tid / kBK;
  const float* x_src = p.x + std::int64_t{m0 + stage_row} * p.k + stage_col;
  const WeightT* w_src = w + std::int64_t{n0 + stage_row} * p.k + stage_col;
  const int x_rows_left = p.m - m0 - stage_row;  // rows j * kRowStep < this are in range
  const int w_rows_left = p.n - n0 - stage_row;
  const std::int64_t src_step = std::int64_t{kRowStep} * p.k;
  float x_stage[Tile::kLoadsX];
  float w_stage[Tile::kLoadsW];
  auto fetch = [&](int k0) {
    const bool col_ok = k0 + stage_col < p.k;
#pragma unroll
    for (int j = 0; j < Tile::kLoadsX; ++j) {
      x_stage[j] = (col_ok && j * kRowStep < x_rows_left) ? __ldg(x_src + j * src_step + k0) : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < Tile::kLoadsW; ++j) {
      w_stage[j] =
          (col_ok && j * kRowStep < w_rows_left) ? LoadFloat(w_src + j * src_step + k0) : 0.0f;
      if constexpr (std::is_same_v<WeightT, F8E4M3>) {
        // Dequantised per element as it is staged; the scales are a few KiB and stay in L1.
        if (col_ok && j * kRowStep < w_rows_left) {
          const int row = n0 + stage_row + j * kRowStep;
          w_stage[j] *= __ldg(p.w_scale + std::int64_t{row / kWeightScaleBlock} * scale_cols +
                              (k0 + stage_col) / kWeightScaleBlock);
        }
      }
    }
  };
  auto stage = [&]() {
#pragma unroll
    for (int j = 0; j < Tile::kLoadsX; ++j) xs[stage_col][stage_row + j * kRowStep] = x_stage[j];
#pragma unroll
    for (int j = 0; j < Tile::kLoadsW; ++j) ws[stage_col][stage_row + j * kRowStep] = w_stage[j];
  };
  // A thread's micro-tile rows are kTM / 4 runs of 4, spaced 4 * kThreadsM apart (columns
  // likewise), so a warp's float4 reads of one shared row are contiguous and conflict-free.
  auto tile_row = [&](int i) { return (i / 4) * (4 * Tile::kThreadsM) + tm * 4 + i % 4; };
  auto tile_col = [&](int j) { return (j / 4) * (4 * Tile::kThreadsN) + tn * 4 + j % 4; };

  float acc[kTM][kTN] = {};
  fetch(0);
  for (int k0 = 0; k0 < p.k; k0 += kBK) {
    stage();
    __syncthreads();
    if (k0 + kBK < p.k) fetch(k0 + kBK);  // in flight while this slice is multiplied
#pragma unroll
    for (int kk = 0; kk < kBK; ++kk) {
      float a[kTM];
      float b[kTN];
#pragma unroll
      for (int i = 0; i < kTM; i += 4) {
        const float4 v = *reinterpret_cast<const float4*>(&xs[kk][tile_row(i)]);
        a[i] = v.x;
        a[i + 1] = v.y;
        a[i + 2] = v.z;
        a[i + 3] = v.w;
      }
#pragma unroll
      for (int j = 0; j < kTN; j += 4) {
        const float4 v = *reinterpret_cast<const float4*>(&ws[kk][tile_col(j)]);
        b[j] = v.x;
        b[j + 1] = v.y;
        b[j + 2] = v.z;
        b[j + 3] = v.w;
      }
#pragma unroll
      for (int i = 0; i < kTM; ++i) {
#pragma unroll
        for (int j = 0; j < kTN; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
      }
    }
    __syncthreads();  // the slice is consumed before the next stage() overwrites it
  }

#pragma unroll
  for (int i = 0; i < kTM; ++i) {
    const int row = m0 + tile_row(i);
    if (row >= p.m) continue;
#pragma unroll
    for (int j = 0; j < kTN; ++j) {
      const int col = n0 + tile_col(j);
      if (col < p.n) p.y[std::int64_t{row} * p.n + col] = acc[i][j];
    }
  }
}

}  // namespace nq::kernels::cuda
