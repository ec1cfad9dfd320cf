// The NVFP4 routed-expert block on the GPU (contract and math: kernels/nvfp4_moe.h).
//
// Five stream-ordered launches per chunk of at most kNvfp4MaxDecodeTokens tokens, no host
// synchronisation and no allocation (the caller passes the workspace), so a decode step
// captures it in a CUDA graph:
//   1. Nvfp4PrepKernel     x as fp16 GEMV inputs; the gate/up outputs zeroed
//   2. Nvfp4GemvKernel     gate/up rows of every distinct expert (nvfp4_gemv.cuh)
//   3. Nvfp4SwigluKernel   silu(g) * u as fp16 down inputs; the down outputs zeroed
//   4. Nvfp4GemvKernel     down rows
//   5. Nvfp4CombineKernel  out[t] = sum_k w_k y_k, in k order
// Kernels 2-5 are programmatic dependents of the kernel before (launch_dependent.cuh).
// Contract on values: x and silu(g) * u stay inside fp16's range (|v| < 65504), as RMS-normed
// hidden states and expert activations do.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/nvfp4_moe_params.h"

namespace nq::kernels::cuda {

// Tokens of one decode chunk: the GEMV MMA's 8 columns. A decode step (1 token) and an MTP
// verification (1 + 3 drafts) are one chunk; longer inputs run chunk by chunk.
inline constexpr std::int64_t kNvfp4MaxDecodeTokens = 8;
// Assignments (tokens x top_k) of one chunk, top_k up to 16.
inline constexpr int kNvfp4MaxAssignments = 128;
// Columns of a row one GEMV lane reads per step (16 bytes of codes): rows must be whole chunks.
inline constexpr int kNvfp4LaneCols = 32;

// Workspace bytes LaunchNvfp4Moe needs for top_k assignments per token.
std::size_t Nvfp4MoeWorkspaceBytes(std::int64_t top_k, std::int64_t hidden, std::int64_t intermediate);

// Contract: p validated by Backend::Nvfp4Moe; hidden and intermediate multiples of 32 (a lane's
// 16 code bytes); top_k at most 16; workspace of Nvfp4MoeWorkspaceBytes, 16-byte aligned.
// InvalidArgumentError otherwise. Expert ids outside [0, E) contribute nothing.
absl::Status LaunchNvfp4Moe(const Nvfp4MoeParams& p, void* workspace, std::size_t workspace_bytes,
                            const LaunchContext& ctx);

}  // namespace nq::kernels::cuda
