#include "services/quant/nested_codebook.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "services/quant/codec_bench.h"
#include "tests/common/status_matchers.h"

namespace nq::quant {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;

TEST(NestedCodebookTest, PureTwoBitObjectiveGivesLloydMax) {
  auto cb = DesignNestedCodebook(1.0, BaseGrid::kLloyd);
  ASSERT_THAT(cb, IsOk());
  // 4-level Lloyd-Max for N(0,1): +-0.4528, +-1.5104 (Max 1960).
  EXPECT_NEAR(cb->base[2], 0.4528, 2e-3);
  EXPECT_NEAR(cb->base[3], 1.5104, 2e-3);
  EXPECT_NEAR(GaussianDistortion(*cb, 1.0)[0], kLloydMax2Bit, 5e-4);
}

TEST(NestedCodebookTest, PureFourBitObjectiveGivesSixteenLevelLloydMax) {
  auto cb = DesignNestedCodebook(0.0, BaseGrid::kLloyd);
  ASSERT_THAT(cb, IsOk());
  // The 16-level Lloyd-Max cells happen to nest in groups of four.
  EXPECT_NEAR(GaussianDistortion(*cb, 0.0)[1], kLloydMax4Bit, 1e-4);
}

TEST(NestedCodebookTest, DefaultBlendIsNearLloydMaxAtBothRates) {
  auto cb = DesignNestedCodebook(0.5, BaseGrid::kLloyd);
  ASSERT_THAT(cb, IsOk());
  const auto d = GaussianDistortion(*cb, 0.5);
  // Designed values: 0.11750 at 2 bits, 0.00969 at 4 bits.
  EXPECT_LT(d[0], 0.1177);
  EXPECT_LT(d[1], 0.0098);
  EXPECT_GT(d[0], kRateDistortion2Bit);
  EXPECT_GT(d[1], kRateDistortion4Bit);
}

TEST(NestedCodebookTest, SymmetricAndOrdered) {
  auto cb = DesignNestedCodebook(0.5, BaseGrid::kLloyd);
  ASSERT_THAT(cb, IsOk());
  for (int b = 0; b < kBaseLevels; ++b) {
    EXPECT_NEAR(cb->base[b], -cb->base[kBaseLevels - 1 - b], 1e-5);
    if (b > 0) {
      EXPECT_LT(cb->base[b - 1], cb->base[b]);
    }
    for (int r = 1; r < kResidualLevels; ++r) EXPECT_LT(cb->Level4(b, r - 1), cb->Level4(b, r));
  }
  // The 16 levels are ascending across cells too (nested intervals).
  for (int b = 1; b < kBaseLevels; ++b) EXPECT_LT(cb->Level4(b - 1, 3), cb->Level4(b, 0));
}

TEST(NestedCodebookTest, ChooseNestedPicksNearestWithoutFeedback) {
  auto cb = DesignNestedCodebook(0.5, BaseGrid::kLloyd);
  ASSERT_THAT(cb, IsOk());
  const NestedChoice c = ChooseNested(*cb, 2.0, 2.0);
  EXPECT_EQ(c.base, 3);
  const NestedChoice d = ChooseNested(*cb, -0.01, -0.01);
  EXPECT_EQ(d.base, 1);
  EXPECT_EQ(d.residual, 3);
}

TEST(NestedCodebookTest, UniformBaseCostsLittleAtTwoBitsAndNothingAtFour) {
  auto lloyd = DesignNestedCodebook(0.5, BaseGrid::kLloyd);
  auto uniform = DesignNestedCodebook(0.5, BaseGrid::kUniform);
  ASSERT_THAT(lloyd, IsOk());
  ASSERT_THAT(uniform, IsOk());
  EXPECT_EQ(uniform->grid, BaseGrid::kUniform);
  const auto dl = GaussianDistortion(*lloyd, 0.5);
  const auto du = GaussianDistortion(*uniform, 0.5);
  // Designed values: 2 bits 0.11887 (Lloyd 0.11750), 4 bits 0.00965 (Lloyd 0.00970).
  EXPECT_GT(du[0], dl[0]);
  EXPECT_LT(du[0], 1.015 * dl[0]);
  EXPECT_LT(du[1], dl[1]);
}

TEST(NestedCodebookTest, UniformBaseIsAnExactEvenGrid) {
  for (double lambda : {0.0, 0.5, 1.0}) {
    auto cb = DesignNestedCodebook(lambda, BaseGrid::kUniform);
    ASSERT_THAT(cb, IsOk());
    const float step = cb->base[3] - cb->base[2];
    // The step the fit lands on for N(0,1) is near 1 (the optimal 4-level even grid: 0.9957).
    EXPECT_NEAR(step, 1.0, 0.07) << lambda;
    EXPECT_EQ(step, static_cast<float>(SnapUniformStep(step))) << lambda;
    for (int b = 0; b < kBaseLevels; ++b) EXPECT_EQ(cb->base[b], step * (b - 1.5f)) << lambda << " " << b;
    // The 4-bit levels stay free, and stay nested and ordered.
    for (int b = 1; b < kBaseLevels; ++b) EXPECT_LT(cb->Level4(b - 1, 3), cb->Level4(b, 0)) << lambda;
  }
}

TEST(NestedCodebookTest, UniformNestedLevelsAreExactEvenGridsAndTheirCost) {
  for (double lambda : {0.0, 0.5, 1.0}) {
    auto cb = DesignNestedCodebook(lambda, BaseGrid::kUniformNested);
    ASSERT_THAT(cb, IsOk());
    EXPECT_EQ(cb->grid, BaseGrid::kUniformNested);
    const float step = cb->base[3] - cb->base[2];
    EXPECT_EQ(step, static_cast<float>(SnapUniformStep(step, kUniformNestedStepBits))) << lambda;
    for (int b = 0; b < kBaseLevels; ++b) {
      EXPECT_EQ(cb->base[b], step * (b - 1.5f)) << lambda << " " << b;
      for (int r = 0; r < kResidualLevels; ++r) {
        // Exactly the GPU's check (kernels/cuda/nq_code_lookup.cuh, UniformNestedStep), and fp16.
        const float level = cb->Level4(b, r);
        EXPECT_EQ(level, 0.25f * (step * (static_cast<float>(4 * b + r) - 7.5f))) << lambda << " " << b << "," << r;
        EXPECT_EQ(level, RoundToHalfPrecision(level));
      }
    }
  }
  // What it costs against the even base with free 4-bit levels (nq encode's default), on N(0,1) at
  // lambda 0.5: 2 bits 0.12142 against 0.11886 (2 % more), 4 bits 0.01662 against 0.00965 (72 %
  // more: one step serves both grids, and the 2-bit optimum, about 1, leaves the 4-bit grid too
  // narrow for the tails; a 4-bit-only fit, step 1.34, would reach 0.01154 at 31 % more 2-bit MSE).
  auto uniform = DesignNestedCodebook(0.5, BaseGrid::kUniform);
  auto nested = DesignNestedCodebook(0.5, BaseGrid::kUniformNested);
  ASSERT_THAT(uniform, IsOk());
  ASSERT_THAT(nested, IsOk());
  const auto du = GaussianDistortion(*uniform, 0.5);
  const auto dn = GaussianDistortion(*nested, 0.5);
  EXPECT_NEAR(du[0], 0.11886, 5e-5);
  EXPECT_NEAR(du[1], 0.00965, 5e-5);
  EXPECT_NEAR(dn[0], 0.12142, 5e-5);
  EXPECT_NEAR(dn[1], 0.01662, 5e-5);
  EXPECT_NEAR(nested->base[3] - nested->base[2], 1.078125, 1e-6);
}

TEST(NestedCodebookTest, BaseGridNamesRoundTripAndAnUnknownOneIsRefused) {
  for (const BaseGrid grid : {BaseGrid::kUniform, BaseGrid::kLloyd, BaseGrid::kUniformNested}) {
    absl::StatusOr<BaseGrid> parsed = ParseBaseGrid(BaseGridName(grid));
    ASSERT_THAT(parsed, IsOk());
    EXPECT_EQ(*parsed, grid);
  }
  EXPECT_THAT(ParseBaseGrid("even"), StatusIs(absl::StatusCode::kInvalidArgument,
                                              HasSubstr("must be uniform, lloyd or uniform_nested, got 'even'")));
  EXPECT_THAT(ParseBaseGrid(""), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("got ''")));
}

