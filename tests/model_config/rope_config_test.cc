// RoPE math against numbers derived by hand from the HF formulas
// (transformers modeling_rope_utils `_compute_default_rope_parameters`,
// `_compute_yarn_parameters`, and DeepseekV3Attention's softmax-scale correction).
#include "services/model/rope_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "tests/common/status_matchers.h"

namespace nq::model {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;

constexpr double kTolerance = 1e-12;

// DeepSeek-V3's rope_scaling: yarn, factor 40, beta 32 / 1, original 4096, theta 1e4,
// mscale = mscale_all_dim = 1.
RopeConfig DeepseekV3Yarn() {
  RopeConfig rope;
  rope.type = RopeType::kYarn;
  rope.theta = 10000.0;
  rope.yarn.factor = 40.0;
  rope.yarn.original_max_position_embeddings = 4096;
  rope.yarn.beta_fast = 32.0;
  rope.yarn.beta_slow = 1.0;
  rope.yarn.mscale = 1.0;
  rope.yarn.mscale_all_dim = 1.0;
  return rope;
}

TEST(RopeConfigTest, DefaultInvFreqIsThetaPowers) {
  RopeConfig rope;
  rope.theta = 1e6;  // GLM-5
  const std::vector<double> inv_freq = rope.InvFreq(64);
  ASSERT_EQ(inv_freq.size(), 32u);
  // inv_freq[i] = theta^(-2i/64).
  EXPECT_DOUBLE_EQ(inv_freq[0], 1.0);
  EXPECT_NEAR(inv_freq[1], std::pow(10.0, -6.0 / 32.0), kTolerance);  // 0.6493816315762113
  EXPECT_NEAR(inv_freq[16], 1e-3, kTolerance);                        // 1e6^(-1/2)
  EXPECT_NEAR(inv_freq[31], 1.539926526059492e-06, 1e-18);            // 1e6^(-62/64)
  EXPECT_DOUBLE_EQ(rope.AttentionFactor(), 1.0);
  EXPECT_DOUBLE_EQ(rope.SoftmaxMscaleSquared(), 1.0);
}

// dim 64, theta 1e4, original 4096:
//   low  = 64 ln(4096 / (32 * 2 pi)) / (2 ln 1e4) = 10.4722... -> floor 10
//   high = 64 ln(4096 / ( 1 * 2 pi)) / (2 ln 1e4) = 22.5134... -> ceil 23
// ramp(i) = clamp((i - 10) / 13, 0, 1); inv_freq = e (1 - ramp) + (e / 40) ramp with
// e = 1e4^(-2i/64).
TEST(RopeConfigTest, DeepseekV3YarnInvFreq) {
  const std::vector<double> inv_freq = DeepseekV3Yarn().InvFreq(64);
  ASSERT_EQ(inv_freq.size(), 32u);
  EXPECT_DOUBLE_EQ(inv_freq[0], 1.0);                            // pure extrapolation
  EXPECT_NEAR(inv_freq[1], std::pow(10.0, -0.125), kTolerance);  // 0.7498942093324559
  EXPECT_NEAR(inv_freq[10], std::pow(10.0, -1.25), kTolerance);  // ramp 0
  // i = 11: ramp 1/13, e = 10^-1.375.
  EXPECT_NEAR(inv_freq[11], std::pow(10.0, -1.375) * (12.0 / 13 + 1.0 / (13 * 40)), kTolerance);
  // i = 16: ramp 6/13, e = 0.01: 0.01 * (7/13 + 6/520) = 0.01 * 286/520 = 0.0055.
  EXPECT_NEAR(inv_freq[16], 0.0055, kTolerance);
  // i = 22: ramp 12/13, e = 10^-2.75.
  EXPECT_NEAR(inv_freq[22], std::pow(10.0, -2.75) * (1.0 / 13 + 12.0 / (13 * 40)), kTolerance);
  EXPECT_NEAR(inv_freq[23], std::pow(10.0, -2.875) / 40, kTolerance);  // ramp 1: interpolated
  EXPECT_NEAR(inv_freq[31], std::pow(10.0, -3.875) / 40, kTolerance);  // 3.33380358040831e-06
}

// truncate = false keeps low = 10.472240810318025, high = 22.513440636877274: at i = 16 the
// ramp is (16 - low) / (high - low) = 0.45907..., giving 0.005524062977468265.
TEST(RopeConfigTest, YarnWithoutTruncation) {
  RopeConfig rope = DeepseekV3Yarn();
  rope.yarn.truncate = false;
  const std::vector<double> inv_freq = rope.InvFreq(64);
  EXPECT_NEAR(inv_freq[16], 0.005524062977468265, 1e-15);
  EXPECT_NEAR(inv_freq[11], 0.04036758449441141, 1e-15);
  EXPECT_NEAR(inv_freq[22], 0.00011838773159168898, 1e-17);
  EXPECT_DOUBLE_EQ(inv_freq[10], rope.InvFreq(64)[10]);
}

// mscale(40, m) = 0.1 m ln 40 + 1; ln 40 = 3.6888794541139363.
TEST(RopeConfigTest, YarnMscale) {
  EXPECT_DOUBLE_EQ(YarnGetMscale(1.0, 1.0), 1.0);
  EXPECT_DOUBLE_EQ(YarnGetMscale(0.5, 1.0), 1.0);
  EXPECT_NEAR(YarnGetMscale(40.0, 1.0), 1.3688879454113936, kTolerance);
  EXPECT_NEAR(YarnGetMscale(40.0, 0.707), 1.0 + 0.0707 * 3.6888794541139363, kTolerance);

  RopeConfig rope = DeepseekV3Yarn();
  // mscale == mscale_all_dim: the cos/sin factor cancels to 1 ...
  EXPECT_DOUBLE_EQ(rope.AttentionFactor(), 1.0);
  // ... and the softmax scale takes mscale(40, 1)^2 = 1.8738542070926265.
  EXPECT_NEAR(rope.SoftmaxMscaleSquared(), 1.8738542070926265, kTolerance);

  // Without mscale_all_dim (or with it 0) HF falls back to mscale(factor) on cos/sin and
  // leaves the softmax scale alone.
  rope.yarn.mscale_all_dim = 0.0;
  EXPECT_NEAR(rope.AttentionFactor(), 1.3688879454113936, kTolerance);
  EXPECT_DOUBLE_EQ(rope.SoftmaxMscaleSquared(), 1.0);
  rope.yarn.mscale_all_dim.reset();
  rope.yarn.mscale.reset();
  EXPECT_NEAR(rope.AttentionFactor(), 1.3688879454113936, kTolerance);

  // mscale 1, mscale_all_dim 0.707: (1 + 0.1 ln 40) / (1 + 0.0707 ln 40).
  rope.yarn.mscale = 1.0;
  rope.yarn.mscale_all_dim = 0.707;
  EXPECT_NEAR(rope.AttentionFactor(), 1.3688879454113936 / (1.0 + 0.0707 * 3.6888794541139363),
              kTolerance);

  // An explicit attention_factor wins.
  rope.yarn.attention_factor = 0.5;
  EXPECT_DOUBLE_EQ(rope.AttentionFactor(), 0.5);
}

TEST(RopeConfigTest, DegenerateRampIsWidened) {
  // original 1: both correction dims are negative and clamp to 0, so low == high == 0 and HF
  // widens high by 0.001: every dim past 0 is fully interpolated.
  RopeConfig rope = DeepseekV3Yarn();
  rope.yarn.original_max_position_embeddings = 1;
  const std::vector<double> inv_freq = rope.InvFreq(8);
  EXPECT_DOUBLE_EQ(inv_freq[0], 1.0);
  EXPECT_NEAR(inv_freq[1], std::pow(1e4, -0.25) / 40, kTolerance);
}

TEST(RopeConfigTest, ValidateNamesTheBadParameter) {
  EXPECT_THAT(DeepseekV3Yarn().Validate(), IsOk());
  RopeConfig rope = DeepseekV3Yarn();
  rope.theta = 0.5;
  EXPECT_THAT(rope.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rope_theta")));
  rope = DeepseekV3Yarn();
  rope.yarn.factor = 0.5;
  EXPECT_THAT(rope.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("factor")));
  rope = DeepseekV3Yarn();
  rope.yarn.beta_fast = 0.5;
  EXPECT_THAT(rope.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must be >= beta_slow")));
  rope = DeepseekV3Yarn();
  rope.yarn.original_max_position_embeddings = 0;
  EXPECT_THAT(rope.Validate(), StatusIs(absl::StatusCode::kInvalidArgument,
                                        HasSubstr("original_max_position_embeddings")));
  rope = DeepseekV3Yarn();
  rope.yarn.mscale_all_dim = -1.0;
  EXPECT_THAT(rope.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("mscale_all_dim")));
  rope = DeepseekV3Yarn();
  rope.yarn.attention_factor = 0.0;
  EXPECT_THAT(rope.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("attention_factor")));
}

}  // namespace
}  // namespace nq::model
