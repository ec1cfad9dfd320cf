// CPU reference SiluAndMul (vLLM's silu_and_mul): y = silu(gate) * up, where each row of x is
// [gate (d) | up (d)] and silu(g) = g / (1 + exp(-g)).
#include <cmath>
#include <cstdint>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/parallel.h"

namespace nq::kernels::cpu {
namespace {

constexpr std::int64_t kParallelMinElements = std::int64_t{1} << 20;

}  // namespace

void SiluAndMul(const float* x, float* y, const RowDims& dims, int threads) {
  const std::int64_t d = dims.cols;
  const int use_threads = dims.rows * d < kParallelMinElements ? 1 : threads;
  ParallelFor(dims.rows, 1, use_threads, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) {
      const float* gate = x + r * 2 * d;
      const float* up = gate + d;
      float* out = y + r * d;
      for (std::int64_t j = 0; j < d; ++j) {
        const float g = gate[j];
        out[j] = g / (1.0f + std::exp(-g)) * up[j];
      }
    }
  });
}

}  // namespace nq::kernels::cpu
