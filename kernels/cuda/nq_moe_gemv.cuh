// The decode path's GEMV over packed routed experts (kernels/nq_moe.h, nq_moe.cuh): every
// distinct expert of a chunk of at most kNqMaxDecodeTokens tokens, 2 or 4 bits per expert as
// the slot table says, weights dequantised in registers straight into tensor-core fragments.
//
// Why tensor cores for a GEMV: an m16n8k16 MMA takes 256 weights in one instruction and
// accumulates in fp32, where CUDA-core half2 FMAs cost one instruction per two weights plus
// conversions. Dequantisation (prmt lookups) is then the only per-weight work, and up to eight
// tokens cost what one does (the MMA's n = 8 columns are the chunk's tokens).
// An even base grid, and uniform nested 4-bit levels, need no lookups at all (nq_code_lookup.cuh).
//
// Layout: lane 4g + j of a warp reads, per step, 16 bytes (4 code words) of row g and of row
// g + 8 of its 16-row tile, words [16 s + 4 j, 16 s + 4 j + 4). Word q of those decodes to the
// eight pairs that feed four MMAs (pairs p and p + 4 of rows g and g + 8 are its A fragment).
// The activation vector is stored so that the same lane finds that word's eight input pairs
// (its B fragments) in 32 contiguous bytes, the four lanes of a quad in 128 contiguous bytes:
// NqGemvInputIndex below, written by the preparation kernels, zero-padded to whole steps.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/nq_code_lookup.cuh"
#include "kernels/nq_moe_params.h"

namespace nq::kernels::cuda {

inline constexpr int kNqStepWords = 16;                          // words of a row per warp step
inline constexpr int kNqStepCodes = kNqStepWords * kCodesPerWord;  // 256 inputs per step

// Inputs per vector in the GEMV layout: cols rounded up to whole steps (the tail is zeros).
__host__ __device__ __forceinline__ int NqGemvPaddedCols(int cols) {
  return (cols + kNqStepCodes - 1) / kNqStepCodes * kNqStepCodes;
}

// Where input c of a vector goes: word w = c / 16 of step s = w / 16 is the q-th word of lane
// j's load (w % 16 = 4 j + q) and is stored as word 4 q + j of the step. Within it, the pairs
// of the word's pair order (PairSlot) are stored as 0 4 1 5 2 6 3 7: the MMA of pair position
// p < 4 takes pairs p and p + 4 as its B fragment, which then sit in two adjacent registers
// of the lane's 16-byte loads (no moves before the MMA).
__host__ __device__ __forceinline__ int NqGemvPairPosition(int pair) { return pair < 4 ? 2 * pair : 2 * (pair - 4) + 1; }
__host__ __device__ __forceinline__ int NqGemvInputIndex(int c) {
  const int w = c / kCodesPerWord, in_step = w % kNqStepWords;
  const int stored = (w - in_step) + (in_step % 4) * 4 + in_step / 4;
  const int slot = PairSlot(c % kCodesPerWord);
  return stored * kCodesPerWord + 2 * NqGemvPairPosition(slot / 2) + slot % 2;
}

// trellis_v1 (kernels/cuda/trellis_tile.cuh): a step is 16 tiles (16 rows x 16 columns each) of
// one tile row, and one tile is one MMA whose K is the tile's 16 columns in natural order. Lane
// 4 g + j's B fragment of tile k is inputs (2j, 2j+1) and (2j+8, 2j+9) of the tile's columns: the
// layout puts a quad lane's 16 tiles of a step in 128 contiguous bytes, [j][tile][b0 | b1].
__host__ __device__ __forceinline__ int NqGemvTrellisInputIndex(int c) {
  const int tile = c / 16, in_tile = c % 16;
  const int step = tile / kNqStepWords, k = tile % kNqStepWords;
  const int j = (in_tile % 8) / 2, which = in_tile / 8, half = in_tile % 2;
  return (((step * 4 + j) * kNqStepWords + k) * 2 + which) * 2 + half;
}

// Input vectors per (assignment, projection), two for either codec. trellis_v1: one per plane (the
// base's and the residual's per-column-block gains differ, and are folded into the inputs).
// nested_scalar_v1: the inputs, then the same times 4^-j for the even-grid decode of 2-bit
// experts whose base levels are an even grid (nq_code_lookup.cuh), at the same indices.
__host__ __device__ __forceinline__ int NqGemvInputPlanes(NqCodec) { return 2; }

// The factor the even-grid plane stores input c with: 4^-j of the pair its code lands in.
__host__ __device__ __forceinline__ float NqGemvEvenGridInputScale(int c) {
  const int j = EvenGridShift(c % kCodesPerWord % kPairsPerWord);
  return 1.0f / static_cast<float>(1 << (2 * j));
}

struct NqGemvParams {
  NqMoeParams p;
  NqProjectionView proj[2];  // gate, up (num_proj 2) or down (num_proj 1)
  int num_proj = 1;
  int rows = 0;  // rows of each projection
  int cols = 0;
  // For assignment a, projection j and input plane q (NqGemvInputPlanes): the input times expert
  // e's column scales (trellis: times plane q's gain of the column block / 147.8005), fp16, at
  // xh[((a * num_proj + j) * planes + q) * NqGemvPaddedCols(cols) + index(c)], padding zero;
  // index is NqGemvInputIndex, or NqGemvTrellisInputIndex for trellis_v1.
  const __half* xh = nullptr;
  // nested_scalar_v1: partial sums of each even-grid input vector, each input counted at the
  // value the MMA sees times 4^j (the exact input the code multiplies):
  // xsum[(a * num_proj + j) * xsum_parts + i], summed over i by the GEMV.
  const float* xsum = nullptr;
  int xsum_parts = 0;
  float* out = nullptr;  // out[a * out_stride + proj * rows + row]
  std::int64_t out_stride = 0;
};

// One launch computes every row of every projection of every distinct expert of the chunk
// (p.tokens <= kNqMaxDecodeTokens). Stream-ordered, no allocation, capturable.
absl::Status LaunchNqGemv(const NqGemvParams& g, const LaunchContext& ctx);

}  // namespace nq::kernels::cuda
