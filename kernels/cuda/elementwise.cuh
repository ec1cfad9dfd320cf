// Elementwise ops on fp32 tensors: Add (the residual connections). Memory-bound: a grid-stride
// loop, 4 elements per thread step when the three bases are 16-byte aligned.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/launch_dependent.cuh"

namespace nq::kernels::cuda {

struct AddParams {
  const float* a = nullptr;  // [count]
  const float* b = nullptr;  // [count]
  float* out = nullptr;      // [count]; may equal a or b
  std::int64_t count = 0;
};

// Contract: count >= 0. Every element is read and written by one thread, so out may alias a or b.
absl::Status LaunchAdd(const AddParams& params, const LaunchContext& ctx);

inline constexpr int kElementwiseThreads = 256;

// kVec4: the bases are 16-byte aligned; the tail past the last whole float4 is done by scalars.
template <bool kVec4>
__global__ void __launch_bounds__(kElementwiseThreads)
    AddKernel(const __grid_constant__ AddParams p) {
  StartAsProgrammaticDependent();
  const std::int64_t stride = std::int64_t{gridDim.x} * blockDim.x;
  const std::int64_t first = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  std::int64_t scalar_begin = 0;
  if constexpr (kVec4) {
    const std::int64_t groups = p.count / 4;
    for (std::int64_t i = first; i < groups; i += stride) {
      const float4 a = reinterpret_cast<const float4*>(p.a)[i];
      const float4 b = reinterpret_cast<const float4*>(p.b)[i];
      reinterpret_cast<float4*>(p.out)[i] = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
    }
    scalar_begin = groups * 4;
  }
  for (std::int64_t i = scalar_begin + first; i < p.count; i += stride) p.out[i] = p.a[i] + p.b[i];
}

}  // namespace nq::kernels::cuda
