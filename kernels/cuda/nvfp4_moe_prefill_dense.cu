#include "kernels/cuda/nvfp4_moe_prefill_dense.cuh"

#include <cuda_fp16.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/nq_moe_prefill.cuh"
#include "kernels/cuda/nvfp4_moe.cuh"
#include "kernels/nvfp4_codes.h"
#include "services/common/status_macros.h"

namespace nq::kernels::cuda {
namespace {

constexpr int kThreads = 256;

struct Buffers {
  int* counts = nullptr;  // [E], then offsets [E]: copied to the host together
  int* offsets = nullptr;
  int* order = nullptr;  // [C * K]
  __half* xe = nullptr;  // [C, D] one expert's token rows
  float* he = nullptr;   // [C, 2I] its gate and up outputs, before the global scale
  __half* hh = nullptr;  // [C, I] SwiGLU
  float* ye = nullptr;   // [C, D] its down outputs, before the global scale
  __half* w_gu[2] = {};  // [2I, D] an expert's E2M1 x E4M3 gate/up weights (double buffer)
  __half* w_d[2] = {};   // [D, I] its down weights
};

// Carves the workspace for calls of up to C tokens (every piece 256-byte aligned); bytes needed
// when base is null. One expert may take every token, so its row buffers hold C rows.
std::size_t Carve(std::int64_t C, std::int64_t K, std::int64_t D, std::int64_t I, std::int64_t E, void* base,
                  Buffers* b) {
  WorkspaceCarver carver(base);
  Buffers scratch;
  Buffers& out = b != nullptr ? *b : scratch;
  carver.Take(out.counts, 2 * E);
  out.offsets = base != nullptr ? out.counts + E : nullptr;
  carver.Take(out.order, C * K);
  carver.Take(out.xe, C * D);
  carver.Take(out.he, C * 2 * I);
  carver.Take(out.hh, C * I);
  carver.Take(out.ye, C * D);
  for (int k = 0; k < 2; ++k) {
    carver.Take(out.w_gu[k], 2 * I * D);
    carver.Take(out.w_d[k], D * I);
  }
  return carver.Bytes();
}

// One thread per block of 16 weights of expert `expert`'s [rows, cols] matrix: out[row][16 b ..]
// = E2M1(code) * E4M3(scale), exact in fp16, written 32 bytes at a time.
__global__ void __launch_bounds__(kThreads) Nvfp4DequantKernel(const Nvfp4ProjectionView w, int expert, int rows,
                                                               int cols, __half* out) {
  const int blocks = cols / kNvfp4BlockSize;
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<std::int64_t>(rows) * blocks) return;
  const std::int64_t row = static_cast<std::int64_t>(expert) * rows + idx / blocks;  // of the stacked experts
  const int b = static_cast<int>(idx % blocks);
  const uint2 codes = *reinterpret_cast<const uint2*>(w.packed + row * (cols / 2) + b * (kNvfp4BlockSize / 2));
  const float scale = E4M3ToFloat(w.scales[row * blocks + b]);
  __align__(16) __half v[kNvfp4BlockSize];
#pragma unroll
  for (int j = 0; j < kNvfp4BlockSize / 2; ++j) {
    const std::uint32_t byte = ((j < 4 ? codes.x : codes.y) >> (8 * (j % 4))) & 0xFFu;
    // Element 2j in the low nibble, 2j + 1 in the high one (kernels/nvfp4_codes.h).
    v[2 * j] = __float2half_rn(E2M1ToFloat(static_cast<std::uint8_t>(byte & 15u)) * scale);
    v[2 * j + 1] = __float2half_rn(E2M1ToFloat(static_cast<std::uint8_t>(byte >> 4)) * scale);
  }
  uint4* dst = reinterpret_cast<uint4*>(out + (idx / blocks) * cols + b * kNvfp4BlockSize);
  dst[0] = reinterpret_cast<const uint4*>(v)[0];
  dst[1] = reinterpret_cast<const uint4*>(v)[1];
}

// grid (rows, ceil(I / threads)): hh[r] = fp16(silu(s g) * s u) for he[r] = [g | u] and the
// expert's gate/up global scale s (as the CPU reference: silu of the gate times the up).
__global__ void __launch_bounds__(kThreads) Nvfp4SwigluRowsKernel(const float* he, const float* global, int I,
                                                                  __half* hh) {
  const int r = blockIdx.x, i = blockIdx.y * blockDim.x + threadIdx.x;
  if (i >= I) return;
  const float s = *global;
  const float* h = he + static_cast<std::int64_t>(r) * 2 * I;
  const float g = s * h[i];
  hh[static_cast<std::int64_t>(r) * I + i] = __float2half_rn(g / (1.0f + expf(-g)) * (s * h[I + i]));
}

absl::Status Dequantise(const Nvfp4ProjectionView& w, int expert, int rows, int cols, __half* out,
                        const LaunchContext& ctx) {
  const std::int64_t threads = static_cast<std::int64_t>(rows) * cols / kNvfp4BlockSize;
  Nvfp4DequantKernel<<<static_cast<unsigned>(CeilDiv(threads, kThreads)), kThreads, 0, ctx.stream>>>(w, expert, rows,
                                                                                                      cols, out);
  return CheckLaunch("Nvfp4DequantKernel");
}

}  // namespace

std::size_t Nvfp4MoeDensePrefillWorkspaceBytes(std::int64_t tokens, std::int64_t top_k, std::int64_t hidden,
                                               std::int64_t intermediate, std::int64_t num_experts) {
  return Carve(std::min(tokens, kNvfp4DensePrefillChunk), top_k, hidden, intermediate, num_experts, nullptr, nullptr);
}

