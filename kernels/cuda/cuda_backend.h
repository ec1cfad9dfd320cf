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
// architecture); InvalidArgumentError for an ordinal out of range. `decode_gemv`: as
// BackendOptions::cuda_decode_gemv.
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device, DecodeGemv decode_gemv = DecodeGemv::kAuto);

// The cudaStream_t `backend`'s ops run on, or null when it is not a CUDA backend. For the
// tensor-parallel collectives (NCCL), which must enqueue on the same stream to order with the
// model's kernels and to be captured with them (services/worker/tp_nccl.h).
void* NativeStream(const Backend& backend);

}  // namespace nq::kernels::cuda
