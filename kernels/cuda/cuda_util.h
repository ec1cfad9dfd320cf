// CUDA runtime results as absl::Status (STYLE.md 5: every CUDA call and launch is checked), and
// the launch context every kernel family's launcher takes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace nq::kernels::cuda {

// OK for cudaSuccess. Otherwise: out of memory -> ResourceExhausted; no device, driver too old or
// no kernel image for the device -> FailedPrecondition; anything else -> Internal. `what` names
// the call that failed.
inline absl::Status CudaStatus(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  const std::string message =
      absl::StrCat(what, ": ", cudaGetErrorName(error), " (", cudaGetErrorString(error), ")");
  switch (error) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorUnsupportedPtxVersion:
    case cudaErrorDevicesUnavailable:
      return absl::FailedPreconditionError(message);
    default:
      return absl::InternalError(message);
  }
}

#define NQ_CUDA_RETURN_IF_ERROR(expr)                                          \
  do {                                                                         \
    const cudaError_t nq_cuda_error_ = (expr);                                 \
    if (nq_cuda_error_ != cudaSuccess) {                                       \
      return ::nq::kernels::cuda::CudaStatus(nq_cuda_error_, #expr);           \
    }                                                                          \
  } while (false)

// Where and on what a launcher enqueues its kernel.
struct LaunchContext {
  cudaStream_t stream = nullptr;
  // Multiprocessors on the device, for grid sizing and tile-shape choice.
  int num_sms = 1;
};

// Call right after a <<<...>>> launch: reports a bad configuration or a missing kernel image.
inline absl::Status CheckLaunch(absl::string_view kernel) {
  return CudaStatus(cudaGetLastError(), absl::StrCat("launching ", kernel));
}

// Grid limits of compute capability 9.0 (CUDA C++ Programming Guide, "Compute Capabilities").
inline constexpr std::int64_t kMaxGridX = 2147483647;
inline constexpr std::int64_t kMaxGridY = 65535;

constexpr std::int64_t CeilDiv(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

inline bool IsAligned(const void* p, std::size_t alignment) {
  return reinterpret_cast<std::uintptr_t>(p) % alignment == 0;
}

}  // namespace nq::kernels::cuda
