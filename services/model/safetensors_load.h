// Loading checkpoint tensors as fp32, dequantizing FP8 block-quantized weights with their
// scales as the hub checkpoints store them.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "services/model/dtype_convert.h"
#include "services/model/safetensors.h"
#include "services/model/safetensors_writer.h"

namespace nq::model {

struct FloatTensor {
  std::vector<int64_t> shape;
  std::vector<float> values;  // row-major, numel(shape) values
};

// Dequantizes a 2-D F8_E4M3 `weight` [rows, cols] with its `scale_inv`
// [ceil(rows / block), ceil(cols / block)] (F32, or BF16 / F16, converted first).
// INVALID_ARGUMENT naming both tensors when a dtype or shape is wrong.
absl::StatusOr<std::vector<float>> DequantizeFp8Block(const TensorView& weight,
                                                      const TensorView& scale_inv,
                                                      int64_t block = kFp8BlockSize);

// Tensor `name` of `checkpoint` as fp32. F32, F64, BF16, F16 and F8_E5M2 convert directly;
// F8_E4M3 is dequantized with `name + kScaleInvSuffix` ("x.weight" -> "x.weight_scale_inv")
// in 128x128 blocks. NOT_FOUND for a missing tensor or a missing scale (naming both),
// INVALID_ARGUMENT for a mis-shaped scale, a non-2-D FP8 tensor, or a non-float dtype.
absl::StatusOr<FloatTensor> LoadFloat32(const Checkpoint& checkpoint, absl::string_view name);

}  // namespace nq::model
