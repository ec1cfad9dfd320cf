#include "services/quant/ldlq.h"

#include <cmath>
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

TEST(CholeskyTest, FactorsKnownMatrix) {
  std::vector<double> a = {4, 12, -16, 12, 37, -43, -16, -43, 98};
  ASSERT_THAT(CholeskyInPlace(a, 3), IsOk());
  const std::vector<double> l = {2, 0, 0, 6, 1, 0, -8, 5, 3};
  for (int i = 0; i < 9; ++i) EXPECT_NEAR(a[i], l[i], 1e-12) << i;
}

TEST(CholeskyTest, RejectsIndefinite) {
  std::vector<double> a = {1, 2, 2, 1};
  EXPECT_THAT(CholeskyInPlace(a, 2),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("pivot 1")));
}

TEST(HessianFromActivationsTest, MatchesNaiveProduct) {
  const int64_t n = 37, d = 16;
  const std::vector<float> x = GaussianValues(n * d, 4);
  auto h = HessianFromActivations(x, n, d);
  ASSERT_THAT(h, IsOk());
  for (int64_t i = 0; i < d; ++i) {
    for (int64_t j = 0; j < d; ++j) {
      double s = 0.0;
      for (int64_t k = 0; k < n; ++k) s += static_cast<double>(x[k * d + i]) * x[k * d + j];
      EXPECT_NEAR(h->values[i * d + j], s / n, 1e-9);
    }
  }
  EXPECT_THAT(HessianFromActivations(x, n, d + 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expected 37 x 17")));
}

TEST(FeedbackFactorTest, IdentityGivesScaledIdentity) {
  Hessian h{.dim = 4, .values = std::vector<double>(16, 0.0)};
  for (int i = 0; i < 4; ++i) h.values[i * 4 + i] = 1.0;
  auto u = FeedbackFactor(h, 0.25);
  ASSERT_THAT(u, IsOk());
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j)
      EXPECT_NEAR((*u)[i * 4 + j], i == j ? 1.0 / std::sqrt(1.25) : 0.0, 1e-12);
}

TEST(FeedbackFactorTest, UpperFactorOfTheDampedInverse) {
  const int64_t n = 200, d = 32;
  const std::vector<float> x = CorrelatedActivations(n, d, 0.8, 6);
  auto h = HessianFromActivations(x, n, d);
  ASSERT_THAT(h, IsOk());
  constexpr double kDamp = 0.01;
  auto u = FeedbackFactor(*h, kDamp);
  ASSERT_THAT(u, IsOk());
  double mean_diag = 0.0;
  for (int64_t i = 0; i < d; ++i) mean_diag += h->values[i * d + i] / d;
  // (U^T U) (H + damp * mean_diag * I) == I.
  for (int64_t i = 0; i < d; ++i) {
    for (int64_t j = 0; j < d; ++j) {
      double s = 0.0;
      for (int64_t k = 0; k < d; ++k) {
        double utu = 0.0;
        for (int64_t m = 0; m <= std::min(i, k); ++m) utu += (*u)[m * d + i] * (*u)[m * d + k];
        const double hd = h->values[k * d + j] + (k == j ? kDamp * mean_diag : 0.0);
        s += utu * hd;
      }
      ASSERT_NEAR(s, i == j ? 1.0 : 0.0, 1e-8) << i << "," << j;
    }
    for (int64_t j = 0; j < i; ++j) EXPECT_EQ((*u)[i * d + j], 0.0);
  }
}

TEST(FeedbackFactorTest, NonPositiveDefiniteIsAClearError) {
  Hessian h{.dim = 2, .values = {-1, 0, 0, -1}};
  EXPECT_THAT(FeedbackFactor(h, 0.01), StatusIs(absl::StatusCode::kInvalidArgument,
                                                HasSubstr("not positive definite")));
  Hessian indefinite{.dim = 2, .values = {1, 3, 3, 1}};
  EXPECT_THAT(FeedbackFactor(indefinite, 0.01),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("not positive definite after damping")));
}

TEST(FeedbackFactorTest, DampingRescuesASingularHessian) {
  // Fewer samples than dims: X^T X is rank-deficient (PSD, singular).
  const int64_t n = 8, d = 32;
  const std::vector<float> x = GaussianValues(n * d, 8);
  auto h = HessianFromActivations(x, n, d);
  ASSERT_THAT(h, IsOk());
  EXPECT_THAT(FeedbackFactor(*h, 0.0), StatusIs(absl::StatusCode::kInvalidArgument,
                                                HasSubstr("not positive definite")));
  EXPECT_THAT(FeedbackFactor(*h, 0.01), IsOk());
  EXPECT_THAT(FeedbackFactor(*h, -0.5),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("damping")));
}

TEST(ValidateHessianTest, RejectsShapeAsymmetryAndNonFinite) {
  Hessian h{.dim = 2, .values = {1, 0.5, 0.5, 1}};
  EXPECT_THAT(ValidateHessian(h, 2), IsOk());
  EXPECT_THAT(ValidateHessian(h, 3),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expected 3 x 3")));
  h.values[1] = 0.7;
  EXPECT_THAT(ValidateHessian(h, 2),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not symmetric")));
  h.values[1] = NAN;
  EXPECT_THAT(ValidateHessian(h, 2),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("non-finite")));
}

}  // namespace
}  // namespace nq::quant
