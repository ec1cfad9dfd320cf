#include "kernels/tensor.h"

#include <limits>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace nq::kernels {

std::int64_t Shape::NumElements() const {
  std::int64_t n = 1;
  for (std::int64_t d : dims_) n *= d;
  return n;
}

absl::StatusOr<std::int64_t> Shape::CheckedNumElements() const {
  std::int64_t n = 1;
  for (std::int64_t d : dims_) {
    if (d < 0) {
      return absl::InvalidArgumentError(absl::StrCat("negative dimension in ", ToString()));
    }
    if (d != 0 && n > std::numeric_limits<std::int64_t>::max() / d) {
      return absl::InvalidArgumentError(
          absl::StrCat("element count of ", ToString(), " overflows"));
    }
    n *= d;
  }
  return n;
}

std::int64_t Shape::NumRows() const {
  if (dims_.empty()) return 1;
  std::int64_t n = 1;
  for (std::size_t i = 0; i + 1 < dims_.size(); ++i) n *= dims_[i];
  return n;
}

Shape Shape::WithLastDim(std::int64_t last) const {
  std::vector<std::int64_t> dims = dims_;
  if (!dims.empty()) dims.back() = last;
  return Shape(std::move(dims));
}

std::string Shape::ToString() const { return absl::StrCat("[", absl::StrJoin(dims_, ", "), "]"); }

absl::Status Tensor::Reshape(Shape shape) {
  if (!valid()) return absl::InvalidArgumentError("Reshape: the tensor is empty");
  absl::StatusOr<std::int64_t> count = shape.CheckedNumElements();
  if (!count.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("Reshape: ", count.status().message()));
  }
  if (*count != shape_.NumElements()) {
    return absl::InvalidArgumentError(absl::StrCat("Reshape: ", DebugString(), " has ",
                                                   shape_.NumElements(), " elements, ",
                                                   shape.ToString(), " has ", *count));
  }
  shape_ = std::move(shape);
  return absl::OkStatus();
}

std::string Tensor::DebugString() const {
  if (!valid()) return "<empty>";
  return absl::StrCat(DTypeName(dtype_), shape_.ToString());
}

}  // namespace nq::kernels
