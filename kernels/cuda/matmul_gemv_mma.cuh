// MatMulGemvMmaKernel: the decode GEMV (1 to kGemvMaxRows tokens) for BF16 weights on the tensor
// cores, y[m, n] = x[m, k] · w[n, k]^T with fp32 x and fp32 accumulation.
//
// Why: the fp32-FMA GEMV (matmul_gemv.cuh) spends m FMAs a weight, so an MTP verification step
// (4 tokens) fell to 0.52 of copy bandwidth where one token reaches 0.88 (bench/README.md, "Dense
// GEMV"). Here a weight costs no instruction of its own: the BF16 weights are mma.sync's A
// operand exactly as loaded, the tokens its columns.
//  - x is split into bf16 hi + lo (x - hi, rounded again): two MMAs (hi, lo) per 16 x 16 piece of
//    w give each product to about 2^-17 of |x|, where bf16 x alone would lose 3 decimal digits.
//    The split is staged in shared memory once per block, as the FMA kernel stages x.
//  - A block owns kGemvRowsPerBlock (32) rows, as the FMA kernel's blocks do (so GemvMatrixOf,
//    MatMulSharedInput and the split-k clusters are shared): two 16-row tiles, each streamed by
//    four warps that take every fourth 128-column step of the block's columns (a round of 512).
//  - The sum over k is permuted freely (it is a sum): lane (g, q) loads 8 consecutive weights of
//    rows g and g + 8 at columns 8q + 32i of the step, and the same columns of staged x form its
//    B fragment, so weights go from one 16-byte load straight into two MMAs' A fragments.
//  - Batch invariance (MTP verification must equal plain decoding): token t is always column t of
//    both MMAs, the k order depends on the matrix only, and the four warps' sums of a tile are
//    added in one fixed order, so a token's outputs are bit-identical for any m. Which kernel a
//    matrix takes depends on the matrix and the device alone (MmaGemvPays).
//  - FP8 weights stay on the FMA kernel: the same structure with E4M3 converted to f16 (x as f16
//    hi + lo, a power of two per token and step) was correct and slower at every shape and token
//    count up to 4 on an H100 (bench/README.md; branch exp/gemv-mma-fp8).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/launch_dependent.cuh"
#include "kernels/cuda/load.cuh"
#include "kernels/cuda/matmul_gemv.cuh"
#include "kernels/cuda/matmul_params.h"
#include "kernels/dtype.h"

