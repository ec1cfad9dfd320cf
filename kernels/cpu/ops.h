// The CPU backend's fp32 reference ops on raw row-major arrays. Arguments are already validated
// by Backend (kernels/backend.cc); these functions only compute.
#pragma once

#include "kernels/backend.h"
#include "kernels/dtype.h"

namespace nq::kernels::cpu {

// y[m, n] = x[m, k] · w[n, k]^T; w holds `w_dtype` elements. Float accumulation.
void MatMul(const float* x, const void* w, DType w_dtype, float* y, const MatMulDims& dims,
            int threads);

// y = x * rsqrt(mean(x^2) + eps) * weight, per row; y may equal x. Double accumulation.
void RmsNorm(const float* x, const void* weight, DType weight_dtype, float eps, float* y,
             const RowDims& dims, int threads);

// y[r, j] = silu(x[r, j]) * x[r, cols + j]; x has 2 * dims.cols columns.
void SiluAndMul(const float* x, float* y, const RowDims& dims, int threads);

// y = softmax(scale * x) per row; all -inf rows give zeros; y may equal x.
void Softmax(const float* x, float scale, float* y, const RowDims& dims, int threads);

}  // namespace nq::kernels::cpu
