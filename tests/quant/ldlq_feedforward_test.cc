#include "services/quant/ldlq_feedforward.h"

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "services/common/cpu_features.h"
#include "services/quant/ldlq.h"

namespace nq::quant {
namespace {

// The feed-forward written the plain way (the trellis codec's loop before the vector paths):
// d by forward substitution, then for each of the block's columns in turn, x[i, k] -= d[c] U[c, k]
// over the whole row.
void PlainFeedForward(const std::vector<double>& u, int64_t rows, int64_t cols, int64_t j0,
                      const std::vector<double>& e, std::vector<double>& x) {
  double d[kFeedForwardBlock];
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t c = 0; c < kFeedForwardBlock; ++c) {
      double s = e[i * kFeedForwardBlock + c];
      for (int64_t k = 0; k < c; ++k) s -= d[k] * u[(j0 + k) * cols + j0 + c];
      d[c] = s / u[(j0 + c) * cols + j0 + c];
    }
    for (int64_t c = 0; c < kFeedForwardBlock; ++c) {
      for (int64_t k = j0 + kFeedForwardBlock; k < cols; ++k) {
        volatile double product = d[c] * u[(j0 + c) * cols + k];  // rounded on its own, as the contract says
        x[i * cols + k] -= product;
      }
    }
  }
}

// A real feedback factor (of an AR(1)-like Hessian with noise), so U's rows have the magnitudes
// LDLQ gives them.
std::vector<double> Factor(int64_t cols, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, 1.0);
  Hessian h{cols, std::vector<double>(static_cast<size_t>(cols * cols))};
  std::vector<double> noise(static_cast<size_t>(cols));
  for (double& v : noise) v = 0.1 * normal(rng);
  for (int64_t i = 0; i < cols; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      double v = 1.0;
      for (int64_t s = 0; s < (i > j ? i - j : j - i); ++s) v *= 0.8;
      h.values[i * cols + j] = v + (i == j ? noise[i] * noise[i] : noise[i] * noise[j]);
    }
  }
  auto u = FeedbackFactor(h, 0.01);
  EXPECT_TRUE(u.ok()) << u.status();
  return u.ok() ? *u : std::vector<double>();
}

bool SameBits(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

TEST(LdlqFeedForward, EveryPathGivesThePlainLoopsBits) {
  std::mt19937_64 rng(5);
  std::normal_distribution<double> normal(0.0, 1.0);
  constexpr int64_t kCols = 96;
  const std::vector<double> u = Factor(kCols, rng);
  ASSERT_FALSE(u.empty());
  // Row counts that leave 0-3 rows past the groups of four; blocks at the start, middle and the
  // last one (nothing after it to update); one and several threads.
  for (int64_t rows : {1, 3, 4, 7, 16, 37}) {
    for (int64_t j0 : {int64_t{0}, int64_t{32}, int64_t{48}, kCols - kFeedForwardBlock}) {
      std::vector<double> x(static_cast<size_t>(rows * kCols)), e(static_cast<size_t>(rows * kFeedForwardBlock));
      for (double& v : x) v = normal(rng);
      for (double& v : e) v = 0.3 * normal(rng);
      std::vector<double> want = x;
      PlainFeedForward(u, rows, kCols, j0, e, want);
      for (FeedForwardIsa isa : {FeedForwardIsa::kBest, FeedForwardIsa::kPortable}) {
        for (int threads : {1, 3}) {
          std::vector<double> got = x;
          FeedForwardBlock(u, rows, kCols, j0, e, got, threads, isa);
          EXPECT_TRUE(SameBits(got, want)) << "rows " << rows << " j0 " << j0 << " threads " << threads
                                           << (isa == FeedForwardIsa::kBest ? " best" : " portable");
        }
      }
    }
  }
}

// The update must move the columns after the block (and only those): a zero error changes nothing,
// a nonzero one changes every later column of its row (U's upper triangle is dense).
TEST(LdlqFeedForward, MovesOnlyTheColumnsAfterTheBlock) {
  std::mt19937_64 rng(9);
  std::normal_distribution<double> normal(0.0, 1.0);
  constexpr int64_t kCols = 64, kRows = 8, kJ0 = 16;
  const std::vector<double> u = Factor(kCols, rng);
  ASSERT_FALSE(u.empty());
  std::vector<double> x(kRows * kCols);
  for (double& v : x) v = normal(rng);
  std::vector<double> e(kRows * kFeedForwardBlock, 0.0);
  std::vector<double> got = x;
  FeedForwardBlock(u, kRows, kCols, kJ0, e, got, 1);
  EXPECT_TRUE(SameBits(got, x));
  for (double& v : e) v = normal(rng);
  FeedForwardBlock(u, kRows, kCols, kJ0, e, got, 1);
  for (int64_t i = 0; i < kRows; ++i) {
    for (int64_t k = 0; k < kCols; ++k) {
      if (k < kJ0 + kFeedForwardBlock) {
        EXPECT_EQ(got[i * kCols + k], x[i * kCols + k]) << i << "," << k;
      } else {
        EXPECT_NE(got[i * kCols + k], x[i * kCols + k]) << i << "," << k;
      }
    }
  }
}

}  // namespace
}  // namespace nq::quant
