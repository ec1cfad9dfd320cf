// Conversions between the checkpoint dtypes and fp32, and FP8 128x128 block quantization as
// the FP8 hub checkpoints use it (DeepSeek-V3, GLM: quantization_config
// {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}).
//
// Byte buffers are little-endian, as safetensors stores them, and need no alignment: a
// tensor's bytes inside a mapped file may start at any offset.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "services/model/safetensors_header.h"

namespace nq::model {

// Largest finite float8_e4m3fn: 1.75 * 2^8 (exponent field 15, mantissa 110; 111 is NaN).
inline constexpr float kFp8E4M3Max = 448.0f;
// Edge of one FP8 scale block in both dims (weight_block_size in the hub configs).
inline constexpr int64_t kFp8BlockSize = 128;

// Scalar conversions. The *ToFloat ones are exact. The FloatTo* ones round to nearest, ties
// to even; NaN stays NaN (quiet), signs and signed zeros are kept.
float Bf16ToFloat(uint16_t bits);
uint16_t FloatToBf16(float value);  // overflow rounds to +-inf
float F16ToFloat(uint16_t bits);    // subnormals, +-inf and NaN included
uint16_t FloatToF16(float value);   // overflow (>= 65520) rounds to +-inf
// float8_e4m3fn: bias 7, no infinities, 0x7F / 0xFF are NaN, subnormals are m * 2^-9.
float Fp8E4M3ToFloat(uint8_t code);
// Saturating: |value| >= 448 (infinities included) becomes +-448.
uint8_t FloatToFp8E4M3(float value);

// Converts `bytes` holding elements of `dtype` to fp32. Supports F32, F64, BF16, F16,
// F8_E4M3 and F8_E5M2 (raw codes, no scale applied); INVALID_ARGUMENT for other dtypes or a
// byte count that is not a whole number of elements.
absl::StatusOr<std::vector<float>> ConvertToFloat32(DType dtype, std::span<const std::byte> bytes);
// Converts fp32 values to `dtype` bytes: F32, BF16, F16 or F8_E4M3 (saturating, unscaled);
// INVALID_ARGUMENT for other dtypes.
absl::StatusOr<std::vector<std::byte>> ConvertFromFloat32(std::span<const float> values,
                                                          DType dtype);

// A row-major [rows, cols] F8_E4M3 matrix with one fp32 scale per block x block tile:
// weight[r][c] = code[r][c] * scale_inv[r / block][c / block]. The edge tiles are partial
// when rows or cols is not a multiple of block, so the scale grid is
// [ceil(rows / block), ceil(cols / block)].
struct Fp8BlockTensor {
  std::span<const std::byte> codes;  // rows * cols codes
  int64_t rows = 0;
  int64_t cols = 0;
  std::span<const float> scale_inv;  // scale_rows * scale_cols, row-major
  int64_t scale_rows = 0;
  int64_t scale_cols = 0;
  int64_t block = kFp8BlockSize;
};

// The dequantized [rows, cols] fp32 matrix. INVALID_ARGUMENT when a size disagrees with the
// others (the message gives expected and actual shapes).
absl::StatusOr<std::vector<float>> DequantizeFp8Block(const Fp8BlockTensor& tensor);

struct Fp8BlockQuantized {
  std::vector<std::byte> codes;  // rows * cols F8_E4M3 codes
  std::vector<float> scale_inv;  // [scale_rows, scale_cols]
  int64_t scale_rows = 0;
  int64_t scale_cols = 0;
};

// Quantizes a row-major [rows, cols] fp32 matrix per block x block tile: the tile's scale is
// amax / 448 (1 for an all-zero tile), its codes are RNE(value / scale) saturated to 448,
// and scale_inv holds the scale itself (the hub's `weight_scale_inv` multiplies the codes).
// INVALID_ARGUMENT for a size mismatch or a non-finite value.
absl::StatusOr<Fp8BlockQuantized> QuantizeFp8Block(std::span<const float> values, int64_t rows,
                                                   int64_t cols, int64_t block = kFp8BlockSize);

}  // namespace nq::model
