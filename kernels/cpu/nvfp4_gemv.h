// CPU reference dequant-GEMV for NVFP4 weights in ModelOpt's packed layout
// (kernels/nvfp4_codes.h): y[m, n] = x[m, k] · W[n, k]^T, W never expanded in memory.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace nq::kernels::cpu {

// Contract: k % 16 == 0 (and so even); `packed` holds n rows of k / 2 bytes, `scales` n rows of
// k / 16 float8_e4m3fn codes, both row-major and contiguous; x is [m, k], y is [m, n], fp32.
// Each row's dot product sums each 16-element block in fp32 with its E2M1 values, multiplies
// the block sum by the block's E4M3 scale, and applies `global_scale` (weight_scale_2) once per
// output, so the rounding differs from dequantise-then-matmul only in summation order.
struct Nvfp4GemvParams {
  const std::uint8_t* packed = nullptr;  // [n, k / 2]
  const std::uint8_t* scales = nullptr;  // [n, k / 16]
  float global_scale = 1.0f;
  const float* x = nullptr;  // [m, k]
  float* y = nullptr;        // [m, n]
  std::int64_t m = 1;        // 1 for decode, 1 + drafts when verifying MTP
  std::int64_t n = 0;
  std::int64_t k = 0;
};

// INVALID_ARGUMENT for a null pointer, a non-positive size, k not a multiple of 16 or a
// non-finite global scale. Threads split n.
absl::Status Nvfp4Gemv(const Nvfp4GemvParams& params, int threads = 1);

}  // namespace nq::kernels::cpu
