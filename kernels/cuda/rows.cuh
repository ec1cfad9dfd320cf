// Row movement for the KV cache writes and the MoE dispatch and combine:
//  - WriteRows into an F32 cache is a plain cudaMemcpyAsync; into a BF16 cache it is
//    FloatsToBf16Kernel over the contiguous destination rows (round to nearest even, the
//    CPU backend's ToBf16, so both backends store the same bits).
//  - GatherRowsKernel: out[i, :] = x[rows[i], :], one block per output row.
//  - ScatterAddRowsKernel: out[r, :] += sum_i weights[i] * src[i, :] over the i with rows[i] = r,
//    one block per distinct target row. The host groups the contributions by target (a stable
//    counting sort, so each target keeps index order) and the kernel adds them in that order
//    with separately rounded multiply and add: no atomics, deterministic, and the same
//    arithmetic as the CPU backend.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/launch_dependent.cuh"
#include "kernels/dtype.h"

namespace nq::kernels::cuda {

struct FloatsToBf16Params {
  const float* src = nullptr;  // [count]
  Bf16* out = nullptr;         // [count]; does not overlap src
  std::int64_t count = 0;
};

// Contract: count >= 0; any alignment of src and out (a cache row offset may be odd).
absl::Status LaunchFloatsToBf16(const FloatsToBf16Params& params, const LaunchContext& ctx);

// WriteRows at a row offset read from the device when the kernel runs (a captured step graph):
// dst[*row_offset + i, :] = src[i, :], F32 or BF16 (rounded as FloatsToBf16) destination rows.
// Rows that would land at or past dst_rows are dropped (an offset past its bound is the caller's
// bug; the kernel stays inside the cache).
struct WriteRowsAtParams {
  const float* src = nullptr;  // [rows, cols]
  void* dst = nullptr;         // [dst_rows, cols], F32 or BF16
  bool dst_bf16 = false;
  const std::int32_t* row_offset = nullptr;  // device
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t dst_rows = 0;
};
absl::Status LaunchWriteRowsAt(const WriteRowsAtParams& params, const LaunchContext& ctx);

struct GatherRowsParams {
  const float* x = nullptr;            // [*, cols]
  const std::int32_t* rows = nullptr;  // [n], device, each a valid row of x
  float* out = nullptr;                // [n, cols]; does not overlap x
  std::int64_t n = 0;
  std::int64_t cols = 0;
};

// Contract: n < 2^31 (one block per row), cols >= 0.
absl::Status LaunchGatherRows(const GatherRowsParams& params, const LaunchContext& ctx);

struct ScatterAddRowsParams {
  const float* src = nullptr;             // [n, cols]
  const std::int32_t* targets = nullptr;  // [num_targets] distinct rows of out, device
  const std::int32_t* offsets = nullptr;  // [num_targets + 1]: target j owns entries
                                          // [offsets[j], offsets[j + 1])
  const std::int32_t* sources = nullptr;  // [n] row of src of each entry, in index order per target
  const float* weights = nullptr;         // [n] weight of each entry
  float* out = nullptr;                   // [*, cols]; does not overlap src
  std::int64_t num_targets = 0;
  std::int64_t cols = 0;
};

// Contract: num_targets < 2^31 (one block per target), cols >= 0.
absl::Status LaunchScatterAddRows(const ScatterAddRowsParams& params, const LaunchContext& ctx);

inline constexpr int kRowsThreads = 256;

template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    FloatsToBf16Kernel(const __grid_constant__ FloatsToBf16Params p) {
  StartAsProgrammaticDependent();
  const std::int64_t stride = std::int64_t{gridDim.x} * kThreads;
  for (std::int64_t i = blockIdx.x * std::int64_t{kThreads} + threadIdx.x; i < p.count; i += stride) {
    p.out[i] = ToBf16(__ldg(p.src + i));
  }
}

template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    WriteRowsAtKernel(const __grid_constant__ WriteRowsAtParams p) {
  StartAsProgrammaticDependent();
  const std::int64_t row = std::int64_t{*p.row_offset} + blockIdx.x;
  if (row < 0 || row >= p.dst_rows) return;
  const float* src = p.src + blockIdx.x * p.cols;
  for (std::int64_t c = threadIdx.x; c < p.cols; c += kThreads) {
    if (p.dst_bf16) {
      static_cast<Bf16*>(p.dst)[row * p.cols + c] = ToBf16(__ldg(src + c));
    } else {
      static_cast<float*>(p.dst)[row * p.cols + c] = __ldg(src + c);
    }
  }
}

template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    GatherRowsKernel(const __grid_constant__ GatherRowsParams p) {
  const float* src = p.x + std::int64_t{p.rows[blockIdx.x]} * p.cols;
  float* dst = p.out + blockIdx.x * p.cols;
  for (std::int64_t c = threadIdx.x; c < p.cols; c += kThreads) dst[c] = __ldg(src + c);
}

template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    ScatterAddRowsKernel(const __grid_constant__ ScatterAddRowsParams p) {
  const std::int32_t begin = p.offsets[blockIdx.x];
  const std::int32_t end = p.offsets[blockIdx.x + 1];
  float* dst = p.out + std::int64_t{p.targets[blockIdx.x]} * p.cols;
  for (std::int64_t c = threadIdx.x; c < p.cols; c += kThreads) {
    float acc = dst[c];
    for (std::int32_t e = begin; e < end; ++e) {
      const float s = __ldg(p.src + std::int64_t{p.sources[e]} * p.cols + c);
      acc = __fadd_rn(acc, __fmul_rn(p.weights[e], s));
    }
    dst[c] = acc;
  }
}

}  // namespace nq::kernels::cuda
