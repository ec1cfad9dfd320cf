// Warp- and block-wide reductions shared by the row kernels (RmsNorm, Softmax).
#pragma once

#include <cmath>

namespace nq::kernels::cuda {

inline constexpr int kWarpSize = 32;
inline constexpr unsigned kFullWarpMask = 0xffffffffu;

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(kFullWarpMask, v, offset);
  }
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(kFullWarpMask, v, offset));
  return v;
}

// A running softmax denominator: sum of exp(v - max) over the values seen so far.
struct MaxSum {
  float max;
  float sum;
};

__device__ __forceinline__ MaxSum Merge(MaxSum a, MaxSum b) {
  const float max = fmaxf(a.max, b.max);
  if (max == -INFINITY) return {max, 0.0f};
  return {max, a.sum * expf(a.max - max) + b.sum * expf(b.max - max)};
}

__device__ __forceinline__ MaxSum WarpMerge(MaxSum v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const MaxSum other{__shfl_xor_sync(kFullWarpMask, v.max, offset),
                       __shfl_xor_sync(kFullWarpMask, v.sum, offset)};
    v = Merge(v, other);
  }
  return v;
}

// Block-wide sum; every thread of the block gets the total. All kThreads threads must call it.
// `scratch` is shared memory for kThreads / 32 values; it may be reused once this returns.
template <int kThreads>
__device__ __forceinline__ float BlockSum(float v, float* scratch) {
  static_assert(kThreads % kWarpSize == 0 && kThreads <= kWarpSize * kWarpSize);
  constexpr int kWarps = kThreads / kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  v = WarpSum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = WarpSum(lane < kWarps ? scratch[lane] : 0.0f);
  __syncthreads();
  return v;
}

// Block-wide MaxSum merge; same contract as BlockSum.
template <int kThreads>
__device__ __forceinline__ MaxSum BlockMerge(MaxSum v, MaxSum* scratch) {
  static_assert(kThreads % kWarpSize == 0 && kThreads <= kWarpSize * kWarpSize);
  constexpr int kWarps = kThreads / kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  v = WarpMerge(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = WarpMerge(lane < kWarps ? scratch[lane] : MaxSum{-INFINITY, 0.0f});
  __syncthreads();
  return v;
}

}  // namespace nq::kernels::cuda
