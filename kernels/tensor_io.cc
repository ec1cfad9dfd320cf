#include "kernels/tensor_io.h"

#include <cstddef>
#include <utility>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

namespace nq::kernels {

absl::StatusOr<Tensor> UploadFloats(Backend& backend, std::span<const float> values, DType dtype,
                                    Shape shape) {
  ASSIGN_OR_RETURN(const std::int64_t count, shape.CheckedNumElements());
  if (static_cast<std::uint64_t>(count) != values.size()) {
    return absl::InvalidArgumentError(absl::StrCat("UploadFloats: ", values.size(),
                                                   " values for shape ", shape.ToString(), " (",
                                                   count, " elements)"));
  }
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

}  // namespace nq::kernels
