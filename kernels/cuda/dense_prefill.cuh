// What the long-prefill paths of the routed-expert blocks share (NestQuant:
// nq_moe_prefill_dense.cuh; NVFP4: nvfp4_moe_prefill_dense.cuh): each expert that has tokens is
// dequantised once into an fp16 matrix and its tokens run through cuBLAS GEMMs. Here: the
// resources such a call needs, the gather of an expert's token rows, the weighted scatter of its
// outputs, and the GEMM itself.
#pragma once

#include <cublas_v2.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"

namespace nq::kernels::cuda {

// The side stream dequantises the next expert into the other half of a double buffer while
// ctx.stream runs the current one's GEMMs; the events order the two (ready[b]: buffer b
// dequantised; free[b]: its GEMMs done; start: ctx.stream's earlier work, which the side stream
// waits for before reading the weights). The group sizes come to the host through host_counts.
struct DensePrefillResources {
  cublasHandle_t blas = nullptr;
  cudaStream_t side = nullptr;
  cudaEvent_t start = nullptr;
  cudaEvent_t ready[2] = {};
  cudaEvent_t free[2] = {};
  int* host_counts = nullptr;      // pinned, at least 2 * num_experts ints
  std::int64_t host_capacity = 0;  // ints
};

// Lays a call's buffers out one after another in its workspace, each 256-byte aligned: with a null
// base it only counts the bytes (Bytes()), so one carving function serves both the size query and
// the launch.
class WorkspaceCarver {
 public:
  explicit WorkspaceCarver(void* base) : base_(static_cast<char*>(base)) {}
  template <typename T>
  void Take(T*& p, std::int64_t count) {
    if (base_ != nullptr) p = reinterpret_cast<T*>(base_ + at_);
    at_ += (static_cast<std::size_t>(count) * sizeof(T) + 255) / 256 * 256;
  }
  std::size_t Bytes() const { return at_; }

 private:
  char* base_;
  std::size_t at_ = 0;
};

// OK, or Internal naming `what` and cuBLAS's message.
absl::Status CublasStatus(cublasStatus_t status, absl::string_view what);

// InvalidArgument when a handle, stream or event is missing or host_counts holds fewer than
// 2 * num_experts ints; `op` names the caller in the message.
absl::Status CheckDensePrefillResources(const DensePrefillResources& r, std::int64_t num_experts,
                                        absl::string_view op);

// xe[i] = fp16(x[token of assignment order[i]]) for i < rows (token = assignment / top_k).
absl::Status LaunchGatherExpertRows(const float* x, const int* order, int top_k, int D, int rows, __half* xe,
                                    const LaunchContext& ctx);

// acc[token] += weights[a] * scale * ye[i] for a = order[i], i < rows; scale = *expert_scale, or 1
// where expert_scale is null. One expert per launch: its rows are different tokens and experts
// follow one another on the stream, so the sums are deterministic.
absl::Status LaunchScatterAddExpertRows(const float* ye, const int* order, int top_k, int D, int rows,
                                        const float* weights, const float* expert_scale, float* acc,
                                        const LaunchContext& ctx);

// C[n, m] (row-major, fp32) = A[n, k] (fp16) * W[m, k]^T (fp16), fp32 accumulation.
absl::Status GemmRowsF16(cublasHandle_t blas, const __half* w, const __half* a, float* c, int m, int n, int k);

}  // namespace nq::kernels::cuda
