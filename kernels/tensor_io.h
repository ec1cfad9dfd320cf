// Host <-> backend transfers with dtype conversion, for tests, tools and small host-side inputs.
// Weight loading moves raw checkpoint bytes with Backend::CopyFromHost instead.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace nq::kernels {

// A new tensor of float `dtype` (F32, BF16, F16) and `shape` holding `values` (rounded to nearest
// even for 16-bit dtypes). InvalidArgumentError when values.size() differs from the shape's
// element count or `dtype` is not a float dtype.
absl::StatusOr<Tensor> UploadFloats(Backend& backend, std::span<const float> values, DType dtype,
                                    Shape shape);

// The tensor's elements widened to float; waits for the work that produces them.
// InvalidArgumentError for a tensor of a non-float dtype.
absl::StatusOr<std::vector<float>> DownloadFloats(Backend& backend, const Tensor& tensor);

// A new I32 tensor of `shape` holding `values`; the same errors as UploadFloats.
absl::StatusOr<Tensor> UploadInt32s(Backend& backend, std::span<const std::int32_t> values,
                                    Shape shape);

// The elements of an I32 tensor; waits for the work that produces them. InvalidArgumentError for
// another dtype.
absl::StatusOr<std::vector<std::int32_t>> DownloadInt32s(Backend& backend, const Tensor& tensor);

}  // namespace nq::kernels