bool Nvfp4MoeDensePrefillPays(const Nvfp4MoeParams& p) {
  // Per 8-token chunk the decode path reads min(8 K, E) experts' 0.56 bytes a weight; here each
  // touched expert costs about 4.6 bytes a weight once. They meet near 9-18 rows per expert at
  // GLM-5's and DeepSeek-V3's expert counts; 16 leans toward the decode path.
  constexpr std::int64_t kMinRowsPerExpert = 16;
  return p.tokens > kNvfp4MaxDecodeTokens && p.tokens * p.top_k >= kMinRowsPerExpert * p.num_experts &&
         p.num_experts <= kNqMaxGroupExperts && p.hidden % kNvfp4BlockSize == 0 && p.intermediate % kNvfp4BlockSize == 0;
}

absl::Status LaunchNvfp4MoeDensePrefill(const Nvfp4MoeParams& p, void* workspace, std::size_t workspace_bytes,
                                        const DensePrefillResources& r, const LaunchContext& ctx) {
  const std::int64_t T = p.tokens, K = p.top_k, D = p.hidden, I = p.intermediate, E = p.num_experts;
  if (T > kNvfp4DensePrefillChunk) {
    return absl::InvalidArgumentError(
        absl::StrCat("Nvfp4Moe dense prefill: ", T, " tokens exceed the chunk of ", kNvfp4DensePrefillChunk));
  }
  if (D % kNvfp4BlockSize != 0 || I % kNvfp4BlockSize != 0 || E > kNqMaxGroupExperts) {
    return absl::InvalidArgumentError(absl::StrCat("Nvfp4Moe dense prefill: hidden ", D, " and intermediate ", I,
                                                   " must be multiples of ", kNvfp4BlockSize, ", experts (", E,
                                                   ") at most ", kNqMaxGroupExperts));
  }
  if (workspace_bytes < Nvfp4MoeDensePrefillWorkspaceBytes(T, K, D, I, E)) {
    return absl::InvalidArgumentError(absl::StrCat("Nvfp4Moe dense prefill: workspace of ", workspace_bytes,
                                                   " bytes, need ", Nvfp4MoeDensePrefillWorkspaceBytes(T, K, D, I, E)));
  }
  RETURN_IF_ERROR(CheckDensePrefillResources(r, E, "Nvfp4Moe dense prefill"));
  Buffers b;
  Carve(T, K, D, I, E, workspace, &b);
  RETURN_IF_ERROR(CublasStatus(cublasSetStream(r.blas, ctx.stream), "cublasSetStream"));
  const LaunchContext side{.stream = r.side, .num_sms = ctx.num_sms};

  NQ_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.out, 0, static_cast<std::size_t>(T * D) * sizeof(float), ctx.stream));
  RETURN_IF_ERROR(LaunchNqGroupByExpert(p.expert_ids, static_cast<int>(T * K), static_cast<int>(E), b.counts,
                                        b.offsets, b.order, ctx));
  // The group sizes are GEMM shapes: the one synchronisation of this path.
  NQ_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(r.host_counts, b.counts, 2 * E * sizeof(int), cudaMemcpyDeviceToHost,
                                          ctx.stream));
  NQ_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ctx.stream));
  const int* counts = r.host_counts;
  const int* offsets = r.host_counts + E;
  // The side stream starts after everything before this call (the weights' writers).
  NQ_CUDA_RETURN_IF_ERROR(cudaEventRecord(r.start, ctx.stream));
  NQ_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(r.side, r.start, 0));

  const int Di = static_cast<int>(D), Ii = static_cast<int>(I), Ki = static_cast<int>(K);
  int used = 0;  // experts with tokens so far: buffer used % 2
  for (int e = 0; e < E; ++e) {
    const int n = counts[e];
    if (n == 0) continue;
    const int buf = used++ % 2;
    // Side stream: this expert's weights into `buf` once the expert two back is done with it.
    if (used > 2) NQ_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(r.side, r.free[buf], 0));
    RETURN_IF_ERROR(Dequantise(p.gate_up, e, 2 * Ii, Di, b.w_gu[buf], side));
    RETURN_IF_ERROR(Dequantise(p.down, e, Di, Ii, b.w_d[buf], side));
    NQ_CUDA_RETURN_IF_ERROR(cudaEventRecord(r.ready[buf], r.side));

    const int* order = b.order + offsets[e];
    RETURN_IF_ERROR(LaunchGatherExpertRows(p.x, order, Ki, Di, n, b.xe, ctx));
    NQ_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(ctx.stream, r.ready[buf], 0));
    RETURN_IF_ERROR(GemmRowsF16(r.blas, b.w_gu[buf], b.xe, b.he, 2 * Ii, n, Di));
    Nvfp4SwigluRowsKernel<<<dim3(static_cast<unsigned>(n), static_cast<unsigned>(CeilDiv(I, kThreads))), kThreads, 0,
                            ctx.stream>>>(b.he, p.gate_up.global_scales + e, Ii, b.hh);
    RETURN_IF_ERROR(CheckLaunch("Nvfp4SwigluRowsKernel"));
    RETURN_IF_ERROR(GemmRowsF16(r.blas, b.w_d[buf], b.hh, b.ye, Di, n, Ii));
    NQ_CUDA_RETURN_IF_ERROR(cudaEventRecord(r.free[buf], ctx.stream));
    RETURN_IF_ERROR(LaunchScatterAddExpertRows(b.ye, order, Ki, Di, n, p.expert_weights, p.down.global_scales + e,
                                               p.out, ctx));
  }
  return absl::OkStatus();
}

}  // namespace nq::kernels::cuda
