// CPU reference Softmax over the last dim: y = exp(s*x - max) / sum(exp(s*x - max)), with the
// sum in double. A row whose scaled values are all -inf (fully masked) gives zeros instead of
// the 0/0 NaNs the formula would produce.
#include <cmath>
#include <cstdint>
#include <limits>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/parallel.h"

namespace nq::kernels::cpu {
namespace {

constexpr std::int64_t kParallelMinElements = std::int64_t{1} << 20;

}  // namespace

void Softmax(const float* x, float scale, float* y, const RowDims& dims, int threads) {
  const std::int64_t cols = dims.cols;
  const int use_threads = dims.rows * cols < kParallelMinElements ? 1 : threads;
  ParallelFor(dims.rows, 1, use_threads, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * cols;
      float* yr = y + r * cols;
      float max = -std::numeric_limits<float>::infinity();
      for (std::int64_t c = 0; c < cols; ++c) max = std::fmax(max, xr[c] * scale);
      if (max == -std::numeric_limits<float>::infinity()) {
        for (std::int64_t c = 0; c < cols; ++c) yr[c] = 0.0f;
        continue;
      }
      double sum = 0.0;
      for (std::int64_t c = 0; c < cols; ++c) sum += std::exp(double{xr[c] * scale} - max);
      const double inv_sum = 1.0 / sum;
      for (std::int64_t c = 0; c < cols; ++c) {
        yr[c] = static_cast<float>(std::exp(double{xr[c] * scale} - max) * inv_sum);
      }
    }
  });
}

}  // namespace nq::kernels::cpu
