// Host <-> backend transfers of float data with dtype conversion, for tests, tools and small
// host-side inputs. Weight loading moves raw checkpoint bytes with Backend::CopyFromHost instead.
#pragma once

#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace nq::kernels {

// A new tensor of `dtype` and `shape` holding `values` (rounded to nearest even for 16-bit
// dtypes). InvalidArgumentError when values.size() differs from the shape's element count.
absl::StatusOr<Tensor> UploadFloats(Backend& backend, std::span<const float> values, DType dtype,
                                    Shape shape);

// The tensor's elements widened to float; waits for the work that produces them.
absl::StatusOr<std::vector<float>> DownloadFloats(Backend& backend, const Tensor& tensor);

}  // namespace nq::kernels
