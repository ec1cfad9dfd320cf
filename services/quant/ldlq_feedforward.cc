#include "services/quant/ldlq_feedforward.h"

#include <algorithm>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "services/common/cpu_features.h"

namespace nq::quant {
namespace {

constexpr int64_t kB = kFeedForwardBlock;
// Rows updated together: each load of U's 16 rows serves all of them.
constexpr int64_t kRowGroup = 4;

// d = e U_JJ^-1 for one row (forward substitution, column order).
inline void SolveRow(const double* u, int64_t cols, int64_t j0, const double* e, double* d) {
  for (int64_t c = 0; c < kB; ++c) {
    double s = e[c];
    for (int64_t k = 0; k < c; ++k) s -= d[k] * u[(j0 + k) * cols + j0 + c];
    d[c] = s / u[(j0 + c) * cols + j0 + c];
  }
}

// The reference order for one row and columns [k0, k1): 16 rounded products subtracted in turn.
inline void UpdateRowScalar(const double* u, int64_t cols, int64_t j0, const double* d, double* row, int64_t k0,
                            int64_t k1) {
  for (int64_t k = k0; k < k1; ++k) {
    double acc = row[k];
    for (int64_t c = 0; c < kB; ++c) acc -= d[c] * u[(j0 + c) * cols + k];
    row[k] = acc;
  }
}

#if defined(__x86_64__)
// kRowGroup rows, 4 columns a vector, two vectors a step: 8 accumulators, U's two vectors loaded
// once for the four rows. mul then sub (target avx2 without fma: nothing can fuse them).
__attribute__((target("avx2"))) void UpdateRowsAvx2(const double* u, int64_t cols, int64_t j0,
                                                    const double (*d)[kB], double* const* rows, int64_t k0,
                                                    int64_t k1) {
  int64_t k = k0;
  for (; k + 8 <= k1; k += 8) {
    __m256d a[kRowGroup][2];
    for (int64_t r = 0; r < kRowGroup; ++r) {
      a[r][0] = _mm256_loadu_pd(rows[r] + k);
      a[r][1] = _mm256_loadu_pd(rows[r] + k + 4);
    }
    for (int64_t c = 0; c < kB; ++c) {
      const double* uc = u + (j0 + c) * cols + k;
      const __m256d u0 = _mm256_loadu_pd(uc), u1 = _mm256_loadu_pd(uc + 4);
      for (int64_t r = 0; r < kRowGroup; ++r) {
        const __m256d dr = _mm256_broadcast_sd(&d[r][c]);
        a[r][0] = _mm256_sub_pd(a[r][0], _mm256_mul_pd(dr, u0));
        a[r][1] = _mm256_sub_pd(a[r][1], _mm256_mul_pd(dr, u1));
      }
    }
    for (int64_t r = 0; r < kRowGroup; ++r) {
      _mm256_storeu_pd(rows[r] + k, a[r][0]);
      _mm256_storeu_pd(rows[r] + k + 4, a[r][1]);
    }
  }
  for (int64_t r = 0; r < kRowGroup; ++r) UpdateRowScalar(u, cols, j0, d[r], rows[r], k, k1);
}

// The same with SSE2 (x86-64's baseline): 2 columns a vector, two vectors a step.
void UpdateRowsSse2(const double* u, int64_t cols, int64_t j0, const double (*d)[kB], double* const* rows, int64_t k0,
                    int64_t k1) {
  int64_t k = k0;
  for (; k + 4 <= k1; k += 4) {
    __m128d a[kRowGroup][2];
    for (int64_t r = 0; r < kRowGroup; ++r) {
      a[r][0] = _mm_loadu_pd(rows[r] + k);
      a[r][1] = _mm_loadu_pd(rows[r] + k + 2);
    }
    for (int64_t c = 0; c < kB; ++c) {
      const double* uc = u + (j0 + c) * cols + k;
      const __m128d u0 = _mm_loadu_pd(uc), u1 = _mm_loadu_pd(uc + 2);
      for (int64_t r = 0; r < kRowGroup; ++r) {
        const __m128d dr = _mm_set1_pd(d[r][c]);
        a[r][0] = _mm_sub_pd(a[r][0], _mm_mul_pd(dr, u0));
        a[r][1] = _mm_sub_pd(a[r][1], _mm_mul_pd(dr, u1));
      }
    }
    for (int64_t r = 0; r < kRowGroup; ++r) {
      _mm_storeu_pd(rows[r] + k, a[r][0]);
      _mm_storeu_pd(rows[r] + k + 2, a[r][1]);
    }
  }
  for (int64_t r = 0; r < kRowGroup; ++r) UpdateRowScalar(u, cols, j0, d[r], rows[r], k, k1);
}
#endif

void FeedForwardRows(const double* u, int64_t row_begin, int64_t row_end, int64_t cols, int64_t j0, const double* e,
                     double* x, bool avx2) {
  const int64_t k0 = j0 + kB;
  double d[kRowGroup][kB];
  int64_t i = row_begin;
  for (; i + kRowGroup <= row_end; i += kRowGroup) {
    double* rows[kRowGroup];
    for (int64_t r = 0; r < kRowGroup; ++r) {
      SolveRow(u, cols, j0, e + (i + r) * kB, d[r]);
      rows[r] = x + (i + r) * cols;
    }
#if defined(__x86_64__)
    if (avx2) {
      UpdateRowsAvx2(u, cols, j0, d, rows, k0, cols);
    } else {
      UpdateRowsSse2(u, cols, j0, d, rows, k0, cols);
    }
#else
    for (int64_t r = 0; r < kRowGroup; ++r) UpdateRowScalar(u, cols, j0, d[r], rows[r], k0, cols);
#endif
  }
  for (; i < row_end; ++i) {
    SolveRow(u, cols, j0, e + i * kB, d[0]);
    UpdateRowScalar(u, cols, j0, d[0], x + i * cols, k0, cols);
  }
}

}  // namespace

void FeedForwardBlock(std::span<const double> u, int64_t rows, int64_t cols, int64_t j0, std::span<const double> e,
                      std::span<double> x, int threads, FeedForwardIsa isa) {
  const bool avx2 = isa == FeedForwardIsa::kBest && CpuHasAvx2();
  // A part is at least 64K multiply-adds (tens of microseconds, about what starting a thread
  // costs), and whole row groups.
  const int64_t work = rows * kB * (cols - j0 - kB);
  const int64_t groups = std::max<int64_t>(1, (rows + kRowGroup - 1) / kRowGroup);
  const int64_t parts = std::clamp<int64_t>(std::min<int64_t>(threads, work >> 16), 1, groups);
  auto bounds = [&](int64_t part) { return std::min(rows, groups * part / parts * kRowGroup); };
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < parts; ++t) {
    pool.emplace_back(FeedForwardRows, u.data(), bounds(t), bounds(t + 1), cols, j0, e.data(), x.data(), avx2);
  }
  FeedForwardRows(u.data(), 0, bounds(1), cols, j0, e.data(), x.data(), avx2);
  for (std::thread& t : pool) t.join();
}

}  // namespace nq::quant
