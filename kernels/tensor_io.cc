#include "kernels/tensor_io.h"

#include <cstddef>
#include <utility>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

namespace nq::kernels {
namespace {

absl::Status CheckCount(absl::string_view op, std::size_t values, const Shape& shape) {
  ASSIGN_OR_RETURN(const std::int64_t count, shape.CheckedNumElements());
  if (static_cast<std::uint64_t>(count) == values) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(op, ": ", values, " values for shape ",
                                                 shape.ToString(), " (", count, " elements)"));
}

}  // namespace

absl::StatusOr<Tensor> UploadFloats(Backend& backend, std::span<const float> values, DType dtype,
                                    Shape shape) {
  if (!IsFloatDType(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("UploadFloats: ", DTypeName(dtype), " is not a float dtype"));
  }
  RETURN_IF_ERROR(CheckCount("UploadFloats", values.size(), shape));
  ASSIGN_OR_RETURN(Tensor tensor, backend.Allocate(dtype, std::move(shape)));
  RETURN_IF_ERROR(VisitFloatDType(dtype, [&](auto tag) -> absl::Status {
    using T = decltype(tag);
    std::vector<T> converted(values.size());
    for (std::size_t i = 0; i < values.size(); ++i) converted[i] = FromFloat<T>(values[i]);
    return backend.CopyFromHost(std::as_bytes(std::span<const T>(converted)), tensor);
  }));
  return tensor;
}

absl::StatusOr<std::vector<float>> DownloadFloats(Backend& backend, const Tensor& tensor) {
  if (!tensor.valid()) return absl::InvalidArgumentError("DownloadFloats: empty tensor");
  if (!IsFloatDType(tensor.dtype())) {
    return absl::InvalidArgumentError(
        absl::StrCat("DownloadFloats: ", tensor.DebugString(), " is not a float tensor"));
  }
  std::vector<float> out(static_cast<std::size_t>(tensor.NumElements()));
  RETURN_IF_ERROR(VisitFloatDType(tensor.dtype(), [&](auto tag) -> absl::Status {
    using T = decltype(tag);
    std::vector<T> raw(out.size());
    RETURN_IF_ERROR(backend.CopyToHost(tensor, std::as_writable_bytes(std::span<T>(raw))));
    for (std::size_t i = 0; i < raw.size(); ++i) out[i] = ToFloat(raw[i]);
    return absl::OkStatus();
  }));
  return out;
}

absl::StatusOr<Tensor> UploadInt32s(Backend& backend, std::span<const std::int32_t> values,
                                    Shape shape) {
  RETURN_IF_ERROR(CheckCount("UploadInt32s", values.size(), shape));
  ASSIGN_OR_RETURN(Tensor tensor, backend.Allocate(DType::kI32, std::move(shape)));
  RETURN_IF_ERROR(backend.CopyFromHost(std::as_bytes(values), tensor));
  return tensor;
}

absl::StatusOr<std::vector<std::int32_t>> DownloadInt32s(Backend& backend, const Tensor& tensor) {
  if (!tensor.valid()) return absl::InvalidArgumentError("DownloadInt32s: empty tensor");
  if (tensor.dtype() != DType::kI32) {
    return absl::InvalidArgumentError(
        absl::StrCat("DownloadInt32s: ", tensor.DebugString(), " is not an I32 tensor"));
  }
  std::vector<std::int32_t> out(static_cast<std::size_t>(tensor.NumElements()));
  RETURN_IF_ERROR(backend.CopyToHost(tensor, std::as_writable_bytes(std::span(out))));
  return out;
}

}  // namespace nq::kernels
