#include "services/quant/codec_bench.h"

#include <cmath>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/common/status_matchers.h"

namespace nq::quant {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;

TEST(GaussianValuesTest, DeterministicUnitMoments) {
  const std::vector<float> v = GaussianValues(1 << 16, 1);
  EXPECT_EQ(v, GaussianValues(1 << 16, 1));
  double m = 0.0, s = 0.0;
  for (float x : v) {
    m += x;
    s += static_cast<double>(x) * x;
  }
  m /= v.size();
  s /= v.size();
  EXPECT_NEAR(m, 0.0, 0.02);
  EXPECT_NEAR(s, 1.0, 0.02);
}

TEST(RoundToNearestTest, GaussianMseMatchesUniformQuantiserTheory) {
  const int64_t n = 256;
  const std::vector<float> w = GaussianValues(n * n, 2);
  // Optimal uniform quantisers for N(0,1): MSE 0.1188 (4 levels), 0.01154 (16 levels).
  for (auto [bits, expected] : {std::pair{2, 0.1188}, std::pair{4, 0.01154}}) {
    auto q = RoundToNearest(w, n, n, bits);
    ASSERT_THAT(q, IsOk());
    double mse = 0.0;
    for (size_t i = 0; i < w.size(); ++i) mse += (w[i] - (*q)[i]) * (w[i] - (*q)[i]);
    EXPECT_NEAR(mse / w.size(), expected, 0.03 * expected) << bits;
  }
  EXPECT_THAT(RoundToNearest(w, n, n, 3),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2 or 4 bits")));
}

TEST(RelativeOutputErrorTest, ZeroForExactAndOneForZeroEstimate) {
  const int64_t rows = 4, cols = 8;
  const std::vector<float> w = GaussianValues(rows * cols, 3);
  const std::vector<float> x = CorrelatedActivations(64, cols, 0.5, 4);
  auto h = HessianFromActivations(x, 64, cols);
  ASSERT_THAT(h, IsOk());
  auto exact = RelativeOutputError(w, w, rows, cols, *h);
  ASSERT_THAT(exact, IsOk());
  EXPECT_EQ(*exact, 0.0);
  const std::vector<float> zero(w.size(), 0.0f);
  auto e = RelativeOutputError(w, zero, rows, cols, *h);
  ASSERT_THAT(e, IsOk());
  EXPECT_NEAR(*e, 1.0, 1e-12);
}

TEST(MeasureGaussianMseTest, ReportsCodecBelowRtn) {
  auto r = MeasureGaussianMse(256, 21);
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->n, 256);
  EXPECT_GT(r->mse_2bit, kRateDistortion2Bit);
  EXPECT_GT(r->mse_4bit, kRateDistortion4Bit);
  EXPECT_LT(r->mse_2bit, r->rtn_mse_2bit);
  EXPECT_LT(r->mse_4bit, r->rtn_mse_4bit);
  EXPECT_THAT(MeasureGaussianMse(100, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("multiple")));
  EXPECT_THAT(MeasureGaussianMse(256, 1, "nope"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("nope")));
}

TEST(MeasureOutputErrorTest, RejectsBadCorrelation) {
  EXPECT_THAT(MeasureOutputError(128, 128, 256, 1.0, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rho")));
}

}  // namespace
}  // namespace nq::quant

namespace nq::quant {
namespace {

TEST(BitsPerWeightTest, CountsPlanesScalesGainsAndRotation) {
  EncodedMatrix m;
  m.rows = 7168;
  m.cols = 2048;
  m.params.base_codebook.assign(2048 / 16, 1.0f);
  m.params.residual_codebook.assign(2048 / 16, 0.25f);
  const double side = 32.0 * (7168 + 2048 + 256) + 256;
  EXPECT_DOUBLE_EQ(BitsPerWeight(m, false), 2.0 + side / (7168.0 * 2048.0));
  EXPECT_DOUBLE_EQ(BitsPerWeight(m, true), 4.0 + side / (7168.0 * 2048.0));
}

TEST(MeasureEncodeCostTest, ExtrapolatesFromASliceAndRefusesBadSlices) {
  auto r = MeasureEncodeCost("trellis_v1", 64, 128, 16, 3);
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->slice_rows, 16);
  EXPECT_GT(r->slice_seconds, 0.0);
  EXPECT_DOUBLE_EQ(r->seconds_per_matrix, 4 * r->slice_seconds);
  // 64 x 128: 2 bits + 32 * (64 + 128 + 8 + 8) + 256 side bits over 8192 weights.
  EXPECT_DOUBLE_EQ(r->bits_2bit, 2.0 + (32.0 * 208 + 256) / 8192.0);
  EXPECT_THAT(MeasureEncodeCost("trellis_v1", 64, 128, 24, 3),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must divide")));
}

}  // namespace
}  // namespace nq::quant
