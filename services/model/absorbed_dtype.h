// How the loader stores the MLA absorption matrices (w_uk, w_uv, split from kv_b_proj), which
// MlaAttention reads as F32 or BF16: BF16 when the weight matrices are stored as BF16 (half the
// bytes a decode step reads for them), else F32 (FP8 matrices, dequantised, would lose bits to
// BF16 rounding). One rule for the loader (model_weights.cc) and the device-fit estimate.
#pragma once

#include "kernels/dtype.h"

namespace nq::model {

inline kernels::DType AbsorbedMatrixDType(kernels::DType matrix_dtype) {
  return matrix_dtype == kernels::DType::kBF16 ? kernels::DType::kBF16 : kernels::DType::kF32;
}

}  // namespace nq::model
