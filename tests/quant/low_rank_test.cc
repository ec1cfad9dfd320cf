// Low-rank corrections (services/quant/low_rank.h, issue #16): the weighted fit lowers the
// Hessian-weighted error where calibration inputs have outlier channels (and beats an unweighted
// fit there), is not made without outliers, round-trips through its fp16 storage, and damaged or
// truncated factor bytes are refused.
#include "services/quant/low_rank.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "services/quant/hadamard.h"
#include "services/quant/low_rank_fit.h"
#include "services/quant/nested_scalar_codec.h"

namespace nq::quant {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kRows = 64, kCols = 128, kSamples = 2048;

// Activations whose channels `outliers` carry `scale` times the others' magnitude (LLM.int8's
// outlier features), the Hessian X^T X / n.
Hessian ActivationHessian(const std::vector<int64_t>& outliers, float scale, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(kSamples * kCols));
  for (float& v : x) v = normal(rng);
  for (int64_t s = 0; s < kSamples; ++s) {
    for (int64_t c : outliers) x[s * kCols + c] *= scale;
  }
  return *HessianFromActivations(x, kSamples, kCols);
}

std::vector<float> Gaussian(int64_t n, uint64_t seed, float sigma) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, sigma);
  std::vector<float> w(static_cast<size_t>(n));
  for (float& v : w) v = normal(rng);
  return w;
}

EncodeOptions Options() {
  EncodeOptions o;
  o.rotation = {.row_block = 64, .col_block = 128, .row_sign_seed = 3, .col_sign_seed = 4};
  return o;
}

TEST(LowRankTest, OutlierChannelsAreFoundOnTheHessianDiagonal) {
  const Hessian with = ActivationHessian({5, 77}, 12.0f, 1);
  const OutlierChannels found = FindOutlierChannels(with, 8.0);
  EXPECT_EQ(found.count, 2);
  EXPECT_GT(found.max_ratio, 100.0);  // 12^2 on the diagonal
  const OutlierChannels none = FindOutlierChannels(ActivationHessian({}, 1.0f, 1), 8.0);
  EXPECT_EQ(none.count, 0);
  EXPECT_LT(none.max_ratio, 2.0);
}

// The fit recovers an exactly rank-2 matrix (to fp16 rounding) in the plain metric.
TEST(LowRankTest, FitRecoversAnExactLowRankMatrix) {
  const std::vector<float> a = Gaussian(kRows * 2, 7, 1.0f), b = Gaussian(2 * kCols, 8, 1.0f);
  std::vector<float> e(static_cast<size_t>(kRows * kCols), 0.0f);
  for (int64_t i = 0; i < kRows; ++i) {
    for (int64_t j = 0; j < kCols; ++j) e[i * kCols + j] = a[i * 2] * b[j] + a[i * 2 + 1] * b[kCols + j];
  }
  absl::StatusOr<LowRankFactors> f = FitLowRank(e, kRows, kCols, nullptr, 2, 0.0);
  ASSERT_TRUE(f.ok()) << f.status();
  const double before = WeightedError(e, kRows, kCols, nullptr);
  SubtractLowRank(*f, e);
  EXPECT_LT(WeightedError(e, kRows, kCols, nullptr), 1e-5 * before);
}

// The case the correction is for: a codec's 2-bit error on a matrix whose inputs have outlier
// channels. The weighted fit lowers the output error, more than a fit that ignores the Hessian.
TEST(LowRankTest, WeightedFitLowersTheOutputErrorOnPlantedOutlierChannels) {
  const Hessian h = ActivationHessian({3, 40, 99}, 10.0f, 2);
  const std::vector<float> w = Gaussian(kRows * kCols, 9, 0.05f);
  NestedScalarCodec codec;
  absl::StatusOr<EncodedMatrix> m = codec.Encode(w, kRows, kCols, &h, Options());
  ASSERT_TRUE(m.ok()) << m.status();
  absl::StatusOr<CorrectionFit> fit = FitCorrection(codec, *m, w, &h, {.rank = 4});
  ASSERT_TRUE(fit.ok()) << fit.status();
  EXPECT_EQ(fit->outliers.count, 3);
  ASSERT_FALSE(fit->correction.empty());
  EXPECT_EQ(fit->correction.base.rank, 4);
  EXPECT_EQ(fit->correction.residual.rank, 4);
  std::printf("[ low-rank ] weighted error x%.3f at 2 bits, x%.3f at 4 bits\n", fit->error2_corrected / fit->error2,
              fit->error4_corrected / fit->error4);
  EXPECT_LT(fit->error2_corrected, 0.9 * fit->error2);
  EXPECT_LT(fit->error4_corrected, fit->error4);
  // The corrected errors (WeightedErrorAfter's shortcut) are those of the corrected matrices.
  for (Precision p : {Precision::k2Bit, Precision::k4Bit}) {
    std::vector<float> e(w.size());
    ASSERT_TRUE(codec.Decode(*m, p, e).ok());
    for (size_t k = 0; k < e.size(); ++k) e[k] = w[k] - e[k];
    ASSERT_TRUE(RotateMatrix(e, kRows, kCols, m->params.rotation).ok());
    Hessian hr = h;
    ASSERT_TRUE(RotateSymmetric(hr.values, kCols, m->params.rotation.col_block, m->params.rotation.col_sign_seed).ok());
    SubtractLowRank(fit->correction.base, e);
    if (p == Precision::k4Bit) SubtractLowRank(fit->correction.residual, e);
    const double direct = WeightedError(e, kRows, kCols, &hr);
    EXPECT_NEAR(p == Precision::k2Bit ? fit->error2_corrected : fit->error4_corrected, direct, 1e-6 * direct);
  }

  // The same rank fitted without the Hessian (plain Frobenius) lowers the weighted error less.
  std::vector<float> e2(w.size());
  ASSERT_TRUE(codec.Decode(*m, Precision::k2Bit, e2).ok());
  for (size_t k = 0; k < e2.size(); ++k) e2[k] = w[k] - e2[k];
  ASSERT_TRUE(RotateMatrix(e2, kRows, kCols, m->params.rotation).ok());
  Hessian rotated = h;
  ASSERT_TRUE(RotateSymmetric(rotated.values, kCols, m->params.rotation.col_block, m->params.rotation.col_sign_seed).ok());
  absl::StatusOr<LowRankFactors> plain = FitLowRank(e2, kRows, kCols, nullptr, 4, 0.0);
  ASSERT_TRUE(plain.ok());
  SubtractLowRank(*plain, e2);
  EXPECT_LT(fit->error2_corrected, WeightedError(e2, kRows, kCols, &rotated));

  // Decoding with the correction is the codec's decode plus the unrotated factors, at each level.
  for (Precision p : {Precision::k2Bit, Precision::k4Bit}) {
    std::vector<float> corrected(w.size()), plain_decode(w.size()), delta(w.size(), 0.0f);
    ASSERT_TRUE(DecodeCorrected(codec, *m, fit->correction, p, corrected).ok());
    ASSERT_TRUE(codec.Decode(*m, p, plain_decode).ok());
    AddLowRank(fit->correction.base, delta);
    if (p == Precision::k4Bit) AddLowRank(fit->correction.residual, delta);
    ASSERT_TRUE(UnrotateMatrix(delta, kRows, kCols, m->params.rotation).ok());
    for (size_t k = 0; k < w.size(); ++k) ASSERT_FLOAT_EQ(corrected[k], plain_decode[k] + delta[k]) << k;
  }
}

