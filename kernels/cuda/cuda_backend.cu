// CudaBackend: device memory, copies and op dispatch to the kernel families' launchers, all on
// one non-blocking stream per backend.
#include "kernels/cuda/cuda_backend.h"

#include <cuda_runtime.h>

#include <limits>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/cuda/activation.cuh"
#include "kernels/cuda/cuda_handles.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/matmul.cuh"
#include "kernels/cuda/rmsnorm.cuh"
#include "kernels/cuda/softmax.cuh"
#include "services/common/status_macros.h"

namespace nq::kernels::cuda {
namespace {

constexpr std::int64_t kMaxInt = std::numeric_limits<int>::max();

// Loaded by CreateCudaBackend to prove the fatbinary holds code this device can run: with lazy
// module loading a missing sm_90a image would otherwise surface only at the first real launch.
__global__ void ProbeKernel() {}

class DeviceStorage final : public Storage {
 public:
  DeviceStorage(void* data, std::size_t bytes) : Storage(data, bytes) {}
  // cudaFree waits for the device to finish work that may still use the memory.
  ~DeviceStorage() override {
    if (data() != nullptr) cudaFree(data());
  }
};

absl::Status CheckIntRange(absl::string_view op, std::initializer_list<std::int64_t> sizes) {
  for (std::int64_t size : sizes) {
    if (size > kMaxInt) {
      return absl::InvalidArgumentError(absl::StrCat(
          op, ": dimension ", size, " exceeds the CUDA kernels' limit of ", kMaxInt));
    }
  }
  return absl::OkStatus();
}

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, const cudaDeviceProp& props, CudaStream stream)
      : device_(device),
        description_(absl::StrFormat("%s (sm_%d%d, %d SMs, %.1f GiB)", props.name, props.major,
                                     props.minor, props.multiProcessorCount,
                                     props.totalGlobalMem / double{1 << 30})),
        stream_(std::move(stream)),
        ctx_{.stream = stream_.get(), .num_sms = props.multiProcessorCount} {}

  std::string_view name() const override { return "cuda"; }
  std::string DeviceDescription() const override { return description_; }

  absl::Status Synchronize() override {
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    NQ_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_.get()));
    return absl::OkStatus();
  }

 protected:
  absl::StatusOr<std::unique_ptr<Storage>> AllocateStorage(std::size_t bytes) override {
    if (bytes == 0) return std::make_unique<DeviceStorage>(nullptr, 0);
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    void* data = nullptr;
    NQ_CUDA_RETURN_IF_ERROR(cudaMalloc(&data, bytes));
    return std::make_unique<DeviceStorage>(data, bytes);
  }

  // From pageable memory cudaMemcpyAsync returns once `src` is staged, so the caller may reuse
  // it; the copy itself stays ordered on the stream.
  absl::Status DoCopyFromHost(const void* src, std::size_t bytes, void* dst) override {
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    NQ_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_.get()));
    return absl::OkStatus();
  }

  absl::Status DoCopyToHost(const void* src, std::size_t bytes, void* dst) override {
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    NQ_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_.get()));
    NQ_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_.get()));
    return absl::OkStatus();
  }

  absl::Status DoCopy(const void* src, std::size_t bytes, void* dst) override {
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    NQ_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_.get()));
    return absl::OkStatus();
  }

  absl::Status DoMatMul(const Tensor& x, const Tensor& w, Tensor& y,
                        const MatMulDims& dims) override {
    RETURN_IF_ERROR(CheckIntRange("MatMul", {dims.m, dims.n, dims.k}));
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return LaunchMatMul({.x = x.data_as<float>(),
                         .w = w.data(),
                         .w_dtype = w.dtype(),
                         .y = y.data_as<float>(),
                         .m = static_cast<int>(dims.m),
                         .n = static_cast<int>(dims.n),
                         .k = static_cast<int>(dims.k)},
                        ctx_);
  }

  absl::Status DoRmsNorm(const Tensor& x, const Tensor& weight, float eps, Tensor& y,
                         const RowDims& dims) override {
    RETURN_IF_ERROR(CheckIntRange("RmsNorm", {dims.rows, dims.cols}));
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return LaunchRmsNorm({.x = x.data_as<float>(),
                          .weight = weight.data(),
                          .weight_dtype = weight.dtype(),
                          .y = y.data_as<float>(),
                          .rows = dims.rows,
                          .cols = static_cast<int>(dims.cols),
                          .eps = eps},
                         ctx_);
  }

  absl::Status DoSiluAndMul(const Tensor& x, Tensor& y, const RowDims& dims) override {
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return LaunchSiluAndMul(
        {.x = x.data_as<float>(), .y = y.data_as<float>(), .rows = dims.rows, .cols = dims.cols},
        ctx_);
  }

  absl::Status DoSoftmax(const Tensor& x, float scale, Tensor& y,
                         const RowDims& dims) override {
    RETURN_IF_ERROR(CheckIntRange("Softmax", {dims.rows, dims.cols}));
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return LaunchSoftmax({.x = x.data_as<float>(),
                          .y = y.data_as<float>(),
                          .rows = dims.rows,
                          .cols = static_cast<int>(dims.cols),
                          .scale = scale},
                         ctx_);
  }

 private:
  int device_;
  std::string description_;
  CudaStream stream_;
  LaunchContext ctx_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device) {
  int count = 0;
  const cudaError_t count_error = cudaGetDeviceCount(&count);
  if (count_error != cudaSuccess || count == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("no usable CUDA device: ",
                     count_error != cudaSuccess
                         ? CudaStatus(count_error, "cudaGetDeviceCount").message()
                         : "cudaGetDeviceCount found none"));
  }
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA device ", device, " requested, ", count, " visible"));
  }
  NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  cudaDeviceProp props{};
  NQ_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&props, device));
  cudaFuncAttributes probe{};
  const cudaError_t probe_error = cudaFuncGetAttributes(&probe, ProbeKernel);
  if (probe_error != cudaSuccess) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the CUDA kernels cannot run on ", props.name, " (sm_", props.major, props.minor,
        "; this build targets CMAKE_CUDA_ARCHITECTURES, sm_90a by default): ",
        CudaStatus(probe_error, "cudaFuncGetAttributes").message()));
  }
  ASSIGN_OR_RETURN(CudaStream stream, CudaStream::CreateNonBlocking());
  return std::make_unique<CudaBackend>(device, props, std::move(stream));
}

}  // namespace nq::kernels::cuda
