// NVFP4 element and scale codes, shared by host code and CUDA kernels (no absl, no CUDA
// headers), so the CPU reference GEMV, the quantizer and a future device kernel decode the
// same way.
//
// NVFP4 as NVIDIA ModelOpt stores a [rows, cols] weight (its NVFP4QTensor):
//   weight        U8 [rows, cols / 2]: E2M1 codes, two per byte. Element 2j sits in the LOW
//                 nibble of byte j, element 2j + 1 in the HIGH nibble.
//   weight_scale  F8_E4M3 [rows, cols / 16]: one scale per block of 16 consecutive elements
//                 along the input (last) dim.
//   weight_scale_2  F32 scalar: the per-tensor global scale.
//   value[r][c] = E2M1(code[r][c]) * E4M3(weight_scale[r][c / 16]) * weight_scale_2
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/dtype.h"

namespace nq::kernels {

// Elements per block scale (ModelOpt's group_size for NVFP4).
inline constexpr int kNvfp4BlockSize = 16;
// Largest E2M1 magnitude (exponent 3, mantissa 1: 1.5 * 2^2).
inline constexpr float kE2M1Max = 6.0f;

// E2M1 code (bit 3 sign, bits 2..1 exponent with bias 1, bit 0 mantissa) -> value. The eight
// magnitudes are 0, 0.5, 1, 1.5, 2, 3, 4, 6; code 8 is -0.
NQ_HOST_DEVICE float E2M1ToFloat(std::uint8_t code) {
  const int exponent = (code >> 1) & 3;
  const int mantissa = code & 1;
  // Exponent 0 is subnormal: 0.5 * mantissa. Otherwise (1 + mantissa / 2) * 2^(exponent - 1).
  const float magnitude = exponent == 0 ? 0.5f * static_cast<float>(mantissa)
                                        : (1.0f + 0.5f * static_cast<float>(mantissa)) *
                                              static_cast<float>(1 << exponent) * 0.5f;
  return (code & 8) != 0 ? -magnitude : magnitude;
}

// float8_e4m3fn code -> value: bias 7, no infinities, exponent 0 is subnormal (m * 2^-9),
// 0x7F / 0xFF are NaN.
NQ_HOST_DEVICE float E4M3ToFloat(std::uint8_t code) {
  const int exponent = (code >> 3) & 15;
  const int mantissa = code & 7;
  float magnitude;
  if (exponent == 15 && mantissa == 7) {
    magnitude = NAN;
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -9);
  } else {
    magnitude = std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
  }
  return (code & 0x80) != 0 ? -magnitude : magnitude;
}

}  // namespace nq::kernels
