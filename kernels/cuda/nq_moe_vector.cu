#include "kernels/cuda/nq_moe_vector.cuh"

#include "kernels/cuda/launch_dependent.cuh"
#include "services/common/status_macros.h"

namespace nq::kernels::cuda {
namespace {

constexpr int kVectorThreads = 512;
constexpr int kChunkThreads = 128;  // one Hadamard block (e.g. 128 wide) per CUDA block

__global__ void __launch_bounds__(kChunkThreads) NqRotateInputKernel(const __grid_constant__ NqVectorParams v) {
  // One Hadamard block of one token per CUDA block: the blocks are independent.
  extern __shared__ float smem[];
  const int D = static_cast<int>(v.p.hidden), t = blockIdx.x, n = static_cast<int>(v.p.input.block);
  const int i0 = blockIdx.y * n;
  for (int i = threadIdx.x; i < n; i += blockDim.x) smem[i] = v.p.x[t * D + i0 + i] * v.p.input.signs[i0 + i];
  __syncthreads();
  BlockFwht(smem, n, n);
  const float scale = rsqrtf(static_cast<float>(n));
  for (int i = threadIdx.x; i < n; i += blockDim.x) v.xr[t * D + i0 + i] = smem[i] * scale;
}

__global__ void __launch_bounds__(kVectorThreads) NqSwigluKernel(const __grid_constant__ NqVectorParams v) {
  extern __shared__ float smem[];
  const int I = static_cast<int>(v.p.intermediate), a = blockIdx.x;
  const float* in = v.hg + static_cast<std::int64_t>(a) * 2 * I;
  for (int i = threadIdx.x; i < 2 * I; i += blockDim.x) smem[i] = in[i];
  __syncthreads();
  BlockFwht(smem, 2 * I, static_cast<int>(v.p.gate_rows.block));  // gate and up, block by block
  const float g_scale = rsqrtf(static_cast<float>(v.p.gate_rows.block));
  for (int i = threadIdx.x; i < I; i += blockDim.x) {
    const float s = v.p.gate_rows.signs[i] * g_scale;
    const float g = smem[i] * s, u = smem[I + i] * s;
    smem[i] = g / (1.0f + __expf(-g)) * u * v.p.down_cols.signs[i];
  }
  __syncthreads();
  BlockFwht(smem, I, static_cast<int>(v.p.down_cols.block));
  const float d_scale = rsqrtf(static_cast<float>(v.p.down_cols.block));
  if (v.hh_half != nullptr) {
    for (int i = threadIdx.x; i < I; i += blockDim.x) {
      v.hh_half[static_cast<std::int64_t>(a) * I + i] = __float2half_rn(smem[i] * d_scale);
    }
  } else {
    for (int i = threadIdx.x; i < I; i += blockDim.x) v.hh[static_cast<std::int64_t>(a) * I + i] = smem[i] * d_scale;
  }
}

// smem[0, n) (one Hadamard block at i0 of token t's output, summed) rotated into out[t].
__device__ __forceinline__ void RotateOutBlock(const NqMoeParams& p, float* smem, int t, int n, int i0) {
  const int D = static_cast<int>(p.hidden);
  __syncthreads();
  BlockFwht(smem, n, n);
  const float scale = rsqrtf(static_cast<float>(n));
  for (int i = threadIdx.x; i < n; i += blockDim.x) p.out[t * D + i0 + i] = smem[i] * scale * p.down_rows.signs[i0 + i];
}

__global__ void __launch_bounds__(kChunkThreads) NqRotateOutputKernel(const __grid_constant__ NqMoeParams p,
                                                                     const float* acc) {
  extern __shared__ float smem[];
  const int D = static_cast<int>(p.hidden), t = blockIdx.x;
  const int n = static_cast<int>(p.down_rows.block), i0 = blockIdx.y * n;
  for (int i = threadIdx.x; i < n; i += blockDim.x) smem[i] = acc[static_cast<std::int64_t>(t) * D + i0 + i];
  RotateOutBlock(p, smem, t, n, i0);
}

// Launched as a programmatic dependent of the down GEMV (its launch overlaps the GEMV's end).
__global__ void __launch_bounds__(kChunkThreads) NqCombineKernel(const __grid_constant__ NqVectorParams v) {
  // One Hadamard block of one token per CUDA block.
  extern __shared__ float smem[];
  WaitForPrerequisiteGrid();
  const int D = static_cast<int>(v.p.hidden), K = static_cast<int>(v.p.top_k), t = blockIdx.x;
  const int n = static_cast<int>(v.p.down_rows.block), i0 = blockIdx.y * n;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    float acc = 0.0f;
    // Every assignment's row is loaded (yd has top_k rows per token) and the invalid ones are
    // selected away rather than skipped: no branch between the loads, so they are all in flight
    // at once instead of one latency each (a select, not a multiply by 0, so a row nobody wrote
    // cannot turn the sum into NaN).
#pragma unroll 4
    for (int k = 0; k < K; ++k) {
      const int e = v.p.expert_ids[t * K + k];
      const float y = v.yd[static_cast<std::int64_t>(t * K + k) * D + i0 + i];
      acc += e >= 0 && e < v.p.num_experts ? v.p.expert_weights[t * K + k] * y : 0.0f;
    }
    smem[i] = acc;
  }
  RotateOutBlock(v.p, smem, t, n, i0);
}

absl::Status SetSmem(const void* kernel, std::size_t bytes) {
  return CudaStatus(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
                    "cudaFuncSetAttribute (NqMoe vector kernel)");
}

}  // namespace

