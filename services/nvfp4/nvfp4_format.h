// NVFP4 weights as NVIDIA ModelOpt stores them in a Hugging Face checkpoint, and their
// decoding. Element and scale codes: kernels/nvfp4_codes.h (nibble order there: element 2j in
// the low nibble of byte j).
//
// For a linear `<module>.weight` of shape [rows, cols] (cols = input dim, a multiple of 16):
//   <module>.weight          U8      [rows, cols / 2]   packed E2M1 codes
//   <module>.weight_scale    F8_E4M3 [rows, cols / 16]  block scales
//   <module>.weight_scale_2  F32     []                 global scale
// (plus `input_scale`, F32 [], in W4A4 checkpoints: an activation global scale calibrated on
// data. This weight-only line writes none; see QuantizeCheckpoint.)
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/nvfp4_codes.h"
#include "services/model/safetensors.h"

namespace nq::nvfp4 {

inline constexpr int64_t kBlockSize = kernels::kNvfp4BlockSize;
inline constexpr float kE2M1Max = kernels::kE2M1Max;
// Largest finite float8_e4m3fn, the ceiling of a block scale.
inline constexpr float kScaleMax = 448.0f;
// Smallest positive float8_e4m3fn (a subnormal); ModelOpt clamps block scales up to it so a
// tiny block never gets scale 0.
inline constexpr float kScaleMin = 0x1p-9f;
// Tensor name suffixes appended to "<module>.weight".
inline constexpr absl::string_view kScaleSuffix = "_scale";
inline constexpr absl::string_view kScale2Suffix = "_scale_2";

// RNE onto the E2M1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6}, saturating at 6 (a larger magnitude is
// clipped); sign bit set for negative input (so -0.1 becomes code 8, "-0"). NaN is the caller's
// to refuse. Ties go to the even mantissa: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
// 2.5 -> 2, 3.5 -> 4, 5 -> 4 (ModelOpt's _cast_fp4 rounds the same way).
uint8_t FloatToE2M1(float value);

// A borrowed NVFP4 tensor (from a mapped checkpoint or an Nvfp4Tensor).
struct Nvfp4View {
  int64_t rows = 0;
  int64_t cols = 0;                  // unpacked input dim
  std::span<const uint8_t> packed;   // rows * cols / 2
  std::span<const uint8_t> scales;   // rows * cols / 16 E4M3 codes
  float scale_2 = 1.0f;
};

// An owned NVFP4 tensor.
struct Nvfp4Tensor {
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<uint8_t> packed;
  std::vector<uint8_t> scales;
  float scale_2 = 1.0f;

  Nvfp4View view() const { return {rows, cols, packed, scales, scale_2}; }
};

// INVALID_ARGUMENT unless cols % 16 == 0, rows, cols >= 0, the spans have the sizes above and
// scale_2 is finite and positive.
absl::Status ValidateView(const Nvfp4View& view);

// The [rows, cols] fp32 weight: E2M1 * (E4M3 scale * scale_2), the product of the two scales
// taken first as ModelOpt's dequantize does. Errors: ValidateView's.
absl::StatusOr<std::vector<float>> Dequantize(const Nvfp4View& view);

// "<module>.weight" -> "<module>.weight_scale" / "<module>.weight_scale_2".
std::string ScaleName(absl::string_view weight_name);
std::string Scale2Name(absl::string_view weight_name);

// Reads `weight_name` and its two scales from a checkpoint, checking dtypes (U8, F8_E4M3, F32)
// and shapes ([rows, cols / 2], [rows, cols / 16], a single element). Borrows from `checkpoint`.
// NOT_FOUND for a missing tensor; INVALID_ARGUMENT naming the tensor for a wrong dtype/shape.
absl::StatusOr<Nvfp4View> ReadNvfp4(const model::Checkpoint& checkpoint,
                                    absl::string_view weight_name);

// Reads a single-element F32 tensor (a `weight_scale_2`) from `view`. INVALID_ARGUMENT naming
// the tensor for another dtype or element count, or a value that is not finite and positive.
absl::StatusOr<float> ReadScalarScale(const model::TensorView& view);

}  // namespace nq::nvfp4
