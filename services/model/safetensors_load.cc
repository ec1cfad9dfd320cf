#include "services/model/safetensors_load.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "services/common/status_macros.h"
#include "services/model/safetensors_json.h"

namespace nq::model {
namespace {

std::string ShapeString(std::span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace

absl::StatusOr<std::vector<float>> DequantizeFp8Block(const TensorView& weight,
                                                      const TensorView& scale_inv,
                                                      int64_t block) {
  const std::string context = absl::StrCat("FP8 tensor ", QuoteForMessage(weight.name),
                                           " with scale ", QuoteForMessage(scale_inv.name));
  if (weight.dtype != DType::kF8E4M3 || weight.shape.size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(context, ": the weight must be 2-D F8_E4M3, got ",
                                                   DTypeName(weight.dtype), " ",
                                                   ShapeString(weight.shape)));
  }
  if (scale_inv.shape.size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(context, ": the scale must be 2-D, got shape ",
                                                   ShapeString(scale_inv.shape)));
  }
  absl::StatusOr<std::vector<float>> scales = ConvertToFloat32(scale_inv.dtype, scale_inv.data);
  if (!scales.ok()) return Annotate(scales.status(), context);
  Fp8BlockTensor tensor;
  tensor.codes = weight.data;
  tensor.rows = weight.shape[0];
  tensor.cols = weight.shape[1];
  tensor.scale_inv = *scales;
  tensor.scale_rows = scale_inv.shape[0];
  tensor.scale_cols = scale_inv.shape[1];
  tensor.block = block;
  absl::StatusOr<std::vector<float>> out = DequantizeFp8Block(tensor);
  if (!out.ok()) return Annotate(out.status(), context);
  return out;
}

absl::StatusOr<FloatTensor> LoadFloat32(const Checkpoint& checkpoint, absl::string_view name) {
  ASSIGN_OR_RETURN(const TensorView view, checkpoint.Find(name));
  FloatTensor out;
  out.shape.assign(view.shape.begin(), view.shape.end());
  if (view.dtype != DType::kF8E4M3) {
    absl::StatusOr<std::vector<float>> values = ConvertToFloat32(view.dtype, view.data);
    if (!values.ok()) {
      return Annotate(values.status(), absl::StrCat("tensor ", QuoteForMessage(name), " in ",
                                                    checkpoint.path()));
    }
    out.values = *std::move(values);
    return out;
  }
  const std::string scale_name = absl::StrCat(name, kScaleInvSuffix);
  absl::StatusOr<TensorView> scale = checkpoint.Find(scale_name);
  if (!scale.ok()) {
    return absl::NotFoundError(absl::StrCat(
        "FP8 tensor ", QuoteForMessage(name), " needs its block scale ",
        QuoteForMessage(scale_name), ", which checkpoint ", checkpoint.path(), " does not hold"));
  }
  ASSIGN_OR_RETURN(out.values, DequantizeFp8Block(view, *scale));
  return out;
}

}  // namespace nq::model