absl::Status LaunchNqRotateInput(const NqVectorParams& v, const LaunchContext& ctx) {
  const std::size_t smem = v.p.input.block * sizeof(float);
  RETURN_IF_ERROR(SetSmem(reinterpret_cast<const void*>(NqRotateInputKernel), smem));
  const dim3 grid(static_cast<unsigned>(v.p.tokens), static_cast<unsigned>(v.p.hidden / v.p.input.block));
  NqRotateInputKernel<<<grid, kChunkThreads, smem, ctx.stream>>>(v);
  return CheckLaunch("NqRotateInputKernel");
}

absl::Status LaunchNqSwiglu(const NqVectorParams& v, const LaunchContext& ctx) {
  const std::size_t smem = 2 * v.p.intermediate * sizeof(float);
  RETURN_IF_ERROR(SetSmem(reinterpret_cast<const void*>(NqSwigluKernel), smem));
  const std::int64_t rows = v.rows > 0 ? v.rows : v.p.tokens * v.p.top_k;
  NqSwigluKernel<<<static_cast<unsigned>(rows), kVectorThreads, smem, ctx.stream>>>(v);
  return CheckLaunch("NqSwigluKernel");
}

absl::Status LaunchNqRotateOutput(const NqMoeParams& p, const float* acc, const LaunchContext& ctx) {
  const std::size_t smem = p.down_rows.block * sizeof(float);
  RETURN_IF_ERROR(SetSmem(reinterpret_cast<const void*>(NqRotateOutputKernel), smem));
  const dim3 grid(static_cast<unsigned>(p.tokens), static_cast<unsigned>(p.hidden / p.down_rows.block));
  NqRotateOutputKernel<<<grid, kChunkThreads, smem, ctx.stream>>>(p, acc);
  return CheckLaunch("NqRotateOutputKernel");
}

absl::Status LaunchNqCombine(const NqVectorParams& v, const LaunchContext& ctx) {
  const std::size_t smem = v.p.down_rows.block * sizeof(float);
  RETURN_IF_ERROR(SetSmem(reinterpret_cast<const void*>(NqCombineKernel), smem));
  const dim3 grid(static_cast<unsigned>(v.p.tokens), static_cast<unsigned>(v.p.hidden / v.p.down_rows.block));
  RETURN_IF_ERROR(LaunchProgrammaticDependent(NqCombineKernel, grid, dim3(kChunkThreads), smem, ctx, v));
  return CheckLaunch("NqCombineKernel");
}

}  // namespace nq::kernels::cuda