TEST(NestedCodebookTest, SnapUniformStepKeepsNineSignificantBits) {
  EXPECT_EQ(SnapUniformStep(1.0), 1.0);
  EXPECT_EQ(SnapUniformStep(0.0), 0.0);
  EXPECT_EQ(SnapUniformStep(1.0 + 1.0 / 4096), 1.0);
  EXPECT_EQ(SnapUniformStep(1.0 + 3.0 / 256), 1.0 + 3.0 / 256);  // 1.00000011b: 9 bits, kept
  EXPECT_EQ(SnapUniformStep(1.0 + 1.0 / 512), 1.0);              // a tie, to even
  EXPECT_EQ(SnapUniformStep(1.0 + 3.0 / 512), 1.0 + 1.0 / 128);  // a tie, to even
  for (double s : {0.37, 0.94, 1.7, 12.3}) {
    const double snapped = SnapUniformStep(s);
    EXPECT_NEAR(snapped, s, s / 512);
    // 1.5 * step fits fp16's 11 significant bits.
    EXPECT_EQ(static_cast<float>(1.5 * snapped), RoundToHalfPrecision(static_cast<float>(1.5 * snapped)));
  }
}

TEST(NestedCodebookTest, RejectsLambdaOutsideUnitInterval) {
  EXPECT_THAT(DesignNestedCodebook(1.5, BaseGrid::kLloyd),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("[0, 1]")));
  EXPECT_THAT(DesignNestedCodebook(-0.1, BaseGrid::kLloyd),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("[0, 1]")));
}

}  // namespace
}  // namespace nq::quant
