#include "kernels/cuda/dense_prefill.cuh"

#include "absl/strings/str_cat.h"

namespace nq::kernels::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) GatherExpertRowsKernel(const float* x, const int* order, int top_k, int D,
                                                                   __half* xe) {
  const int i = blockIdx.x, t = order[i] / top_k;
  const float* src = x + static_cast<std::int64_t>(t) * D;
  __half* dst = xe + static_cast<std::int64_t>(i) * D;
  for (int c = threadIdx.x; c < D; c += blockDim.x) dst[c] = __float2half_rn(src[c]);
}

__global__ void __launch_bounds__(kThreads) ScatterAddExpertRowsKernel(const float* ye, const int* order, int top_k,
                                                                       int D, const float* weights,
                                                                       const float* expert_scale, float* acc) {
  const int i = blockIdx.x, a = order[i], t = a / top_k;
  const float w = weights[a] * (expert_scale != nullptr ? *expert_scale : 1.0f);
  const float* src = ye + static_cast<std::int64_t>(i) * D;
  float* dst = acc + static_cast<std::int64_t>(t) * D;
  for (int c = threadIdx.x; c < D; c += blockDim.x) dst[c] += w * src[c];
}

}  // namespace

absl::Status CublasStatus(cublasStatus_t status, absl::string_view what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, " failed: ", cublasGetStatusString(status)));
}

absl::Status CheckDensePrefillResources(const DensePrefillResources& r, std::int64_t num_experts,
                                        absl::string_view op) {
  if (r.host_counts == nullptr || r.host_capacity < 2 * num_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": host buffer of ", r.host_capacity, " ints, need ", 2 * num_experts));
  }
  if (r.blas == nullptr || r.side == nullptr || r.start == nullptr || r.ready[0] == nullptr ||
      r.ready[1] == nullptr || r.free[0] == nullptr || r.free[1] == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": a cuBLAS handle, a side stream and five events needed"));
  }
  return absl::OkStatus();
}

absl::Status LaunchGatherExpertRows(const float* x, const int* order, int top_k, int D, int rows, __half* xe,
                                    const LaunchContext& ctx) {
  if (rows <= 0) return absl::OkStatus();
  GatherExpertRowsKernel<<<rows, kThreads, 0, ctx.stream>>>(x, order, top_k, D, xe);
  return CheckLaunch("GatherExpertRowsKernel");
}

absl::Status LaunchScatterAddExpertRows(const float* ye, const int* order, int top_k, int D, int rows,
                                        const float* weights, const float* expert_scale, float* acc,
                                        const LaunchContext& ctx) {
  if (rows <= 0) return absl::OkStatus();
  ScatterAddExpertRowsKernel<<<rows, kThreads, 0, ctx.stream>>>(ye, order, top_k, D, weights, expert_scale, acc);
  return CheckLaunch("ScatterAddExpertRowsKernel");
}

absl::Status GemmRowsF16(cublasHandle_t blas, const __half* w, const __half* a, float* c, int m, int n, int k) {
  // In cuBLAS's column-major terms C^T = W A^T, W^T being the column-major view of row-major W.
  const float one = 1.0f, zero = 0.0f;
  return CublasStatus(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, w, CUDA_R_16F, k, a, CUDA_R_16F, k,
                                 &zero, c, CUDA_R_32F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                    "cublasGemmEx");
}

}  // namespace nq::kernels::cuda
