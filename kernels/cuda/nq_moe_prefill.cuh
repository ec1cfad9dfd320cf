// The NestQuant routed-expert block for many tokens (prefill; contract: kernels/nq_moe.h), on
// tensor cores. Per chunk of at most kNqPrefillChunk tokens, stream-ordered, no host
// synchronisation (the token groups are built on the device):
//   1. rotate every token's input (as the decode path does)
//   2. NqGroupKernel        assignments grouped by expert (counting sort in one block)
//   3. NqGroupGemmKernel    gate/up: for each expert, its tokens x its rows, bf16 mma.sync with the
//                           expert's codes dequantised into shared memory tile by tile
//   4. SwiGLU and the down projection's rotation per assignment
//   5. NqGroupGemmKernel    down rows
//   6. weighted combine and output rotation per token
// Weights are dequantised once per (expert, 64-token tile) into fp16 levels (row scales applied
// in the epilogue); inputs are rounded to fp16 with the expert's column scales folded in (fp16's
// 11-bit significand keeps the block within 2e-3 of the CPU; bf16 did not); products accumulate
// in fp32. trellis_v1 layers decode tile rows into the exact integers S - 510
// (trellis_tile.cuh), fold each column block's gain into the inputs and 1/147.8005 into the
// epilogue; a 4-bit expert's residual is a second MMA plane.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/nq_moe_params.h"

namespace nq::kernels::cuda {

// From this many tokens on, the CUDA backend takes this path rather than the decode GEMV.
inline constexpr std::int64_t kNqPrefillMinTokens = 16;

// Tokens per prefill chunk: bounds the workspace (intermediates of chunk x top_k assignments).
inline constexpr std::int64_t kNqPrefillChunk = 512;

// Workspace bytes LaunchNqMoePrefill needs.
std::size_t NqMoePrefillWorkspaceBytes(std::int64_t top_k, std::int64_t hidden, std::int64_t intermediate,
                                       std::int64_t num_experts);

// Whether this path takes p's shapes (hidden and intermediate multiples of a 64-row tile).
bool NqMoePrefillSupports(const NqMoeParams& p);

// The most experts LaunchNqGroupByExpert sorts (its one block's shared counters).
inline constexpr int kNqMaxGroupExperts = 4096;

// Counting sort of `assignments` expert ids by expert: counts[e], offsets[e] (exclusive prefix
// sum) and order (assignment indices grouped by expert, any order inside a group); ids outside
// [0, num_experts) are left out. One block; num_experts up to kNqMaxGroupExperts.
absl::Status LaunchNqGroupByExpert(const std::int32_t* ids, int assignments, int num_experts, int* counts,
                                   int* offsets, int* order, const LaunchContext& ctx);

// Contract as LaunchNqMoe (nq_moe.cuh), plus hidden and intermediate multiples of 64 (a GEMM
// tile). InvalidArgumentError otherwise.
absl::Status LaunchNqMoePrefill(const NqMoeParams& p, void* workspace, std::size_t workspace_bytes,
                                const LaunchContext& ctx);

}  // namespace nq::kernels::cuda
