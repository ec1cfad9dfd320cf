#include "services/nvfp4/nvfp4_format.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "services/common/status_macros.h"

namespace nq::nvfp4 {
namespace {

std::string ShapeText(std::span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace

uint8_t FloatToE2M1(float value) {
  const uint8_t sign = value < 0.0f ? 8 : 0;
  const float a = std::fabs(value);
  // Midpoints between neighbouring magnitudes; at a midpoint the even code (mantissa 0) wins,
  // so the comparison is <= toward even codes and < toward odd ones.
  uint8_t magnitude;
  if (a <= 0.25f) {
    magnitude = 0;  // 0 (even)
  } else if (a < 0.75f) {
    magnitude = 1;  // 0.5
  } else if (a <= 1.25f) {
    magnitude = 2;  // 1 (even)
  } else if (a < 1.75f) {
    magnitude = 3;  // 1.5
  } else if (a <= 2.5f) {
    magnitude = 4;  // 2 (even)
  } else if (a < 3.5f) {
    magnitude = 5;  // 3
  } else if (a <= 5.0f) {
    magnitude = 6;  // 4 (even)
  } else {
    magnitude = 7;  // 6, and everything above it saturates here
  }
  return sign | magnitude;
}

absl::Status ValidateView(const Nvfp4View& view) {
  if (view.rows < 0 || view.cols < 0 || view.cols % kBlockSize != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("NVFP4 tensor [", view.rows, ", ", view.cols, "]: cols must be a multiple of 16"));
  }
  const uint64_t want_packed = static_cast<uint64_t>(view.rows) * view.cols / 2;
  const uint64_t want_scales = static_cast<uint64_t>(view.rows) * view.cols / kBlockSize;
  if (view.packed.size() != want_packed || view.scales.size() != want_scales) {
    return absl::InvalidArgumentError(absl::StrCat(
        "NVFP4 tensor [", view.rows, ", ", view.cols, "]: want ", want_packed, " packed bytes and ",
        want_scales, " scales, got ", view.packed.size(), " and ", view.scales.size()));
  }
  if (!std::isfinite(view.scale_2) || view.scale_2 <= 0.0f) {
    return absl::InvalidArgumentError(absl::StrCat("NVFP4 global scale must be finite and > 0, got ", view.scale_2));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> Dequantize(const Nvfp4View& view) {
  RETURN_IF_ERROR(ValidateView(view));
  std::vector<float> out(static_cast<size_t>(view.rows * view.cols));
  const int64_t blocks_per_row = view.cols / kBlockSize;
  for (int64_t r = 0; r < view.rows; ++r) {
    for (int64_t b = 0; b < blocks_per_row; ++b) {
      const float scale = kernels::E4M3ToFloat(view.scales[r * blocks_per_row + b]) * view.scale_2;
      for (int64_t j = 0; j < kBlockSize; ++j) {
        const int64_t c = b * kBlockSize + j;
        const uint8_t byte = view.packed[(r * view.cols + c) / 2];
        const uint8_t code = (c % 2 == 0) ? (byte & 0x0F) : (byte >> 4);
        out[r * view.cols + c] = kernels::E2M1ToFloat(code) * scale;
      }
    }
  }
  return out;
}

std::string ScaleName(absl::string_view weight_name) { return absl::StrCat(weight_name, kScaleSuffix); }
std::string Scale2Name(absl::string_view weight_name) { return absl::StrCat(weight_name, kScale2Suffix); }

absl::StatusOr<float> ReadScalarScale(const model::TensorView& view) {
  if (view.dtype != model::DType::kF32 || view.numel() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(view.name, ": a global scale must be one F32 value, got ",
                                                   model::DTypeName(view.dtype), " ", ShapeText(view.shape)));
  }
  float value;
  std::memcpy(&value, view.data.data(), sizeof(value));
  if (!std::isfinite(value) || value <= 0.0f) {
    return absl::InvalidArgumentError(absl::StrCat(view.name, ": global scale must be finite and > 0, got ", value));
  }
  return value;
}

absl::StatusOr<Nvfp4View> ReadNvfp4(const model::Checkpoint& checkpoint, absl::string_view weight_name) {
  ASSIGN_OR_RETURN(const model::TensorView weight, checkpoint.Find(weight_name));
  ASSIGN_OR_RETURN(const model::TensorView scale, checkpoint.Find(ScaleName(weight_name)));
  ASSIGN_OR_RETURN(const model::TensorView scale_2, checkpoint.Find(Scale2Name(weight_name)));
  if (weight.dtype != model::DType::kU8 || weight.shape.size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(weight_name, ": an NVFP4 weight is U8 [rows, cols / 2], got ",
                                                   model::DTypeName(weight.dtype), " ", ShapeText(weight.shape)));
  }
  Nvfp4View view;
  view.rows = weight.shape[0];
  view.cols = weight.shape[1] * 2;
  if (scale.dtype != model::DType::kF8E4M3 || scale.shape.size() != 2 || scale.shape[0] != view.rows ||
      scale.shape[1] * kBlockSize != view.cols) {
    return absl::InvalidArgumentError(absl::StrCat(scale.name, ": want F8_E4M3 [", view.rows, ", ",
                                                   view.cols / kBlockSize, "], got ", model::DTypeName(scale.dtype),
                                                   " ", ShapeText(scale.shape)));
  }
  ASSIGN_OR_RETURN(view.scale_2, ReadScalarScale(scale_2));
  view.packed = {reinterpret_cast<const uint8_t*>(weight.data.data()), weight.data.size()};
  view.scales = {reinterpret_cast<const uint8_t*>(scale.data.data()), scale.data.size()};
  RETURN_IF_ERROR(ValidateView(view));
  return view;
}

}  // namespace nq::nvfp4
