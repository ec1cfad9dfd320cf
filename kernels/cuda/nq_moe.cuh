// The NestQuant routed-expert block on the GPU (contract and math: kernels/nq_moe.h).
//
// Five stream-ordered launches per chunk of at most kNqMaxDecodeTokens tokens, no host
// synchronisation and no allocation (the caller passes the workspace), so a decode step
// captures it in a CUDA graph:
//   1. NqRotatePrepKernel    R_in x, times each assignment's column scales, as fp16 GEMV inputs
//                                                   blocks: (token, Hadamard block, assignment)
//   2. NqGemvKernel          gate/up rows of every distinct expert  blocks: (assignment, 32 rows)
//   3. NqSwigluPrepKernel    R_dc (silu(R_g^T g) * R_g^T u), the down GEMV's inputs
//                                                       blocks: (assignment, Hadamard block)
//   4. NqGemvKernel          down rows                             blocks: (assignment, 64 rows)
//   5. NqCombineKernel       out = R_dr^T sum_k w_k y_k  blocks: (token, Hadamard block)
// The GEMV block of the first assignment naming an expert serves every token of the chunk that
// routes to it (its weights are read once); later assignments of the same expert exit at once.
// Each block reads the layer's slot table on the device and runs its expert at 4 bits when the
// expert's residual sits in a slot, at 2 bits otherwise. The GEMV (nq_moe_gemv.cuh) dequantises
// code words in registers (prmt lookups in fp16 level tables, nq_code_lookup.cuh) straight into
// m16n8k16 tensor-core fragments, the chunk's tokens as the MMA's columns, fp32 accumulation.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/nq_moe_params.h"

namespace nq::kernels::cuda {

// A decode step (1 token) or an MTP verification (1 + 3 drafts) runs as one chunk; longer
// inputs run chunk by chunk.
inline constexpr std::int64_t kNqMaxDecodeTokens = 4;
// Assignments (tokens x top_k) of one decode chunk: top_k up to 16.
inline constexpr int kNqMaxDecodeAssignments = 64;

// Workspace bytes LaunchNqMoe needs for top_k assignments per token.
std::size_t NqMoeWorkspaceBytes(std::int64_t top_k, std::int64_t hidden, std::int64_t intermediate);
// The part of it that holds the even-grid inputs' partial sums (nq_moe_gemv.cuh, xsum).
std::int64_t NqMoeInputSumFloats(std::int64_t top_k, std::int64_t hidden, std::int64_t intermediate);

// Contract: p validated by Backend::NqMoe; hidden and intermediate multiples of 16 (a code word)
// and at most kNqMaxVectorWidth (shared-memory vectors); workspace of NqMoeWorkspaceBytes, 16-byte
// aligned. InvalidArgumentError otherwise. Expert ids outside [0, E) contribute nothing.
absl::Status LaunchNqMoe(const NqMoeParams& p, void* workspace, std::size_t workspace_bytes,
                         const LaunchContext& ctx);

inline constexpr std::int64_t kNqMaxVectorWidth = 16384;

}  // namespace nq::kernels::cuda
