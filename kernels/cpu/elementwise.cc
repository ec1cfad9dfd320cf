// CPU reference elementwise ops: Add (the residual connections).
#include <cstdint>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/parallel.h"

namespace nq::kernels::cpu {
namespace {

constexpr std::int64_t kParallelMinElements = std::int64_t{1} << 20;
// Chunks stay whole cache lines of floats.
constexpr std::int64_t kAlignFloats = 16;

}  // namespace

void Add(const float* a, const float* b, float* out, std::int64_t count, int threads) {
  const int use_threads = count < kParallelMinElements ? 1 : threads;
  ParallelFor(
      count, kAlignFloats, use_threads,
      [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t i = begin; i < end; ++i) out[i] = a[i] + b[i];
      },
      kAlignFloats);
}

}  // namespace nq::kernels::cpu
