// RAII owners for the dense prefill's resources (STYLE.md 9): a cuBLAS handle, events and a
// pinned host buffer. Kept apart from cuda_handles.h so only code that uses cuBLAS includes its
// header. Destructors never throw; a failure while releasing has no one to report to.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_util.h"

namespace nq::kernels::cuda {

class BlasHandle {
 public:
  BlasHandle() = default;
  static absl::StatusOr<BlasHandle> Create() {
    cublasHandle_t handle = nullptr;
    const cublasStatus_t status = cublasCreate(&handle);
    if (status != CUBLAS_STATUS_SUCCESS) {
      return absl::InternalError(absl::StrCat("cublasCreate failed: ", cublasGetStatusString(status)));
    }
    return BlasHandle(handle);
  }
  BlasHandle(BlasHandle&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
  BlasHandle& operator=(BlasHandle&& other) noexcept {
    if (this != &other) {
      Reset();
      handle_ = std::exchange(other.handle_, nullptr);
    }
    return *this;
  }
  ~BlasHandle() { Reset(); }

  cublasHandle_t get() const { return handle_; }

 private:
  explicit BlasHandle(cublasHandle_t handle) : handle_(handle) {}
  void Reset() {
    if (handle_ != nullptr) cublasDestroy(handle_);
    handle_ = nullptr;
  }

  cublasHandle_t handle_ = nullptr;
};

// A cudaEvent_t without timing (cross-stream ordering only).
class CudaEvent {
 public:
  CudaEvent() = default;
  static absl::StatusOr<CudaEvent> Create() {
    cudaEvent_t event = nullptr;
    NQ_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    return CudaEvent(event);
  }
  CudaEvent(CudaEvent&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}
  CudaEvent& operator=(CudaEvent&& other) noexcept {
    if (this != &other) {
      Reset();
      event_ = std::exchange(other.event_, nullptr);
    }
    return *this;
  }
  ~CudaEvent() { Reset(); }

  cudaEvent_t get() const { return event_; }

 private:
  explicit CudaEvent(cudaEvent_t event) : event_(event) {}
  void Reset() {
    if (event_ != nullptr) cudaEventDestroy(event_);
    event_ = nullptr;
  }

  cudaEvent_t event_ = nullptr;
};

// Page-locked host memory (cudaMallocHost): device-to-host copies into it are asynchronous.
class PinnedHostBuffer {
 public:
  PinnedHostBuffer() = default;
  static absl::StatusOr<PinnedHostBuffer> Allocate(std::size_t bytes) {
    void* data = nullptr;
    NQ_CUDA_RETURN_IF_ERROR(cudaMallocHost(&data, bytes));
    return PinnedHostBuffer(data, bytes);
  }
  PinnedHostBuffer(PinnedHostBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  PinnedHostBuffer& operator=(PinnedHostBuffer&& other) noexcept {
    if (this != &other) {
      Reset();
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  ~PinnedHostBuffer() { Reset(); }

  void* get() const { return data_; }
  std::size_t bytes() const { return bytes_; }

 private:
  PinnedHostBuffer(void* data, std::size_t bytes) : data_(data), bytes_(bytes) {}
  void Reset() {
    if (data_ != nullptr) cudaFreeHost(data_);
    data_ = nullptr;
    bytes_ = 0;
  }

  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace nq::kernels::cuda
