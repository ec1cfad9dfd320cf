// How the loader stores the MLA absorption matrices (w_uk, w_uv, split from kv_b_proj), which
// MlaAttention reads as F32 or BF16: BF16 when the weight matrices are stored as BF16 or FP8 (half
// the bytes a decode step reads for them; FP8 values times their block scale round to BF16 at
// about 2^-9), else F32. And the vocabulary heads (lm_head, the MTP layers' shared heads), which
// FP8 checkpoints keep in BF16 and so does the loader. One rule for the loader
// (model_weights.cc) and the device-fit estimate.
#pragma once

#include "kernels/dtype.h"

namespace nq::model {

inline kernels::DType AbsorbedMatrixDType(kernels::DType matrix_dtype) {
  return matrix_dtype == kernels::DType::kF32 ? kernels::DType::kF32 : kernels::DType::kBF16;
}

inline kernels::DType HeadMatrixDType(kernels::DType matrix_dtype) {
  return matrix_dtype == kernels::DType::kF8E4M3 ? kernels::DType::kBF16 : matrix_dtype;
}

}  // namespace nq::model
