// CPU reference LayerNorm (torch.nn.LayerNorm semantics, fp32 in and out):
// y = (x - mean) / sqrt(var + eps) * weight + bias with the biased variance. Mean and variance
// accumulate in double over two passes (no E[x^2] - E[x]^2 cancellation).
#include <cmath>
#include <cstdint>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/parallel.h"

namespace nq::kernels::cpu {
namespace {

constexpr std::int64_t kParallelMinElements = std::int64_t{1} << 20;

}  // namespace

void LayerNorm(const float* x, const float* weight, const float* bias, float eps, float* y,
               const RowDims& dims, int threads) {
  const std::int64_t cols = dims.cols;
  const int use_threads = dims.rows * cols < kParallelMinElements ? 1 : threads;
  ParallelFor(dims.rows, 1, use_threads, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * cols;
      float* yr = y + r * cols;
      double sum = 0.0;
      for (std::int64_t c = 0; c < cols; ++c) sum += xr[c];
      const double mean = sum / static_cast<double>(cols);
      double sum_sq = 0.0;
      for (std::int64_t c = 0; c < cols; ++c) {
        const double centred = xr[c] - mean;
        sum_sq += centred * centred;
      }
      const double inv_std = 1.0 / std::sqrt(sum_sq / static_cast<double>(cols) + eps);
      for (std::int64_t c = 0; c < cols; ++c) {
        yr[c] = static_cast<float>((xr[c] - mean) * inv_std * weight[c] + bias[c]);
      }
    }
  });
}

}  // namespace nq::kernels::cpu
