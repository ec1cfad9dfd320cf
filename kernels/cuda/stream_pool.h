// The CUDA backend's stream and the stream-ordered memory pool its tensors come from.
//
// A decode step allocates and frees dozens of intermediates per layer. With cudaMalloc/cudaFree
// every free waits for the whole device, so the host stalls at each op and the GPU idles between
// them. Tensors instead come from a pool on the backend's one stream (cudaMallocFromPoolAsync /
// cudaFreeAsync): a freed block is reused by the next allocation in stream order, nothing waits,
// and allocations inside a stream capture become graph memory nodes.
//
// Freed blocks stay cached in the pool (release threshold: never), as PyTorch's caching allocator
// does; Trim() hands them back to the device (the backend does it when an allocation fails and
// in Synchronize, so memory other allocators need after a load is not held).
//
// Every DeviceStorage holds a reference to this object, so the stream and the pool outlive the last
// tensor even when the Backend is destroyed first.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>

#include "absl/status/statusor.h"

namespace nq::kernels::cuda {

class StreamPool {
 public:
  // A non-blocking stream and a pool of device memory on `device`.
  static absl::StatusOr<std::shared_ptr<StreamPool>> Create(int device);
  ~StreamPool();
  StreamPool(const StreamPool&) = delete;
  StreamPool& operator=(const StreamPool&) = delete;

  cudaStream_t stream() const { return stream_; }
  int device() const { return device_; }

  // Stream-ordered allocation: usable by work enqueued on stream() after this call (and by other
  // streams once they wait for it). On cudaErrorMemoryAllocation the pool waits for the stream,
  // returns its cached blocks to the device and tries once more.
  absl::StatusOr<void*> Allocate(std::size_t bytes);
  // Stream-ordered free: the block is reused only by work enqueued after every use already on
  // the stream. Never fails loudly (destructor path); a failure is ignored.
  void Free(void* data) noexcept;
  // Waits for the stream, then releases every cached free block to the device.
  absl::Status Trim();

 private:
  StreamPool(int device, cudaStream_t stream, cudaMemPool_t pool)
      : device_(device), stream_(stream), pool_(pool) {}

  int device_;
  cudaStream_t stream_;
  cudaMemPool_t pool_;
};

}  // namespace nq::kernels::cuda
