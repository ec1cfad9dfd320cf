// Arguments of the MatMul kernels (matmul.cuh, matmul_gemv.cuh), filled by CudaBackend after
// Backend has validated shapes and dtypes.
#pragma once

#include "kernels/dtype.h"

namespace nq::kernels::cuda {

// One more matrix over the same x, k and weight dtype (Backend::MatMulSharedInput): y_e[m, n_e]
// = x · w_e^T, computed in the same launch as the first.
struct MatMulExtra {
  const void* w = nullptr;          // [n, k], elements of MatMulParams::w_dtype
  const float* w_scale = nullptr;   // F8E4M3 only, as MatMulParams::w_scale
  float* y = nullptr;               // [m, n]
  int n = 0;
};
inline constexpr int kMatMulMaxExtra = 7;

struct MatMulParams {
  const float* x = nullptr;  // [m, k], row-major
  const void* w = nullptr;   // [n, k], row-major, elements of w_dtype
  DType w_dtype = DType::kF32;
  // F8E4M3 weights only (else null): F32 [ceil(n / 128), ceil(k / 128)], row-major;
  // w[j, p] = float(w[j, p]) * w_scale[j / 128, p / 128] (kWeightScaleBlock).
  const float* w_scale = nullptr;
  float* y = nullptr;  // [m, n], row-major; overlaps neither x nor w
  int m = 0;
  int n = 0;
  int k = 0;
  // The GEMV's split of k (m <= kGemvMaxRows): 0 lets GemvSplits choose; benchmarks force a
  // count (clamped to [1, kGemvMaxSplits] and to the column steps).
  int k_splits = 0;
  // Further matrices the GEMV computes in the same launch, their 32-row blocks after w's (the
  // tiled path runs them one by one). Each n > 0.
  MatMulExtra extra[kMatMulMaxExtra] = {};
  int num_extra = 0;
};

// How many column ranges (gridDim.y, one thread-block cluster per 32 rows; matmul_gemv.cuh) the
// GEMV (matmul.cu) splits k into for a launch of row_blocks 32-row blocks and col_steps warp steps of
// columns, on num_sms multiprocessors: 1 when the rows give every SM a block, else enough to,
// up to kGemvMaxSplits. Depends on the matrix only, never on m,
// so a row's sum is added in the same order for 1 token and for 8 (batch invariance).
int GemvSplits(int row_blocks, int col_steps, int num_sms);

}  // namespace nq::kernels::cuda
