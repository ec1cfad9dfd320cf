// FP8 E4M3 weights with 128 x 128 block scales, made on the host: the layout DeepSeek-V3's and
// GLM-5's FP8 checkpoints store (w ≈ float(fp8) * scale_inv[row / 128, col / 128]) and
// Backend::MatMulBlockScaled reads. The model loader uses it to keep dense matrices at one byte
// per weight (--weight_dtype fp8): a matrix read from an FP8 checkpoint comes back to its stored
// bytes (its block's largest magnitude maps to 448 again), a BF16 one is quantized the same way.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/dtype.h"

namespace nq::kernels {

// `f` rounded to the nearest E4M3 value (ties to even), saturating at +-448; NaN gives 0x7f
// (with f's sign bit).
F8E4M3 ToF8E4M3(float f);

// Blocks of kWeightScaleBlock along a dimension of d weights: one side of the scale grid.
constexpr std::int64_t WeightScaleBlocks(std::int64_t d) { return (d + kWeightScaleBlock - 1) / kWeightScaleBlock; }

struct BlockScaledFp8 {
  std::vector<F8E4M3> values;    // [rows, cols], row-major
  std::vector<float> scale_inv;  // [scale_rows, scale_cols], row-major
  std::int64_t scale_rows = 0;   // WeightScaleBlocks(rows)
  std::int64_t scale_cols = 0;   // WeightScaleBlocks(cols)
};

// Quantizes a row-major [rows, cols] matrix block by block: scale_inv = amax(|block|) / 448 (1
// for an all-zero block), values = ToF8E4M3(w / scale_inv). InvalidArgumentError when `w` does
// not hold rows * cols values or holds an infinity or NaN (a checkpoint that is already broken).
absl::StatusOr<BlockScaledFp8> QuantizeBlockScaledFp8(std::span<const float> w, std::int64_t rows, std::int64_t cols);

}  // namespace nq::kernels
