// The CUDA backend (DESIGN.md "Backends": production path, Hopper first). Its class lives in
// cuda_backend.cu; callers go through CreateBackend("cuda") or this factory, so this header needs
// no CUDA headers.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace nq::kernels::cuda {

// A backend on CUDA device `device`, with its own non-blocking stream. FailedPreconditionError
// when there is no usable device (no driver or device, or the kernels were not built for its
// architecture); InvalidArgumentError for an ordinal out of range.
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device);

}  // namespace nq::kernels::cuda
