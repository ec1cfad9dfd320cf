// CreateBackend: the one place that maps a backend name to an implementation.
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"

// NQ_HAVE_CUDA=1 comes from kernels/CMakeLists.txt when nq_backend_cuda is built.
#ifndef NQ_HAVE_CUDA
#define NQ_HAVE_CUDA 0
#endif
#if NQ_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif

namespace nq::kernels {

bool IsBackendCompiledIn(std::string_view name) {
  if (name == "cpu") return true;
  if (name == "cuda") return NQ_HAVE_CUDA != 0;
  return false;
}

absl::StatusOr<DecodeGemv> ParseDecodeGemv(std::string_view name) {
  if (name == "auto") return DecodeGemv::kAuto;
  if (name == "tensor") return DecodeGemv::kTensorCores;
  if (name == "fma") return DecodeGemv::kFp32Fma;
  return absl::InvalidArgumentError(
      absl::StrCat("decode GEMV '", std::string(name), "' (expected auto, tensor or fma)"));
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(std::string_view name,
                                                       const BackendOptions& options) {
  if (name == "cpu" && options.cuda_decode_gemv != DecodeGemv::kAuto) {
    return absl::InvalidArgumentError("the decode GEMV choice applies to the cuda backend, not cpu");
  }
  if (name == "cpu") {
    return std::make_unique<cpu::CpuBackend>(options.cpu_threads, options.cpu_float64_attention);
  }
  if (name == "cuda") {
#if NQ_HAVE_CUDA
    return cuda::CreateCudaBackend(options.device, options.cuda_decode_gemv);
#else
    return absl::UnimplementedError(
        "backend 'cuda' is not compiled into this build (configure with NQ_ENABLE_CUDA=ON on a "
        "machine with nvcc, e.g. `cmake --preset cuda`)");
#endif
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown backend '", std::string(name), "' (expected 'cpu' or 'cuda')"));
}

}  // namespace nq::kernels
