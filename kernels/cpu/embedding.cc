// CPU reference Embedding: out[t, :] = table[ids[t], :], rows widened to fp32 (exact for BF16 and
// F16). Ids are range-checked by Backend.
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/parallel.h"

namespace nq::kernels::cpu {
namespace {

constexpr std::int64_t kParallelMinElements = std::int64_t{1} << 20;

}  // namespace

void Embedding(std::span<const std::int32_t> ids, const void* table, DType table_dtype,
               std::int64_t dim, float* out, int threads) {
  const std::int64_t tokens = static_cast<std::int64_t>(ids.size());
  const int use_threads = tokens * dim < kParallelMinElements ? 1 : threads;
  VisitFloatDType(table_dtype, [&](auto tag) {
    using T = decltype(tag);
    const auto* rows = static_cast<const T*>(table);
    ParallelFor(tokens, 1, use_threads, [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t t = begin; t < end; ++t) {
        const T* src = rows + std::int64_t{ids[t]} * dim;
        float* dst = out + t * dim;
        if constexpr (std::is_same_v<T, float>) {
          std::memcpy(dst, src, static_cast<std::size_t>(dim) * sizeof(float));
        } else {
          for (std::int64_t c = 0; c < dim; ++c) dst[c] = ToFloat(src[c]);
        }
      }
    });
  });
}

}  // namespace nq::kernels::cpu
