// SiluAndMul (vLLM's silu_and_mul): each row of x is [gate (d) | up (d)] and
// y[r, j] = silu(gate[j]) * up[j], silu(g) = g / (1 + exp(-g)), in fp32. Elementwise and
// memory-bound: a grid-stride loop, 4 elements per thread step when rows are 16-byte aligned.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/launch_dependent.cuh"

namespace nq::kernels::cuda {

struct SiluAndMulParams {
  const float* x = nullptr;  // [rows, 2 * cols]
  float* y = nullptr;        // [rows, cols]; does not overlap x
  std::int64_t rows = 0;
  std::int64_t cols = 0;
};

// Contract: rows, cols >= 0. cols % 4 == 0 with 16-byte aligned bases takes the float4 path.
absl::Status LaunchSiluAndMul(const SiluAndMulParams& params, const LaunchContext& ctx);

inline constexpr int kSiluAndMulThreads = 256;

__device__ __forceinline__ float Silu(float g) { return g / (1.0f + expf(-g)); }

// kVec4: cols % 4 == 0 and the bases are 16-byte aligned; indices then count groups of 4.
template <bool kVec4>
__global__ void __launch_bounds__(kSiluAndMulThreads)
    SiluAndMulKernel(const __grid_constant__ SiluAndMulParams p) {
  StartAsProgrammaticDependent();
  constexpr int kVec = kVec4 ? 4 : 1;
  const std::int64_t groups_per_row = p.cols / kVec;
  const std::int64_t total = p.rows * groups_per_row;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < total;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t row = i / groups_per_row;
    const std::int64_t col = (i - row * groups_per_row) * kVec;
    const float* gate = p.x + row * 2 * p.cols + col;
    const float* up = gate + p.cols;
    float* out = p.y + row * p.cols + col;
    if constexpr (kVec4) {
      const float4 g = *reinterpret_cast<const float4*>(gate);
      const float4 u = *reinterpret_cast<const float4*>(up);
      *reinterpret_cast<float4*>(out) =
          make_float4(Silu(g.x) * u.x, Silu(g.y) * u.y, Silu(g.z) * u.z, Silu(g.w) * u.w);
    } else {
      *out = Silu(*gate) * *up;
    }
  }
}

}  // namespace nq::kernels::cuda