namespace nq::kernels::cuda {

inline constexpr int kMmaGemvTileRows = 16;  // mma.sync m16n8k16's M
inline constexpr int kMmaGemvTiles = kGemvRowsPerBlock / kMmaGemvTileRows;
inline constexpr int kMmaGemvGroups = kGemvWarps / kMmaGemvTiles;  // warps splitting a tile's k
inline constexpr int kMmaGemvStepCols = 128;                      // one warp step: 16 rows x 128
inline constexpr int kMmaGemvRoundCols = kMmaGemvGroups * kMmaGemvStepCols;
inline constexpr int kMmaGemvLoads = kMmaGemvStepCols / 32;  // 16-byte loads per row and lane a step
// Staged rows are padded by 64 bytes: a lane reads 16 bytes at 16q of its row (64 contiguous bytes
// a row), so rows 64 bytes apart modulo 128 put the two rows a quarter warp reads on disjoint banks.
inline constexpr int kMmaGemvPad = 32;

// Columns of x staged at once: about 32 KiB of bf16 hi + lo for m tokens, whole rounds.
__host__ __device__ constexpr int MmaGemvChunkCols(int m) {
  return 8192 / m / kMmaGemvRoundCols * kMmaGemvRoundCols > kMmaGemvRoundCols
             ? 8192 / m / kMmaGemvRoundCols * kMmaGemvRoundCols
             : kMmaGemvRoundCols;
}

static_assert(kGemvRowsPerBlock % kMmaGemvTileRows == 0 && kGemvWarps % kMmaGemvTiles == 0);

// A matrix the tensor-core GEMV reads: BF16 rows of whole 16-byte vectors, 16-byte aligned.
inline bool MmaGemvReads(const MatMulParams& p) {
  if (p.w_dtype != DType::kBF16 || p.k % 8 != 0 || reinterpret_cast<std::uintptr_t>(p.w) % 16 != 0) return false;
  for (int e = 0; e < p.num_extra; ++e) {
    if (reinterpret_cast<std::uintptr_t>(p.extra[e].w) % 16 != 0) return false;
  }
  return true;
}


__device__ __forceinline__ void MmaBf16(float (&d)[4], std::uint32_t a0, std::uint32_t a1, std::uint32_t a2,
                                        std::uint32_t a3, std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ std::uint32_t Bf16x2Bits(__nv_bfloat162 v) { return *reinterpret_cast<std::uint32_t*>(&v); }

// (a, b) as bf16 hi and lo words: hi = bf16(a, b), lo = bf16 of what hi leaves out.
__device__ __forceinline__ void SplitBf16(float a, float b, std::uint32_t& hi, std::uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  hi = Bf16x2Bits(h);
  lo = Bf16x2Bits(__floats2bfloat162_rn(a - __low2float(h), b - __high2float(h)));
}

// xs rows t (hi) and kM + t (lo) = x[t, c0 + cc] for cc < cols, zeros up to the end of the last
// 128-column step (a step that runs past k multiplies zero weights by them, so they must be
// finite; steps past it are not run), by all threads.
template <int kM>
__device__ __forceinline__ void MmaGemvStageX(const MatMulParams& p, int c0, int cols, std::uint16_t* xs) {
  constexpr int kStride = MmaGemvChunkCols(kM) + kMmaGemvPad;
  const bool aligned = reinterpret_cast<std::uintptr_t>(p.x) % 16 == 0;  // k % 8 == 0: every row is then
  const int quads = (cols + kMmaGemvStepCols - 1) / kMmaGemvStepCols * (kMmaGemvStepCols / 4);  // per token
  for (int i = threadIdx.x; i < kM * quads; i += kGemvThreads) {
    const int t = i / quads, cc = i % quads * 4;
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (cc < cols) {  // cols % 4 == 0
      const float* src = p.x + std::int64_t{t} * p.k + c0 + cc;
      v = aligned ? __ldg(reinterpret_cast<const float4*>(src))
                  : make_float4(__ldg(src), __ldg(src + 1), __ldg(src + 2), __ldg(src + 3));
    }
    uint2 hi, lo;
    SplitBf16(v.x, v.y, hi.x, lo.x);
    SplitBf16(v.z, v.w, hi.y, lo.y);
    *reinterpret_cast<uint2*>(xs + t * kStride + cc) = hi;
    *reinterpret_cast<uint2*>(xs + (kM + t) * kStride + cc) = lo;
  }
}

// A lane's weights of one warp step: rows g ([0, kMmaGemvLoads)) and g + 8 (the rest), 8 columns
// each at col + 32 i; zeros past col_end (k is a multiple of 8, so a load is wholly in or out).
__device__ __forceinline__ void MmaGemvLoadStep(uint4 (&w)[2 * kMmaGemvLoads], const Bf16* row_g, const Bf16* row_g8,
                                                int col, int col_end) {
#pragma unroll
  for (int i = 0; i < kMmaGemvLoads; ++i) {
    const int c = col + 32 * i;
    const bool in = c < col_end;
    w[i] = in ? LoadStreaming(row_g + c) : make_uint4(0, 0, 0, 0);
    w[kMmaGemvLoads + i] = in ? LoadStreaming(row_g8 + c) : make_uint4(0, 0, 0, 0);
  }
}

// kM: rows of x (p.m == kM). The launcher checked MmaGemvReads(p).
template <int kM>
__global__ void __launch_bounds__(kGemvThreads, kGemvMinBlocksPerSm)
    MatMulGemvMmaKernel(const __grid_constant__ MatMulParams p) {
  constexpr int kChunk = MmaGemvChunkCols(kM);
  constexpr int kStride = kChunk + kMmaGemvPad;
  constexpr int kRoundsPerChunk = kChunk / kMmaGemvRoundCols;
  __shared__ __align__(16) std::uint16_t xs[2 * kM * kStride];
  __shared__ float sums[kMmaGemvGroups][kGemvRowsPerBlock][kM];

  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int tile = warp % kMmaGemvTiles, group = warp / kMmaGemvTiles;
  const int g = lane / 4, q = lane % 4;
  const GemvMatrix mat = GemvMatrixOf(p, static_cast<int>(blockIdx.x));
  const int tile_row0 = mat.block_row0 + tile * kMmaGemvTileRows;
  // Rows past n (last block only) re-read row n - 1 and are not stored.
  const Bf16* w = static_cast<const Bf16*>(mat.w);
  const Bf16* row_g = w + std::int64_t{min(tile_row0 + g, mat.n - 1)} * p.k;
  const Bf16* row_g8 = w + std::int64_t{min(tile_row0 + g + 8, mat.n - 1)} * p.k;

  // This block's columns: whole 128-column steps [col_begin, col_end), the split's share of k.
  const int total_steps = (p.k + kMmaGemvStepCols - 1) / kMmaGemvStepCols;
  const int steps_per_split = (total_steps + gridDim.y - 1) / gridDim.y;
  const int col_begin = min(p.k, static_cast<int>(blockIdx.y) * steps_per_split * kMmaGemvStepCols);
  const int col_end = min(p.k, col_begin + steps_per_split * kMmaGemvStepCols);
  const int rounds = (col_end - col_begin + kMmaGemvRoundCols - 1) / kMmaGemvRoundCols;
  const int step_col = group * kMmaGemvStepCols;  // the warp's step within a round
  const int lane_col = step_col + 8 * q;          // the lane's first column within a round

  uint4 cur[2 * kMmaGemvLoads], next[2 * kMmaGemvLoads];
  MmaGemvLoadStep(cur, row_g, row_g8, col_begin + lane_col, col_end);
  // Launched as a programmatic dependent (matmul.cu): the weights above are constants, but x
  // may still be being written, and y read, by the kernel before this one.
  WaitForPrerequisiteGrid();
  // A grid resident at once lets the next kernel launch now (MatMulParams::early_dependents): it
  // still waits for this whole GEMV, and its launch still implies this GEMV's prerequisite is done.
  if (p.early_dependents) LetDependentsLaunch();
  float hi[4] = {}, lo[4] = {};
  for (int r = 0; r < rounds; ++r) {
    const int round_col = col_begin + r * kMmaGemvRoundCols;
    if (r + 1 < rounds) MmaGemvLoadStep(next, row_g, row_g8, round_col + kMmaGemvRoundCols + lane_col, col_end);
    const int chunk = r / kRoundsPerChunk;
    const int c0 = col_begin + chunk * kChunk;
    if (r == chunk * kRoundsPerChunk) {  // first round of a chunk: stage its x
      __syncthreads();                   // every warp is done with the previous chunk
      MmaGemvStageX<kM>(p, c0, min(kChunk, col_end - c0), xs);
      __syncthreads();
    }
    if (round_col + step_col < col_end) {  // warp-uniform
      const int local = round_col + lane_col - c0;
#pragma unroll
      for (int i = 0; i < kMmaGemvLoads; ++i) {
        // Lanes of columns (tokens) past m multiply zeros; their outputs are never stored.
        uint4 bh = make_uint4(0, 0, 0, 0), bl = make_uint4(0, 0, 0, 0);
        if (g < kM) {
          bh = *reinterpret_cast<const uint4*>(xs + g * kStride + local + 32 * i);
          bl = *reinterpret_cast<const uint4*>(xs + (kM + g) * kStride + local + 32 * i);
        }
        const uint4& a = cur[i];
        const uint4& a8 = cur[kMmaGemvLoads + i];
        // Columns +0..3 of the 8 are one MMA's k slots (2q, 2q + 1, 2q + 8, 2q + 9), +4..7 the next's.
        MmaBf16(hi, a.x, a8.x, a.y, a8.y, bh.x, bh.y);
        MmaBf16(lo, a.x, a8.x, a.y, a8.y, bl.x, bl.y);
        MmaBf16(hi, a.z, a8.z, a.w, a8.w, bh.z, bh.w);
        MmaBf16(lo, a.z, a8.z, a.w, a8.w, bl.z, bl.w);
      }
    }
#pragma unroll
    for (int i = 0; i < 2 * kMmaGemvLoads; ++i) cur[i] = next[i];
  }
  LetDependentsLaunch();  // only the sums are left: the next kernel may start its own preamble

  // The accumulators hold rows g (0, 1) and g + 8 (2, 3) of tokens 2q and 2q + 1.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int t = 2 * q + j;
      if (t < kM) sums[group][tile * kMmaGemvTileRows + g + 8 * h][t] = hi[2 * h + j] + lo[2 * h + j];
    }
  }
  __syncthreads();
  // The block's sum of each (row, token), the groups in one order; then y, or with split k the
  // cluster's first block adds the blocks' sums in rank order (as matmul_gemv.cuh).
  __shared__ float partial[kM * kGemvRowsPerBlock];
  for (int i = threadIdx.x; i < kM * kGemvRowsPerBlock; i += kGemvThreads) {
    const int t = i / kGemvRowsPerBlock, row = i % kGemvRowsPerBlock;
    float sum = sums[0][row][t];
#pragma unroll
    for (int s = 1; s < kMmaGemvGroups; ++s) sum += sums[s][row][t];
    if (gridDim.y == 1) {
      if (mat.block_row0 + row < mat.n) mat.y[std::int64_t{t} * mat.n + mat.block_row0 + row] = sum;
    } else {
      partial[i] = sum;
    }
  }
  if (gridDim.y > 1) GemvClusterSum<kM>(partial, mat);
}

}  // namespace nq::kernels::cuda
