#include "services/quant/ldlq.h"

#include <cmath>
#include <cstring>
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

// FeedbackFactor written plainly (the code before its loops ran four chains at once): the damped,
// reversed Hessian's Cholesky factor one row at a time, its inverse one column at a time.
std::vector<double> PlainFeedbackFactor(const Hessian& h, double damping) {
  const int64_t n = h.dim;
  std::vector<double> a = h.values;
  double mean_diag = 0.0;
  for (int64_t i = 0; i < n; ++i) mean_diag += a[i * n + i];
  mean_diag /= static_cast<double>(n);
  for (int64_t i = 0; i < n; ++i) a[i * n + i] += damping * mean_diag;
  std::vector<double> r(static_cast<size_t>(n * n));
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) r[i * n + j] = a[(n - 1 - i) * n + (n - 1 - j)];
  }
  for (int64_t j = 0; j < n; ++j) {
    double* rj = r.data() + j * n;
    double d = rj[j];
    for (int64_t k = 0; k < j; ++k) d -= rj[k] * rj[k];
    const double ljj = std::sqrt(d);
    rj[j] = ljj;
    for (int64_t i = j + 1; i < n; ++i) {
      double* ri = r.data() + i * n;
      double s = ri[j];
      for (int64_t k = 0; k < j; ++k) s -= ri[k] * rj[k];
      ri[j] = s / ljj;
    }
    for (int64_t k = j + 1; k < n; ++k) rj[k] = 0.0;
  }
  std::vector<double> linv_t(static_cast<size_t>(n * n), 0.0);
  for (int64_t c = 0; c < n; ++c) {
    double* col = linv_t.data() + c * n;
    col[c] = 1.0 / r[c * n + c];
    for (int64_t i = c + 1; i < n; ++i) {
      double s = 0.0;
      for (int64_t k = c; k < i; ++k) s += r[i * n + k] * col[k];
      col[i] = -s / r[i * n + i];
    }
  }
  std::vector<double> u(static_cast<size_t>(n * n), 0.0);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = i; j < n; ++j) u[i * n + j] = linv_t[(n - 1 - j) * n + (n - 1 - i)];
  }
  return u;
}

// The released codes depend on U bit for bit: the factor's chained loops must give the plain
// loops' bits, for sizes that leave 0-3 rows and columns past the groups of four.
TEST(FeedbackFactorTest, GivesThePlainLoopsBits) {
  for (int64_t d : {1, 2, 3, 5, 8, 13, 31, 64}) {
    const int64_t n = 4 * d + 16;
    const std::vector<float> x = CorrelatedActivations(n, d, 0.7, 11 + d);
    auto h = HessianFromActivations(x, n, d);
    ASSERT_THAT(h, IsOk());
    auto u = FeedbackFactor(*h, 0.01);
    ASSERT_THAT(u, IsOk());
    const std::vector<double> want = PlainFeedbackFactor(*h, 0.01);
    ASSERT_EQ(u->size(), want.size());
    EXPECT_EQ(std::memcmp(u->data(), want.data(), want.size() * sizeof(double)), 0) << "dim " << d;
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
