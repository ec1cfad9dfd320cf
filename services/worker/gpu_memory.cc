#include "services/worker/gpu_memory.h"

#include "absl/status/status.h"

#ifdef NQ_HAVE_CUDA
#include "kernels/cuda/cuda_util.h"
#endif

namespace nq::worker {

absl::StatusOr<GpuMemory> QueryGpuMemory(int gpu) {
#ifdef NQ_HAVE_CUDA
  // The current device is per thread: set it on the calling thread (a metrics scrape runs on an
  // HTTP thread).
  NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu));
  size_t free = 0, total = 0;
  NQ_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free, &total));
  return GpuMemory{.free = free, .total = total};
#else
  (void)gpu;
  return absl::UnimplementedError("GPU memory needs a build with CUDA");
#endif
}

}  // namespace nq::worker
