// Long prefills of the NestQuant routed-expert block (kernels/nq_moe.h) through cuBLAS: each
// expert that has tokens is dequantised once (at 2 or 4 bits, as the slot table says, read on
// the device) into an fp16 scratch matrix, and its tokens run through two cuBLAS GEMMs
// (fp16 inputs, fp32 accumulation) around the SwiGLU. For thousands of tokens the dequantisation
// (one write and one read of the expert's fp16 weights) is small against the GEMMs, which
// cuBLAS runs near the tensor cores' peak; the grouped mma.sync path (nq_moe_prefill.cuh) stays
// for shorter prefills, where rewriting every touched expert in fp16 would dominate.
//
// Per call: rotate the input, group the assignments by expert, copy the group sizes to the host
// (one stream synchronisation: cuBLAS takes its GEMM shapes from the host, so this path is not
// capturable in a CUDA graph; decode steps never take it), then per expert with tokens: gather
// its tokens' rows (fp16), dequantise (on a side stream, one expert ahead), GEMM gate/up, SwiGLU
// with its rotations (fp16 out), GEMM down, and add the weighted rows into the tokens' fp32
// accumulators, one expert after another (deterministic). Finally the output rotation.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/dense_prefill.cuh"
#include "kernels/nq_moe_params.h"

namespace nq::kernels::cuda {

// Tokens per call: bounds the workspace (per-expert rows of up to this many tokens).
inline constexpr std::int64_t kNqDensePrefillChunk = 4096;

// Workspace bytes for one chunk.
std::size_t NqMoeDensePrefillWorkspaceBytes(std::int64_t top_k, std::int64_t hidden, std::int64_t intermediate,
                                            std::int64_t num_experts);

// Whether the backend sends p here: enough tokens per expert for the GEMMs to outweigh
// rewriting each touched expert in fp16 (bench/README.md: at about 140 rows per expert the two
// paths cost the same at DeepSeek-V3 shapes; GLM-5 at 4096 tokens, 143 rows, runs 2x faster here).
bool NqMoeDensePrefillPays(const NqMoeParams& p);

// Contract as LaunchNqMoe (nq_moe.cuh), tokens <= kNqDensePrefillChunk (callers chunk).
// Synchronises ctx.stream once (above). InvalidArgumentError on a workspace or host buffer too
// small or a missing resource.
absl::Status LaunchNqMoeDensePrefill(const NqMoeParams& p, void* workspace, std::size_t workspace_bytes,
                                     const DensePrefillResources& r, const LaunchContext& ctx);

}  // namespace nq::kernels::cuda
