#include "services/worker/gpu_memory.h"

#include "absl/status/status.h"

#ifdef NQ_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#endif

namespace nq::worker {

absl::StatusOr<GpuMemory> QueryGpuMemory(int gpu) {
#ifdef NQ_HAVE_CUDA
  // The current device is per thread: set it on the calling thread (a metrics scrape runs on an
  // HTTP thread).
  if (const cudaError_t error = cudaSetDevice(gpu); error != cudaSuccess) {
    return absl::FailedPreconditionError(absl::StrCat("cudaSetDevice(", gpu, "): ", cudaGetErrorString(error)));
  }
  size_t free = 0, total = 0;
  if (const cudaError_t error = cudaMemGetInfo(&free, &total); error != cudaSuccess) {
    return absl::InternalError(absl::StrCat("cudaMemGetInfo on device ", gpu, ": ", cudaGetErrorString(error)));
  }
  return GpuMemory{.free = free, .total = total};
#else
  (void)gpu;
  return absl::UnimplementedError("GPU memory needs a build with CUDA");
#endif
}

}  // namespace nq::worker
