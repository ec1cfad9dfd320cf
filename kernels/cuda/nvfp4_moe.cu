#include "kernels/cuda/nvfp4_moe.cuh"

#include <cuda_fp16.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/launch_dependent.cuh"
#include "kernels/cuda/nvfp4_gemv.cuh"
#include "services/common/status_macros.h"

namespace nq::kernels::cuda {
namespace {

constexpr int kVectorThreads = 256;
// Workspace pieces start on 16-byte boundaries (the GEMV reads its inputs 16 bytes at a time).
constexpr std::size_t kAlign = 16;

std::size_t Aligned(std::size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// The chunk's intermediate vectors inside the workspace.
struct Workspace {
  __half* xh = nullptr;  // [T][D]    GEMV inputs of gate/up
  float* hg = nullptr;   // [A][2I]   gate/up outputs
  __half* ah = nullptr;  // [A][I]    GEMV inputs of down
  float* yd = nullptr;   // [A][D]    down outputs
};

Workspace Carve(void* base, std::int64_t top_k, std::int64_t D, std::int64_t I) {
  const std::int64_t A = kNvfp4MaxDecodeTokens * top_k;
  auto* p = static_cast<std::byte*>(base);
  Workspace w;
  w.xh = reinterpret_cast<__half*>(p);
  p += Aligned(kNvfp4MaxDecodeTokens * D * sizeof(__half));
  w.hg = reinterpret_cast<float*>(p);
  p += Aligned(A * 2 * I * sizeof(float));
  w.ah = reinterpret_cast<__half*>(p);
  p += Aligned(A * I * sizeof(__half));
  w.yd = reinterpret_cast<float*>(p);
  return w;
}

// Where the GEMV reads input c of a vector: its aligned group of 8 in the decode's pair order
// (nvfp4_fragment.h, Nvfp4InputPosition).
__device__ __forceinline__ int GemvInputIndex(int c) { return (c & ~7) | nvfp4::Nvfp4InputPosition(c & 7); }

// grid (T, ceil(D / threads)): xh[t] = fp16(x[t]) in the GEMV's input order; every block also zeroes a slice of hg, the
// outputs the gate/up GEMV adds into.
__global__ void __launch_bounds__(kVectorThreads) Nvfp4PrepKernel(const float* x, __half* xh, int D, float* hg,
                                                                  int hg_count) {
  const int t = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x;
  // Nothing here is read by the kernel before (a previous chunk's combine reads only yd), but
  // hg may still be read by a previous chunk's SwiGLU kernel when launched as a dependent.
  WaitForPrerequisiteGrid();
  LetDependentsLaunch();
  if (c < D) {
    xh[static_cast<std::int64_t>(t) * D + GemvInputIndex(c)] = __float2half_rn(x[static_cast<std::int64_t>(t) * D + c]);
  }
  const int block = blockIdx.x * gridDim.y + blockIdx.y, stride = gridDim.x * gridDim.y * blockDim.x;
  for (int i = block * blockDim.x + threadIdx.x; i < hg_count; i += stride) hg[i] = 0.0f;
}

// grid (A, ceil(I / threads)): ah[a] = fp16(silu(g) * u), in the GEMV's input order, from hg[a] = [g | u] (as the CPU
// reference computes it); every block also zeroes a slice of yd, the down GEMV's outputs.
__global__ void __launch_bounds__(kVectorThreads) Nvfp4SwigluKernel(const float* hg, __half* ah, int I, float* yd,
                                                                    int yd_count) {
  WaitForPrerequisiteGrid();
  LetDependentsLaunch();
  const int a = blockIdx.x, i = blockIdx.y * blockDim.x + threadIdx.x;
  if (i < I) {
    const float* h = hg + static_cast<std::int64_t>(a) * 2 * I;
    const float g = h[i];
    ah[static_cast<std::int64_t>(a) * I + GemvInputIndex(i)] = __float2half_rn(g / (1.0f + expf(-g)) * h[I + i]);
  }
  const int block = blockIdx.x * gridDim.y + blockIdx.y, stride = gridDim.x * gridDim.y * blockDim.x;
  for (int j = block * blockDim.x + threadIdx.x; j < yd_count; j += stride) yd[j] = 0.0f;
}

// grid (T, ceil(D / threads)): out[t] = sum_k w[t, k] * yd[t * K + k], k in order, skipping ids
// outside [0, E) (the GEMV left their rows zero, but a weight could be NaN).
__global__ void __launch_bounds__(kVectorThreads) Nvfp4CombineKernel(const Nvfp4MoeParams p, const float* yd) {
  WaitForPrerequisiteGrid();
  LetDependentsLaunch();
  const int t = blockIdx.x, d = blockIdx.y * blockDim.x + threadIdx.x;
  if (d >= p.hidden) return;
  float sum = 0.0f;
  for (int k = 0; k < p.top_k; ++k) {
    const std::int64_t a = static_cast<std::int64_t>(t) * p.top_k + k;
    const int e = p.expert_ids[a];
    if (e < 0 || e >= p.num_experts) continue;
    sum += p.expert_weights[a] * yd[a * p.hidden + d];
  }
  p.out[static_cast<std::int64_t>(t) * p.hidden + d] = sum;
}

unsigned Blocks(std::int64_t n) { return static_cast<unsigned>(CeilDiv(n, kVectorThreads)); }

absl::Status LaunchChunk(const Nvfp4MoeParams& p, const Workspace& w, const LaunchContext& ctx) {
  const std::int64_t T = p.tokens, K = p.top_k, D = p.hidden, I = p.intermediate, A = T * K;
  RETURN_IF_ERROR(LaunchProgrammaticDependent(Nvfp4PrepKernel, dim3(static_cast<unsigned>(T), Blocks(D)),
                                              dim3(kVectorThreads), 0, ctx, p.x, w.xh, static_cast<int>(D), w.hg,
                                              static_cast<int>(A * 2 * I)));
  RETURN_IF_ERROR(CheckLaunch("Nvfp4PrepKernel"));
  Nvfp4GemvParams g{.expert_ids = p.expert_ids,
                    .assignments = static_cast<int>(A),
                    .top_k = static_cast<int>(K),
                    .num_experts = static_cast<int>(p.num_experts),
                    .w = p.gate_up,
                    .rows = static_cast<int>(2 * I),
                    .cols = static_cast<int>(D),
                    .x = w.xh,
                    .x_per_token = true,
                    .out = w.hg,
                    .out_stride = 2 * I};
  RETURN_IF_ERROR(LaunchNvfp4Gemv(g, ctx));
  RETURN_IF_ERROR(LaunchProgrammaticDependent(Nvfp4SwigluKernel, dim3(static_cast<unsigned>(A), Blocks(I)),
                                              dim3(kVectorThreads), 0, ctx, static_cast<const float*>(w.hg), w.ah,
                                              static_cast<int>(I), w.yd, static_cast<int>(A * D)));
  RETURN_IF_ERROR(CheckLaunch("Nvfp4SwigluKernel"));
  g.w = p.down;
  g.rows = static_cast<int>(D);
  g.cols = static_cast<int>(I);
  g.x = w.ah;
  g.x_per_token = false;
  g.out = w.yd;
  g.out_stride = D;
  RETURN_IF_ERROR(LaunchNvfp4Gemv(g, ctx));
  RETURN_IF_ERROR(LaunchProgrammaticDependent(Nvfp4CombineKernel, dim3(static_cast<unsigned>(T), Blocks(D)),
                                              dim3(kVectorThreads), 0, ctx, p, static_cast<const float*>(w.yd)));
  return CheckLaunch("Nvfp4CombineKernel");
}

}  // namespace

std::size_t Nvfp4MoeWorkspaceBytes(std::int64_t top_k, std::int64_t hidden, std::int64_t intermediate) {
  const std::int64_t A = kNvfp4MaxDecodeTokens * top_k;
  return Aligned(kNvfp4MaxDecodeTokens * hidden * sizeof(__half)) + Aligned(A * 2 * intermediate * sizeof(float)) +
         Aligned(A * intermediate * sizeof(__half)) + Aligned(A * hidden * sizeof(float));
}

absl::Status LaunchNvfp4Moe(const Nvfp4MoeParams& p, void* workspace, std::size_t workspace_bytes,
                            const LaunchContext& ctx) {
  const std::int64_t D = p.hidden, I = p.intermediate;
  if (D % kNvfp4LaneCols != 0 || I % kNvfp4LaneCols != 0) {
    return absl::InvalidArgumentError(absl::StrCat("Nvfp4Moe (CUDA): hidden ", D, " and intermediate ", I,
                                                   " must be multiples of ", kNvfp4LaneCols));
  }
  if (p.top_k < 1 || kNvfp4MaxDecodeTokens * p.top_k > kNvfp4MaxAssignments) {
    return absl::InvalidArgumentError(absl::StrCat("Nvfp4Moe (CUDA): top_k ", p.top_k, " outside [1, ",
                                                   kNvfp4MaxAssignments / kNvfp4MaxDecodeTokens, "]"));
  }
  if (workspace_bytes < Nvfp4MoeWorkspaceBytes(p.top_k, D, I) || !IsAligned(workspace, kAlign)) {
    return absl::InvalidArgumentError(absl::StrCat("Nvfp4Moe (CUDA): workspace of ", workspace_bytes, " bytes, need ",
                                                   Nvfp4MoeWorkspaceBytes(p.top_k, D, I), " 16-byte aligned"));
  }
  const Workspace w = Carve(workspace, p.top_k, D, I);
  for (std::int64_t t0 = 0; t0 < p.tokens; t0 += kNvfp4MaxDecodeTokens) {
    RETURN_IF_ERROR(LaunchChunk(Nvfp4MoeTokenChunk(p, t0, std::min(kNvfp4MaxDecodeTokens, p.tokens - t0)), w, ctx));
  }
  return absl::OkStatus();
}

}  // namespace nq::kernels::cuda
