// RAII owners of CUDA runtime handles (STYLE.md 9). Destructors never throw; a failure while
// releasing has no one to report to and is ignored.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>

#include "absl/status/statusor.h"
#include "kernels/cuda/cuda_util.h"

namespace nq::kernels::cuda {

class CudaStream {
 public:
  CudaStream() = default;
  // A stream that does not synchronise with the legacy default stream.
  static absl::StatusOr<CudaStream> CreateNonBlocking() {
    cudaStream_t stream = nullptr;
    NQ_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    return CudaStream(stream);
  }
  CudaStream(CudaStream&& other) noexcept : stream_(std::exchange(other.stream_, nullptr)) {}
  CudaStream& operator=(CudaStream&& other) noexcept {
    if (this != &other) {
      Reset();
      stream_ = std::exchange(other.stream_, nullptr);
    }
    return *this;
  }
  ~CudaStream() { Reset(); }

  cudaStream_t get() const { return stream_; }

 private:
  explicit CudaStream(cudaStream_t stream) : stream_(stream) {}
  void Reset() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    stream_ = nullptr;
  }

  cudaStream_t stream_ = nullptr;
};

// A cudaMalloc'ed block. Freed with cudaFree, which waits for work still using it.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  static absl::StatusOr<DeviceBuffer> Allocate(std::size_t bytes) {
    void* data = nullptr;
    NQ_CUDA_RETURN_IF_ERROR(cudaMalloc(&data, bytes));
    return DeviceBuffer(data, bytes);
  }
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      Reset();
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  ~DeviceBuffer() { Reset(); }

  void* get() const { return data_; }
  std::size_t bytes() const { return bytes_; }

  void Reset() {
    if (data_ != nullptr) cudaFree(data_);
    data_ = nullptr;
    bytes_ = 0;
  }

 private:
  DeviceBuffer(void* data, std::size_t bytes) : data_(data), bytes_(bytes) {}

  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace nq::kernels::cuda