TEST(LowRankTest, NoCorrectionWithoutOutliersOrWithoutAHessianOrAtRankZero) {
  const std::vector<float> w = Gaussian(kRows * kCols, 10, 0.05f);
  const Hessian flat = ActivationHessian({}, 1.0f, 3);
  NestedScalarCodec codec;
  absl::StatusOr<EncodedMatrix> m = codec.Encode(w, kRows, kCols, &flat, Options());
  ASSERT_TRUE(m.ok());
  absl::StatusOr<CorrectionFit> fit = FitCorrection(codec, *m, w, &flat, {.rank = 4});
  ASSERT_TRUE(fit.ok());
  EXPECT_EQ(fit->outliers.count, 0);
  EXPECT_TRUE(fit->correction.empty());
  fit = FitCorrection(codec, *m, w, nullptr, {.rank = 4});
  ASSERT_TRUE(fit.ok());
  EXPECT_TRUE(fit->correction.empty());
  const Hessian outliers = ActivationHessian({1}, 10.0f, 3);
  fit = FitCorrection(codec, *m, w, &outliers, {.rank = 0});
  ASSERT_TRUE(fit.ok());
  EXPECT_TRUE(fit->correction.empty()) << "rank 0 is the default and fits nothing";
  EXPECT_EQ(FitCorrection(codec, *m, w, &outliers, {.rank = 5}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(LowRankTest, StorageRoundTripsAndRefusesDamagedOrTruncatedBytes) {
  absl::StatusOr<LowRankFactors> f = FitLowRank(Gaussian(kRows * kCols, 11, 0.01f), kRows, kCols, nullptr, 2, 0.0);
  ASSERT_TRUE(f.ok());
  const std::vector<uint8_t> bytes = PackLowRank(*f, 4);
  ASSERT_EQ(static_cast<int64_t>(bytes.size()), LowRankBytes(kRows, kCols, 4));
  absl::StatusOr<LowRankFactors> back = UnpackLowRank(bytes, kRows, kCols, 2, 4);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, *f) << "the fit's factors are already fp16 values";

  const std::span<const uint8_t> short_bytes(bytes.data(), bytes.size() - 2);
  EXPECT_EQ(UnpackLowRank(short_bytes, kRows, kCols, 2, 4).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(UnpackLowRank(short_bytes, kRows, kCols, 2, 4).status().message(), HasSubstr("truncated"));

  std::vector<uint8_t> padded = bytes;
  padded[2 * 3] = 0x3c;  // U[0][3] = 1.06 (fp16 0x3c3c) past rank 2
  padded[2 * 3 + 1] = 0x3c;
  EXPECT_THAT(UnpackLowRank(padded, kRows, kCols, 2, 4).status().message(), HasSubstr("past the expert's rank"));
  std::vector<uint8_t> nan = bytes;
  nan[0] = 0x00;
  nan[1] = 0x7e;  // U[0][0] = NaN
  EXPECT_EQ(UnpackLowRank(nan, kRows, kCols, 2, 4).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(UnpackLowRank(nan, kRows, kCols, 2, 4).status().message(), HasSubstr("non-finite"));
  EXPECT_EQ(UnpackLowRank(bytes, kRows, kCols, 5, 4).status().code(), absl::StatusCode::kDataLoss);
  // An expert without a correction reads an all-zero segment as rank 0 and nothing else.
  absl::StatusOr<LowRankFactors> none = UnpackLowRank(std::vector<uint8_t>(bytes.size(), 0), kRows, kCols, 0, 4);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
  EXPECT_FALSE(UnpackLowRank(bytes, kRows, kCols, 0, 4).ok()) << "another expert's factors where none belong";
}

}  // namespace
}  // namespace nq::quant
