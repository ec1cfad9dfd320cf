// CPU reference row movement: GatherRows (MoE dispatch: tokens -> expert batches) and
// ScatterAddRows (MoE combine: weighted expert outputs -> tokens). WriteRows is one contiguous
// copy (CpuBackend::DoWriteRows), or FloatsToBf16 into a BF16 KV cache.
#include <cstdint>
#include <cstring>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/parallel.h"

namespace nq::kernels::cpu {
namespace {

constexpr std::int64_t kParallelMinElements = std::int64_t{1} << 20;
// Column chunks of ScatterAddRows stay whole cache lines of floats.
constexpr std::int64_t kAlignFloats = 16;

}  // namespace

void FloatsToBf16(const float* src, std::int64_t count, Bf16* out, int threads) {
  const int use_threads = count < kParallelMinElements ? 1 : threads;
  ParallelFor(
      count, kAlignFloats, use_threads,
      [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t i = begin; i < end; ++i) out[i] = ToBf16(src[i]);
      },
      kAlignFloats);
}

void GatherRows(const float* x, std::span<const std::int32_t> rows, std::int64_t cols, float* out,
                int threads) {
  const std::int64_t n = static_cast<std::int64_t>(rows.size());
  const int use_threads = n * cols < kParallelMinElements ? 1 : threads;
  ParallelFor(n, 1, use_threads, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) {
      std::memcpy(out + i * cols, x + std::int64_t{rows[i]} * cols,
                  static_cast<std::size_t>(cols) * sizeof(float));
    }
  });
}

void ScatterAddRows(const float* src, std::span<const std::int32_t> rows,
                    std::span<const float> weights, std::int64_t cols, float* out, int threads) {
  const std::int64_t n = static_cast<std::int64_t>(rows.size());
  const int use_threads = n * cols < kParallelMinElements ? 1 : threads;
  // Threads split the columns, so every element still sees its contributions in index order.
  ParallelFor(
      cols, kAlignFloats, use_threads,
      [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t i = 0; i < n; ++i) {
          const float w = weights[i];
          const float* s = src + i * cols;
          float* o = out + std::int64_t{rows[i]} * cols;
          for (std::int64_t c = begin; c < end; ++c) o[c] += w * s[c];
        }
      },
      kAlignFloats);
}

}  // namespace nq::kernels::cpu
