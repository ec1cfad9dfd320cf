// CPU reference RmsNorm (DeepseekV3RMSNorm / LlamaRMSNorm semantics, fp32 in and out):
// y = (x * rsqrt(mean(x^2) + eps)) * weight. The sum of squares accumulates in double so the
// oracle's own rounding stays far below the tolerances the CUDA kernels are held to.
#include <cmath>
#include <cstdint>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/parallel.h"

namespace nq::kernels::cpu {
namespace {

constexpr std::int64_t kParallelMinElements = std::int64_t{1} << 20;

template <typename WeightT>
void RmsNormRows(const float* x, const WeightT* weight, float eps, float* y, std::int64_t cols,
                 std::int64_t row_begin, std::int64_t row_end) {
  for (std::int64_t r = row_begin; r < row_end; ++r) {
    const float* xr = x + r * cols;
    float* yr = y + r * cols;
    double sum_sq = 0.0;
    for (std::int64_t c = 0; c < cols; ++c) sum_sq += static_cast<double>(xr[c]) * xr[c];
    const float inv_rms =
        static_cast<float>(1.0 / std::sqrt(sum_sq / static_cast<double>(cols) + eps));
    for (std::int64_t c = 0; c < cols; ++c) yr[c] = (xr[c] * inv_rms) * ToFloat(weight[c]);
  }
}

}  // namespace

void RmsNorm(const float* x, const void* weight, DType weight_dtype, float eps, float* y,
             const RowDims& dims, int threads) {
  const int use_threads = dims.rows * dims.cols < kParallelMinElements ? 1 : threads;
  VisitFloatDType(weight_dtype, [&](auto tag) {
    using WeightT = decltype(tag);
    const auto* w = static_cast<const WeightT*>(weight);
    ParallelFor(dims.rows, 1, use_threads, [&](std::int64_t begin, std::int64_t end) {
      RmsNormRows(x, w, eps, y, dims.cols, begin, end);
    });
  });
}

}  // namespace nq::kernels::cpu
