#include "kernels/cuda/stream_pool.h"

#include <cstdint>
#include <limits>

#include "kernels/cuda/cuda_util.h"
#include "services/common/status_macros.h"

namespace nq::kernels::cuda {

absl::StatusOr<std::shared_ptr<StreamPool>> StreamPool::Create(int device) {
  NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  cudaMemPool_t pool = nullptr;
  NQ_CUDA_RETURN_IF_ERROR(cudaMemPoolCreate(&pool, &props));
  // Keep freed blocks: returning them at every synchronisation would map and unmap device memory
  // once per decode step.
  std::uint64_t threshold = std::numeric_limits<std::uint64_t>::max();
  if (const cudaError_t error = cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold);
      error != cudaSuccess) {
    cudaMemPoolDestroy(pool);
    return CudaStatus(error, "cudaMemPoolSetAttribute(ReleaseThreshold)");
  }
  cudaStream_t stream = nullptr;
  if (const cudaError_t error = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); error != cudaSuccess) {
    cudaMemPoolDestroy(pool);
    return CudaStatus(error, "cudaStreamCreateWithFlags");
  }
  return std::shared_ptr<StreamPool>(new StreamPool(device, stream, pool));
}

StreamPool::~StreamPool() {
  // Every block was freed on the stream (each storage holds this object); wait for those frees
  // before the pool goes.
  cudaStreamSynchronize(stream_);
  cudaMemPoolDestroy(pool_);
  cudaStreamDestroy(stream_);
}

absl::StatusOr<void*> StreamPool::Allocate(std::size_t bytes) {
  void* data = nullptr;
  cudaError_t error = cudaMallocFromPoolAsync(&data, bytes, pool_, stream_);
  if (error == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // clear the sticky-free allocation error before retrying
    RETURN_IF_ERROR(Trim());
    error = cudaMallocFromPoolAsync(&data, bytes, pool_, stream_);
  }
  if (error != cudaSuccess) {
    cudaGetLastError();
    return CudaStatus(error, "cudaMallocFromPoolAsync");
  }
  return data;
}

void StreamPool::Free(void* data) noexcept {
  if (data != nullptr) cudaFreeAsync(data, stream_);
}

absl::Status StreamPool::Trim() {
  NQ_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  NQ_CUDA_RETURN_IF_ERROR(cudaMemPoolTrimTo(pool_, 0));
  return absl::OkStatus();
}

}  // namespace nq::kernels::cuda
