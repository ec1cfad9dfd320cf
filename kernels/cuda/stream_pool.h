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

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"

namespace nq::kernels::cuda {

// Side work (Backend::BeginSideWork): a second stream forks from the main one and joins it
// again. While side work is open, Allocate uses the stream ops currently go to, and every Free is
// held until the join, when the main stream (then after both streams' work) frees it: a tensor the
// side stream used must not be reused by the main stream's next allocation while the side still
// runs, and this holds whichever stream the tensor dies on.
class StreamPool {
 public:
  // A non-blocking stream and a pool of device memory on `device`.
  static absl::StatusOr<std::shared_ptr<StreamPool>> Create(int device);
  ~StreamPool();
  StreamPool(const StreamPool&) = delete;
  StreamPool& operator=(const StreamPool&) = delete;

  // The main stream: graphs launch, captures begin and synchronisation happens here.
  cudaStream_t stream() const { return stream_; }
  // The stream ops go to now: the side stream between BeginSide and EndSide, else the main one.
  cudaStream_t current() const { return on_side_ ? side_ : stream_; }
  int device() const { return device_; }

  // Stream-ordered allocation: usable by work enqueued on current() after this call (and by other
  // streams once they wait for it). On cudaErrorMemoryAllocation the pool waits for the streams,
  // returns its cached blocks to the device and tries once more (not while side work is open:
  // then the held frees are not yet the pool's).
  absl::StatusOr<void*> Allocate(std::size_t bytes);
  // Stream-ordered free: the block is reused only by work enqueued after every use already on
  // the stream (held until the join while side work is open). Never fails loudly (destructor
  // path): a failure is counted (failed_frees) and its error cleared, so that it does not fail
  // the next, unrelated launch check (a capture's, when a block allocated before the capture is
  // freed inside it).
  void Free(void* data) noexcept;
  std::int64_t failed_frees() const { return failed_frees_.load(std::memory_order_relaxed); }
  // Waits for the streams, then releases every cached free block to the device.
  absl::Status Trim();

  // The side stream waits for everything enqueued on the main one so far; ops go to the side.
  absl::Status BeginSide();
  // Ops go to the main stream again; the side's keep running.
  void EndSide() { on_side_ = false; }
  // Back to the side stream of open side work, with no new wait on the main one.
  void ContinueSide() { on_side_ = true; }
  // The main stream waits for everything enqueued on the side; the held frees are freed there.
  // Closes the side work even when the wait fails (that error is returned).
  absl::Status JoinSide();

 private:
  StreamPool(int device, cudaStream_t stream, cudaStream_t side, cudaEvent_t fork, cudaEvent_t join,
             cudaMemPool_t pool)
      : device_(device), stream_(stream), side_(side), fork_(fork), join_(join), pool_(pool) {}

  int device_;
  cudaStream_t stream_;
  cudaStream_t side_;
  cudaEvent_t fork_;  // recorded on the main stream at BeginSide
  cudaEvent_t join_;  // recorded on the side stream at JoinSide
  cudaMemPool_t pool_;
  // cudaFreeAsync on the main stream; a failure counted and cleared (Free).
  void FreeOnMainStream(void* data) noexcept;

  bool on_side_ = false;
  bool side_open_ = false;
  std::vector<void*> held_frees_;
  std::atomic<std::int64_t> failed_frees_{0};
};

}  // namespace nq::kernels::cuda
