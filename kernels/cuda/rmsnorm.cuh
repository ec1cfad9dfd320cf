// RmsNorm: y = (x * rsqrt(mean(x^2) + eps)) * weight over the last dim, fp32 in and out, weight
// F32 / BF16 / F16; with deltas (Backend::AddRmsNorm), x + (delta0 + delta1) is normalised
// instead, and written back to x_out, so a residual connection costs no launch of its own.
// One block per row: each thread accumulates a strided share of the sum of
// squares, a block reduction gives the row's inverse RMS, and a second pass scales and writes
// (from registers for rows up to 8192 columns, else re-reading the row, mostly L1/L2 hits). Every element is read and written by the same thread after the reduction's
// barrier, so y may alias x.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/launch_dependent.cuh"
#include "kernels/cuda/load.cuh"
#include "kernels/cuda/reduce.cuh"
#include "kernels/dtype.h"

namespace nq::kernels::cuda {

struct RmsNormParams {
  const float* x = nullptr;       // [rows, cols]
  const void* weight = nullptr;   // [cols], elements of weight_dtype
  DType weight_dtype = DType::kF32;
  float* y = nullptr;             // [rows, cols]; may equal x
  std::int64_t rows = 0;
  int cols = 0;
  float eps = 0.0f;
  // AddRmsNorm: what is added to x (delta1 only with delta0) and where the sum goes (null: not
  // kept; it may be x). Neither delta may alias x, x_out or y.
  const float* delta0 = nullptr;  // [rows, cols]
  const float* delta1 = nullptr;  // [rows, cols]
  float* x_out = nullptr;         // [rows, cols]
};

// Contract: rows < 2^31 (one block per row), 0 <= cols < 2^31. Rows 16-byte aligned
// (cols % 4 == 0, aligned bases, deltas and x_out included) take the float4 path.
// InvalidArgumentError for a bad dtype.
absl::Status LaunchRmsNorm(const RmsNormParams& params, const LaunchContext& ctx);

inline constexpr int kRmsNormThreads = 512;
// float4s of a row each thread holds in registers on the cached path: rows up to 8192 columns
// (every model's hidden size here) are read once, all loads in flight together.
inline constexpr int kRmsNormCached = 4;

// x + (delta0 + delta1) as Add computes it (the deltas summed first), or x without deltas.
__device__ __forceinline__ float4 WithDeltas(float4 v, const RmsNormParams& p, std::int64_t i) {
  if (p.delta0 == nullptr) return v;
  float4 d = *reinterpret_cast<const float4*>(p.delta0 + i);
  if (p.delta1 != nullptr) {
    const float4 e = *reinterpret_cast<const float4*>(p.delta1 + i);
    d = make_float4(d.x + e.x, d.y + e.y, d.z + e.z, d.w + e.w);
  }
  return make_float4(v.x + d.x, v.y + d.y, v.z + d.z, v.w + d.w);
}
__device__ __forceinline__ float WithDeltas(float v, const RmsNormParams& p, std::int64_t i) {
  if (p.delta0 == nullptr) return v;
  return v + (p.delta1 != nullptr ? p.delta0[i] + p.delta1[i] : p.delta0[i]);
}

// kVec4: x, y and weight rows may be read and written 4 elements at a time.
// Launched as a programmatic dependent (rmsnorm.cu): the weight, a constant, is loaded before
// waiting for the kernel that writes x.
template <typename WeightT, bool kVec4>
__global__ void __launch_bounds__(kRmsNormThreads)
    RmsNormKernel(const __grid_constant__ RmsNormParams p) {
  __shared__ float scratch[kRmsNormThreads / kWarpSize];
  const std::int64_t offset = blockIdx.x * std::int64_t{p.cols};
  const float* x = p.x + offset;
  float* y = p.y + offset;
  const WeightT* weight = static_cast<const WeightT*>(p.weight);

  if constexpr (kVec4) {
    if (p.cols <= kRmsNormThreads * 4 * kRmsNormCached) {  // block-uniform
      float w[kRmsNormCached][4];
      float4 v[kRmsNormCached];
#pragma unroll
      for (int i = 0; i < kRmsNormCached; ++i) {
        const int c = (static_cast<int>(threadIdx.x) + i * kRmsNormThreads) * 4;
        if (c < p.cols) Load4(weight + c, w[i]);
      }
      WaitForPrerequisiteGrid();
      float sum_sq = 0.0f;
#pragma unroll
      for (int i = 0; i < kRmsNormCached; ++i) {
        const int c = (static_cast<int>(threadIdx.x) + i * kRmsNormThreads) * 4;
        v[i] = c < p.cols ? WithDeltas(*reinterpret_cast<const float4*>(x + c), p, offset + c)
                          : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        sum_sq += v[i].x * v[i].x + v[i].y * v[i].y + v[i].z * v[i].z + v[i].w * v[i].w;
      }
      sum_sq = BlockSum<kRmsNormThreads>(sum_sq, scratch);
      LetDependentsLaunch();
      const float inv_rms = rsqrtf(sum_sq / static_cast<float>(p.cols) + p.eps);
#pragma unroll
      for (int i = 0; i < kRmsNormCached; ++i) {
        const int c = (static_cast<int>(threadIdx.x) + i * kRmsNormThreads) * 4;
        if (c < p.cols) {
          if (p.x_out != nullptr) *reinterpret_cast<float4*>(p.x_out + offset + c) = v[i];
          *reinterpret_cast<float4*>(y + c) =
              make_float4((v[i].x * inv_rms) * w[i][0], (v[i].y * inv_rms) * w[i][1], (v[i].z * inv_rms) * w[i][2],
                          (v[i].w * inv_rms) * w[i][3]);
        }
      }
      return;
    }
  }
  WaitForPrerequisiteGrid();

  float sum_sq = 0.0f;
  if constexpr (kVec4) {
    for (int c = threadIdx.x * 4; c < p.cols; c += kRmsNormThreads * 4) {
      const float4 v = WithDeltas(*reinterpret_cast<const float4*>(x + c), p, offset + c);
      sum_sq += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
  } else {
    for (int c = threadIdx.x; c < p.cols; c += kRmsNormThreads) {
      const float v = WithDeltas(x[c], p, offset + c);
      sum_sq += v * v;
    }
  }
  sum_sq = BlockSum<kRmsNormThreads>(sum_sq, scratch);
  const float inv_rms = rsqrtf(sum_sq / static_cast<float>(p.cols) + p.eps);

  if constexpr (kVec4) {
    // The sum is formed again from x (the same additions, so the same values), and only now
    // written: x_out may be x.
    for (int c = threadIdx.x * 4; c < p.cols; c += kRmsNormThreads * 4) {
      const float4 v = WithDeltas(*reinterpret_cast<const float4*>(x + c), p, offset + c);
      if (p.x_out != nullptr) *reinterpret_cast<float4*>(p.x_out + offset + c) = v;
      float w[4];
      Load4(weight + c, w);
      *reinterpret_cast<float4*>(y + c) =
          make_float4((v.x * inv_rms) * w[0], (v.y * inv_rms) * w[1], (v.z * inv_rms) * w[2],
                      (v.w * inv_rms) * w[3]);
    }
  } else {
    for (int c = threadIdx.x; c < p.cols; c += kRmsNormThreads) {
      const float v = WithDeltas(x[c], p, offset + c);
      if (p.x_out != nullptr) p.x_out[offset + c] = v;
      y[c] = (v * inv_rms) * LoadFloat(weight + c);
    }
  }
}

}  // namespace nq::kernels::cuda
