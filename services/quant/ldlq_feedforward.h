// LDLQ's feed-forward for a codec that quantises 16 columns at once (trellis_v1 searches a
// 16-column block of tiles in one go): after block J = [j0, j0 + 16) is coded with error E
// (rows x 16), every row's columns after the block move by
//   d = E U_JJ^-1 (forward substitution),  x[i, k] -= sum_c d[i, c] U[j0 + c, k]  for k >= j0 + 16,
// U being the upper feedback factor of ldlq.h (cols x cols, row-major).
//
// The arithmetic is fixed, because a release's codes depend on these values and may not depend on
// the CPU, its ISA or the thread count: d by forward substitution in column order; each x[i, k]
// takes its 16 updates in column order, each a product rounded and then subtracted (never a fused
// multiply-add). The AVX2 path (4 doubles a lane, 4 rows sharing each load of U) and the portable
// SSE2 one give the same bits as the plain loop in ldlq_feedforward_test.cc.
#pragma once

#include <cstdint>
#include <span>

namespace nq::quant {

inline constexpr int64_t kFeedForwardBlock = 16;

enum class FeedForwardIsa { kBest, kPortable };

// x: rows x cols (row-major), updated in place; e: rows x 16 (row-major); u: cols x cols. Requires
// 0 <= j0, j0 + 16 <= cols and nonzero U diagonal (FeedbackFactor's are positive). `threads` >= 1
// split the rows (each part at least about 64K multiply-adds).
void FeedForwardBlock(std::span<const double> u, int64_t rows, int64_t cols, int64_t j0, std::span<const double> e,
                      std::span<double> x, int threads, FeedForwardIsa isa = FeedForwardIsa::kBest);

}  // namespace nq::quant
