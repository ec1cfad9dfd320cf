// The per-vector steps of the NestQuant MoE block (kernels/nq_moe.h), shared by the decode
// (nq_moe.cuh) and prefill (nq_moe_prefill.cuh) paths: each runs one block per token or per
// assignment over a whole vector in shared memory, where the blockwise Hadamard transforms are
// cheap.
//   LaunchNqRotateInput  xr[t] = R_in x[t]
//   LaunchNqSwiglu       hh[a] = R_dc (silu(R_g^T g[a]) * R_g^T u[a]),  hg[a] = [g | u]
//   LaunchNqCombine      out[t] = R_dr^T sum_k w[t,k] yd[t*K + k]   (invalid ids skipped)
#pragma once

#include <cuda_fp16.h>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/nq_moe_params.h"

namespace nq::kernels::cuda {

// p.tokens tokens and p.tokens * p.top_k assignments; the buffers are the caller's workspace.
struct NqVectorParams {
  NqMoeParams p;
  float* xr = nullptr;  // [T, D]
  float* hg = nullptr;  // [T * K, 2 I]
  float* hh = nullptr;  // [T * K, I]
  float* yd = nullptr;  // [T * K, D]
  // LaunchNqSwiglu only: when set, hh is written here as fp16 instead (a GEMM's input), for
  // `rows` rows of hg when rows > 0 (else T * K).
  __half* hh_half = nullptr;
  std::int64_t rows = 0;
};

// In-place blockdiag(H_block) of v[0, n) without the 1/sqrt(block) normalisation (callers fold
// it into their next write). Every thread of the block calls it; it ends on a barrier.
__device__ __forceinline__ void BlockFwht(float* v, int n, int block) {
  for (int h = 1; h < block; h <<= 1) {
    for (int p = threadIdx.x; p < n / 2; p += blockDim.x) {
      const int i = (p / h) * 2 * h + (p % h);
      const float a = v[i], b = v[i + h];
      v[i] = a + b;
      v[i + h] = a - b;
    }
    __syncthreads();
  }
}


absl::Status LaunchNqRotateInput(const NqVectorParams& v, const LaunchContext& ctx);
// out[t] = R_dr^T acc[t] for t < p.tokens (the combine's output rotation alone).
absl::Status LaunchNqRotateOutput(const NqMoeParams& p, const float* acc, const LaunchContext& ctx);
absl::Status LaunchNqSwiglu(const NqVectorParams& v, const LaunchContext& ctx);
absl::Status LaunchNqCombine(const NqVectorParams& v, const LaunchContext& ctx);

}  // namespace nq::kernels::cuda
