// LayerNorm: y = (x - mean) / sqrt(var + eps) * weight + bias over the last dim (biased
// variance), fp32 in and out. One block per row, three passes over the row (mean, variance about
// the mean, write; the second and third mostly L1/L2 hits), each reduction a BlockSum. Every
// element is read and written by the same thread after the last barrier, so y may alias x.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/launch_dependent.cuh"
#include "kernels/cuda/reduce.cuh"

namespace nq::kernels::cuda {

struct LayerNormParams {
  const float* x = nullptr;       // [rows, cols]
  const float* weight = nullptr;  // [cols]
  const float* bias = nullptr;    // [cols]
  float* y = nullptr;             // [rows, cols]; may equal x
  std::int64_t rows = 0;
  int cols = 0;
  float eps = 0.0f;
};

// Contract: rows < 2^31 (one block per row), 0 <= cols < 2^31.
absl::Status LaunchLayerNorm(const LayerNormParams& params, const LaunchContext& ctx);

inline constexpr int kLayerNormThreads = 256;

template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    LayerNormKernel(const __grid_constant__ LayerNormParams p) {
  StartAsProgrammaticDependent();
  __shared__ float scratch[kThreads / kWarpSize];
  const std::int64_t offset = blockIdx.x * std::int64_t{p.cols};
  const float* x = p.x + offset;
  float* y = p.y + offset;
  const float inv_cols = 1.0f / static_cast<float>(p.cols);

  float sum = 0.0f;
  for (int c = threadIdx.x; c < p.cols; c += kThreads) sum += x[c];
  const float mean = BlockSum<kThreads>(sum, scratch) * inv_cols;

  float sum_sq = 0.0f;
  for (int c = threadIdx.x; c < p.cols; c += kThreads) {
    const float centred = x[c] - mean;
    sum_sq += centred * centred;
  }
  const float inv_std = rsqrtf(BlockSum<kThreads>(sum_sq, scratch) * inv_cols + p.eps);

  for (int c = threadIdx.x; c < p.cols; c += kThreads) {
    y[c] = (x[c] - mean) * inv_std * __ldg(p.weight + c) + __ldg(p.bias + c);
  }
}

}  // namespace nq::kernels::cuda
