// Arguments of the MatMul kernels (matmul.cuh, matmul_gemv.cuh), filled by CudaBackend after
// Backend has validated shapes and dtypes.
#pragma once

#include "kernels/dtype.h"

namespace nq::kernels::cuda {

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
};

}  // namespace nq::kernels::cuda
