#include "kernels/cuda/stream_pool.h"

#include <cstdint>
#include <limits>

#include "kernels/cuda/cuda_util.h"
#include "services/common/status_macros.h"

namespace nq::kernels::cuda {

absl::StatusOr<std::shared_ptr<StreamPool>> StreamPool::Create(int device) {
  NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  // The side stream at the device's greatest priority, the main stream at its least, kept in
  // graphs (CudaBackend::EndCapture instantiates with node priorities): the side stream's short
  // kernels (the shared expert, the gram) then take SMs as the main stream's blocks leave, not
  // after its queue. GLM-5 slice +0.5-0.8 % on an H100, DeepSeek-V3 -0.2 %; the opposite order
  // cost 2.7 % (bench/README.md, "The reorderings measured, the side stream first, the router in BF16").
  int least = 0, greatest = 0;
  NQ_CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  const int priorities[2] = {least, greatest};  // main, side
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
  // Streams and events made so far, destroyed again if a later step fails.
  cudaStream_t streams[2] = {nullptr, nullptr};
  cudaEvent_t events[2] = {nullptr, nullptr};
  auto undo = [&] {
    for (cudaEvent_t event : events) {
      if (event != nullptr) cudaEventDestroy(event);
    }
    for (cudaStream_t stream : streams) {
      if (stream != nullptr) cudaStreamDestroy(stream);
    }
    cudaMemPoolDestroy(pool);
  };
  for (int i = 0; i < 2; ++i) {
    if (const cudaError_t error = cudaStreamCreateWithPriority(&streams[i], cudaStreamNonBlocking, priorities[i]);
        error != cudaSuccess) {
      undo();
      return CudaStatus(error, "cudaStreamCreateWithPriority");
    }
  }
  for (cudaEvent_t& event : events) {
    if (const cudaError_t error = cudaEventCreateWithFlags(&event, cudaEventDisableTiming); error != cudaSuccess) {
      undo();
      return CudaStatus(error, "cudaEventCreateWithFlags");
    }
  }
  std::shared_ptr<StreamPool> made(new StreamPool(device, streams[0], streams[1], events[0], events[1], pool));
  // A decode step's side work frees a few dozen tensors; Free must not allocate (it is noexcept).
  made->held_frees_.reserve(1024);
  return made;
}

StreamPool::~StreamPool() {
  // Every block was freed on a stream (each storage holds this object); wait for those frees
  // before the pool goes.
  for (void* data : held_frees_) FreeOnMainStream(data);
  cudaStreamSynchronize(side_);
  cudaStreamSynchronize(stream_);
  cudaEventDestroy(fork_);
  cudaEventDestroy(join_);
  cudaMemPoolDestroy(pool_);
  cudaStreamDestroy(side_);
  cudaStreamDestroy(stream_);
}

absl::StatusOr<void*> StreamPool::Allocate(std::size_t bytes) {
  void* data = nullptr;
  cudaError_t error = cudaMallocFromPoolAsync(&data, bytes, pool_, current());
  if (error == cudaErrorMemoryAllocation && !side_open_) {
    cudaGetLastError();  // clear the sticky-free allocation error before retrying
    RETURN_IF_ERROR(Trim());
    error = cudaMallocFromPoolAsync(&data, bytes, pool_, current());
  }
  if (error != cudaSuccess) {
    cudaGetLastError();
    return CudaStatus(error, "cudaMallocFromPoolAsync");
  }
  return data;
}

void StreamPool::Free(void* data) noexcept {
  if (data == nullptr) return;
  if (side_open_ && held_frees_.size() < held_frees_.capacity()) {
    held_frees_.push_back(data);
    return;
  }
  if (side_open_) {
    // More frees in one side work than were reserved for: wait for the side stream, after which
    // freeing on the main stream is ordered after every use on either stream.
    cudaStreamSynchronize(side_);
  }
  FreeOnMainStream(data);
}

void StreamPool::FreeOnMainStream(void* data) noexcept {
  if (cudaFreeAsync(data, stream_) != cudaSuccess) {
    cudaGetLastError();  // the failure is not the next launch's
    failed_frees_.fetch_add(1, std::memory_order_relaxed);
  }
}

absl::Status StreamPool::Trim() {
  NQ_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(side_));
  NQ_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  NQ_CUDA_RETURN_IF_ERROR(cudaMemPoolTrimTo(pool_, 0));
  return absl::OkStatus();
}

absl::Status StreamPool::BeginSide() {
  NQ_CUDA_RETURN_IF_ERROR(cudaEventRecord(fork_, stream_));
  NQ_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side_, fork_, 0));
  on_side_ = true;
  side_open_ = true;
  return absl::OkStatus();
}

absl::Status StreamPool::JoinSide() {
  on_side_ = false;
  side_open_ = false;
  cudaError_t error = cudaEventRecord(join_, side_);
  if (error == cudaSuccess) error = cudaStreamWaitEvent(stream_, join_, 0);
  if (error != cudaSuccess) {
    // Without the join the main stream is not ordered after the side: wait for the side instead,
    // so the held frees below are still safe.
    cudaStreamSynchronize(side_);
  }
  for (void* data : held_frees_) FreeOnMainStream(data);
  held_frees_.clear();
  if (error != cudaSuccess) return CudaStatus(error, "joining the side stream");
  return absl::OkStatus();
}

}  // namespace nq::kernels::cuda
