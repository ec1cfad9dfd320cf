#include "kernels/moe_op_checks.h"

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

namespace nq::kernels {

absl::Status CheckMoeTensor(absl::string_view op, absl::string_view arg, const Tensor& t, DType dtype,
                            const Shape& shape) {
  if (t.dtype() != dtype || t.shape() != shape) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ", arg, " is ", t.DebugString(), ", want ", DTypeName(dtype), shape.ToString()));
  }
  return absl::OkStatus();
}

absl::StatusOr<MoeTokens> CheckMoeActivations(absl::string_view op, const Tensor& x, const Tensor& expert_ids,
                                              const Tensor& expert_weights, const Tensor& out,
                                              std::int64_t hidden) {
  if (x.shape().rank() != 2 || x.shape().dim(1) != hidden || x.dtype() != DType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": x is ", x.DebugString(), ", want F32[T, ", hidden, "]"));
  }
  const std::int64_t T = x.shape().dim(0);
  if (expert_ids.shape().rank() != 2 || expert_ids.shape().dim(0) != T || expert_ids.shape().dim(1) < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": expert_ids is ", expert_ids.DebugString(), ", want I32[", T, ", K] with K >= 1"));
  }
  const std::int64_t K = expert_ids.shape().dim(1);
  RETURN_IF_ERROR(CheckMoeTensor(op, "expert_ids", expert_ids, DType::kI32, Shape{T, K}));
  RETURN_IF_ERROR(CheckMoeTensor(op, "expert_weights", expert_weights, DType::kF32, Shape{T, K}));
  RETURN_IF_ERROR(CheckMoeTensor(op, "out", out, DType::kF32, Shape{T, hidden}));
  if (out.data() == x.data()) return absl::InvalidArgumentError(absl::StrCat(op, ": out must not alias x"));
  return MoeTokens{.tokens = T, .top_k = K};
}

}  // namespace nq::kernels
