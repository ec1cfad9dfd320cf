#include "services/worker/vector_exp.h"

#include <cmath>
#include <cstddef>

#include "services/common/cpu_features.h"

#if defined(__x86_64__)
#include <immintrin.h>

// glibc's libmvec: the AVX2 variant of exp (the vector ABI's name for 4 doubles, no mask). Called
// by name, not through -ffast-math's automatic vectorisation, which would also let the compiler
// assume every other value in the file is finite.
extern "C" __m256d _ZGVdN4v_exp(__m256d);
#endif

namespace nq::worker {
namespace {

#if defined(__x86_64__)
__attribute__((target("avx2"))) void ExpInPlaceAvx2(double* values, std::size_t n) {
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4) _mm256_storeu_pd(values + i, _ZGVdN4v_exp(_mm256_loadu_pd(values + i)));
  for (; i < n; ++i) values[i] = std::exp(values[i]);
}
#endif

}  // namespace

bool ExpInPlaceIsVectorized() { return CpuHasAvx2(); }

void ExpInPlace(std::span<double> values) {
#if defined(__x86_64__)
  if (ExpInPlaceIsVectorized()) {
    ExpInPlaceAvx2(values.data(), values.size());
    return;
  }
#endif
  for (double& v : values) v = std::exp(v);
}

}  // namespace nq::worker
