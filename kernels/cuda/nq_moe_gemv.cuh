// The decode path's GEMV over packed routed experts (kernels/nq_moe.h, nq_moe.cuh): every
// distinct expert of a chunk of at most kNqMaxDecodeTokens tokens, 2 or 4 bits per expert as
// the slot table says, weights dequantised in registers straight into tensor-core fragments.
//
// Why tensor cores for a GEMV: an m16n8k16 MMA takes 256 weights in one instruction and
// accumulates in fp32, where CUDA-core half2 FMAs cost one instruction per two weights plus
// conversions. Dequantisation (prmt lookups) is then the only per-weight work, and up to eight
// tokens cost what one does (the MMA's n = 8 columns are the chunk's tokens).
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
// j's load (w % 16 = 4 j + q) and is stored as word 4 q + j of the step, its codes in pair order.
__host__ __device__ __forceinline__ int NqGemvInputIndex(int c) {
  const int w = c / kCodesPerWord, in_step = w % kNqStepWords;
  const int stored = (w - in_step) + (in_step % 4) * 4 + in_step / 4;
  return stored * kCodesPerWord + PairSlot(c % kCodesPerWord);
}

struct NqGemvParams {
  NqMoeParams p;
  NqProjectionView proj[2];  // gate, up (num_proj 2) or down (num_proj 1)
  int num_proj = 1;
  int rows = 0;  // rows of each projection
  int cols = 0;
  // For assignment a and projection j: the input times expert e's column scales, fp16, at
  // xh[(a * num_proj + j) * NqGemvPaddedCols(cols) + NqGemvInputIndex(c)], padding zero.
  const __half* xh = nullptr;
  float* out = nullptr;  // out[a * out_stride + proj * rows + row]
  std::int64_t out_stride = 0;
};

// One launch computes every row of every projection of every distinct expert of the chunk
// (p.tokens <= kNqMaxDecodeTokens). Stream-ordered, no allocation, capturable.
absl::Status LaunchNqGemv(const NqGemvParams& g, const LaunchContext& ctx);

}  // namespace nq::kernels::cuda
