// Long prefills of the NVFP4 routed-expert block (kernels/nvfp4_moe.h) through cuBLAS, as the
// NestQuant block does it (nq_moe_prefill_dense.cuh, dense_prefill.cuh): each expert that has
// tokens is dequantised once into fp16 and its tokens run through two GEMMs around the SwiGLU.
//
// Why: the decode path (nvfp4_moe.cuh) runs 8 tokens a chunk and reads every expert a chunk
// touches once per chunk, so a 4096-token prompt on GLM-5's 256 experts reads each layer's
// experts about 512 times over. Here each is read once, written once in fp16 and read once by
// the GEMM, whose tensor cores then see hundreds of rows.
//
// The fp16 weights are E2M1 x E4M3 products, exact in fp16 (at most 6 significant bits, 2^-10 to
// 2688); the expert's fp32 global scale is applied to the GEMMs' fp32 outputs (gate/up in the
// SwiGLU, down in the weighted scatter), as the GEMV applies it to its sums.
//
// Per call: group the assignments by expert, copy the group sizes to the host (one stream
// synchronisation: cuBLAS takes its GEMM shapes from the host, so this path is not capturable;
// decode steps never take it), zero the output, then per expert with tokens: gather its tokens'
// rows (fp16), dequantise (on a side stream, one expert ahead), GEMM gate/up, SwiGLU (fp16 out),
// GEMM down, and add the weighted rows into the output, one expert after another
// (deterministic). Ids outside [0, E) contribute nothing.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/dense_prefill.cuh"
#include "kernels/nvfp4_moe_params.h"

namespace nq::kernels::cuda {

// Tokens per call: bounds the workspace (per-expert rows of up to this many tokens).
inline constexpr std::int64_t kNvfp4DensePrefillChunk = 4096;

// Workspace bytes for a call of `tokens` tokens (at most a chunk's: one workspace serves every
// chunk of a longer input).
std::size_t Nvfp4MoeDensePrefillWorkspaceBytes(std::int64_t tokens, std::int64_t top_k, std::int64_t hidden,
                                               std::int64_t intermediate, std::int64_t num_experts);

// Whether the backend sends p here rather than through the decode chunks: enough rows per
// expert that reading, rewriting and re-reading each touched expert once (about 4.6 bytes a
// weight) costs less than reading it (0.56 bytes a weight) once per 8-token chunk.
bool Nvfp4MoeDensePrefillPays(const Nvfp4MoeParams& p);

// Contract as LaunchNvfp4Moe (nvfp4_moe.cuh), tokens <= kNvfp4DensePrefillChunk (callers
// chunk), hidden and intermediate multiples of 16, at most 4096 experts. Synchronises ctx.stream
// once (above). InvalidArgumentError on a workspace or host buffer too small or a missing
// resource.
absl::Status LaunchNvfp4MoeDensePrefill(const Nvfp4MoeParams& p, void* workspace, std::size_t workspace_bytes,
                                        const DensePrefillResources& r, const LaunchContext& ctx);

}  // namespace nq::kernels::cuda
