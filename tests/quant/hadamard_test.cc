#include "services/quant/hadamard.h"

#include <bit>
#include <cmath>
#include <numeric>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "services/quant/codec_bench.h"
#include "tests/common/status_matchers.h"

namespace nq::quant {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;

double Norm2(const std::vector<float>& v) {
  double s = 0.0;
  for (float x : v) s += static_cast<double>(x) * x;
  return s;
}

TEST(SplitMix64Test, MatchesReferenceStream) {
  // Reference values of splitmix64 seeded with 0 (Vigna's splitmix64.c).
  uint64_t state = 0;
  EXPECT_EQ(SplitMix64(state), 0xe220a8397b1dcdafULL);
  EXPECT_EQ(SplitMix64(state), 0x6e789e6aa1b965f4ULL);
}

TEST(RandomSignsTest, DeterministicBalancedAndSeedDependent) {
  const std::vector<float> a = RandomSigns(42, 4096);
  EXPECT_EQ(a, RandomSigns(42, 4096));
  EXPECT_NE(a, RandomSigns(43, 4096));
  int plus = 0;
  for (float s : a) {
    ASSERT_TRUE(s == 1.0f || s == -1.0f);
    plus += s > 0;
  }
  EXPECT_NEAR(plus, 2048, 150);
  // A prefix of a longer stream is the shorter stream.
  const std::vector<float> prefix = RandomSigns(42, 100);
  EXPECT_TRUE(std::equal(prefix.begin(), prefix.end(), a.begin()));
}

TEST(FwhtTest, MatchesSylvesterMatrix) {
  constexpr int kN = 128;
  for (int i = 0; i < kN; ++i) {
    std::vector<float> e(kN, 0.0f);
    e[i] = 1.0f;
    FwhtInPlace(e);
    for (int j = 0; j < kN; ++j) {
      const float expected =
          (std::popcount(static_cast<unsigned>(i & j)) % 2 ? -1.0f : 1.0f) / std::sqrt(128.0f);
      ASSERT_FLOAT_EQ(e[j], expected) << i << "," << j;
    }
  }
}

TEST(FwhtTest, IsOrthogonalAndItsOwnInverse) {
  for (int64_t n = kMinHadamardBlock; n <= kMaxHadamardBlock; n *= 2) {
    const std::vector<float> x = GaussianValues(n, static_cast<uint64_t>(n));
    std::vector<float> y = x;
    FwhtInPlace(y);
    EXPECT_NEAR(Norm2(y), Norm2(x), 1e-4 * Norm2(x)) << n;
    FwhtInPlace(y);
    for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(y[i], x[i], 1e-5) << n << " " << i;
  }
}

TEST(RotateVectorTest, UnrotateIsExactInverse) {
  const int64_t n = 1024;
  const std::vector<float> signs = RandomSigns(7, n);
  const std::vector<float> x = GaussianValues(n, 3);
  for (int64_t block : {128, 512, 1024}) {
    std::vector<float> y = x;
    RotateVector(y, signs, block);
    EXPECT_NEAR(Norm2(y), Norm2(x), 1e-4 * Norm2(x));
    UnrotateVector(y, signs, block);
    for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(y[i], x[i], 1e-5);
  }
}

TEST(RotateMatrixTest, RoundTripAndNormPreserved) {
  const int64_t rows = 256, cols = 1024;
  const RotationParams p{.row_block = 128, .col_block = 512, .row_sign_seed = 11,
                         .col_sign_seed = 12};
  const std::vector<float> w = GaussianValues(rows * cols, 5);
  std::vector<float> r = w;
  ASSERT_THAT(RotateMatrix(r, rows, cols, p), IsOk());
  EXPECT_NEAR(Norm2(r), Norm2(w), 1e-4 * Norm2(w));
  double moved = 0.0;
  for (size_t i = 0; i < w.size(); ++i) moved += std::abs(r[i] - w[i]);
  EXPECT_GT(moved, 1.0);
  ASSERT_THAT(UnrotateMatrix(r, rows, cols, p), IsOk());
  for (size_t i = 0; i < w.size(); ++i) ASSERT_NEAR(r[i], w[i], 1e-5) << i;
}

TEST(RotateMatrixTest, SpreadsAnOutlierAcrossTheBlock) {
  // A single large weight becomes a flat 128 x 128 block of magnitude 1/128 each.
  const int64_t n = 128;
  std::vector<float> w(n * n, 0.0f);
  w[5 * n + 9] = 1.0f;
  ASSERT_THAT(RotateMatrix(w, n, n, RotationParams{}), IsOk());
  for (float v : w) ASSERT_NEAR(std::abs(v), 1.0f / 128.0f, 1e-7);
}

TEST(RotateSymmetricTest, KeepsQuadraticFormsInvariant) {
  // tr(W H W^T) == tr(W' H' W'^T) with W' = W R^T (columns rotated) and H' = R H R^T.
  const int64_t rows = 128, dim = 256;
  const RotationParams p{.row_block = 128, .col_block = 256, .row_sign_seed = 1,
                         .col_sign_seed = 2};
  const std::vector<float> a = GaussianValues(dim * dim, 9);
  std::vector<double> h(dim * dim, 0.0);
  for (int64_t i = 0; i < dim; ++i)
    for (int64_t j = 0; j < dim; ++j)
      for (int64_t k = 0; k < dim; k += 8) h[i * dim + j] += a[i * dim + k] * a[j * dim + k];
  const std::vector<float> w = GaussianValues(rows * dim, 10);
  auto quad = [&](const std::vector<float>& m, const std::vector<double>& hh) {
    double t = 0.0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < dim; ++i)
        for (int64_t j = 0; j < dim; ++j)
          t += m[r * dim + i] * hh[i * dim + j] * m[r * dim + j];
    return t;
  };
  const double before = quad(w, h);
  std::vector<float> wr = w;
  ASSERT_THAT(RotateMatrix(wr, rows, dim, p), IsOk());
  ASSERT_THAT(RotateSymmetric(h, dim, p.col_block, p.col_sign_seed), IsOk());
  EXPECT_NEAR(quad(wr, h), before, 1e-4 * std::abs(before));
}

TEST(HadamardErrorsTest, RejectsBadBlocksAndShapes) {
  std::vector<float> w(256 * 256);
  RotationParams p;
  p.col_block = 192;
  EXPECT_THAT(RotateMatrix(w, 256, 256, p),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("power of two")));
  p.col_block = 8;
  EXPECT_THAT(RotateMatrix(w, 256, 256, p),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("[16, 4096]")));
  p.col_block = 8192;
  EXPECT_THAT(RotateMatrix(w, 256, 256, p),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("power of two")));
  p.col_block = 512;
  EXPECT_THAT(UnrotateMatrix(w, 256, 256, p),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a multiple")));
  EXPECT_THAT(RotateMatrix(w, 128, 256, RotationParams{}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expected 128 x 256")));
  EXPECT_THAT(RotateMatrix(w, 0, 256, RotationParams{}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("non-empty")));
  std::vector<double> h(100);
  EXPECT_THAT(RotateSymmetric(h, 128, 128, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expected 128 x 128")));
}

}  // namespace
}  // namespace nq::quant
