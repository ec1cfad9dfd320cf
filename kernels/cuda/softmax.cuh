// Softmax over the last dim: y = exp(s*x - max) / sum(exp(s*x - max)), fp32. One block per row.
// Pass 1 keeps a running (max, sum) per thread (the online-softmax recurrence) and merges them
// across the block; pass 2 writes. A row whose scaled values are all -inf (fully masked) gives
// zeros. Every element is read and written by the same thread after the merge's barrier, so y
// may alias x.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/reduce.cuh"

namespace nq::kernels::cuda {

struct SoftmaxParams {
  const float* x = nullptr;  // [rows, cols]
  float* y = nullptr;        // [rows, cols]; may equal x
  std::int64_t rows = 0;
  int cols = 0;
  float scale = 1.0f;
};

// Contract: rows < 2^31 (one block per row), 0 <= cols < 2^31, scale finite.
absl::Status LaunchSoftmax(const SoftmaxParams& params, const LaunchContext& ctx);

inline constexpr int kSoftmaxThreads = 256;

__device__ __forceinline__ void Accumulate(MaxSum& acc, float v) {
  if (v == -INFINITY) return;  // contributes exp(-inf) = 0
  if (v > acc.max) {
    acc.sum = acc.sum * expf(acc.max - v) + 1.0f;
    acc.max = v;
  } else {
    acc.sum += expf(v - acc.max);
  }
}

template <bool kVec4>
__global__ void __launch_bounds__(kSoftmaxThreads)
    SoftmaxKernel(const __grid_constant__ SoftmaxParams p) {
  __shared__ MaxSum scratch[kSoftmaxThreads / kWarpSize];
  const std::int64_t offset = blockIdx.x * std::int64_t{p.cols};
  const float* x = p.x + offset;
  float* y = p.y + offset;

  MaxSum acc{-INFINITY, 0.0f};
  if constexpr (kVec4) {
    for (int c = threadIdx.x * 4; c < p.cols; c += kSoftmaxThreads * 4) {
      const float4 v = *reinterpret_cast<const float4*>(x + c);
      Accumulate(acc, v.x * p.scale);
      Accumulate(acc, v.y * p.scale);
      Accumulate(acc, v.z * p.scale);
      Accumulate(acc, v.w * p.scale);
    }
  } else {
    for (int c = threadIdx.x; c < p.cols; c += kSoftmaxThreads) Accumulate(acc, x[c] * p.scale);
  }
  const MaxSum row = BlockMerge<kSoftmaxThreads>(acc, scratch);
  // Fully masked row: no finite maximum, every output is 0.
  const bool masked = row.max == -INFINITY;
  const float inv_sum = masked ? 0.0f : 1.0f / row.sum;
  const float max = masked ? 0.0f : row.max;

  if constexpr (kVec4) {
    for (int c = threadIdx.x * 4; c < p.cols; c += kSoftmaxThreads * 4) {
      const float4 v = *reinterpret_cast<const float4*>(x + c);
      *reinterpret_cast<float4*>(y + c) = make_float4(
          expf(v.x * p.scale - max) * inv_sum, expf(v.y * p.scale - max) * inv_sum,
          expf(v.z * p.scale - max) * inv_sum, expf(v.w * p.scale - max) * inv_sum);
    }
  } else {
    for (int c = threadIdx.x; c < p.cols; c += kSoftmaxThreads) {
      y[c] = expf(x[c] * p.scale - max) * inv_sum;
    }
  }
}

}  // namespace nq::kernels::cuda
