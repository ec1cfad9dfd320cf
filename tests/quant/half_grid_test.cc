// The nested codebooks nq encode writes sit on the fp16 grid (nested_codebook.h), so the GPU
// kernels, which hold levels as fp16, use exactly the levels the CPU decoder adds up.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "services/quant/codec.h"
#include "services/quant/nested_codebook.h"
#include "services/quant/nested_scalar_codec.h"

namespace nq::quant {
namespace {

TEST(HalfGridTest, RoundsToNearestEvenAtFp16PrecisionAndSaturates) {
  EXPECT_EQ(RoundToHalfPrecision(1.0f), 1.0f);
  EXPECT_EQ(RoundToHalfPrecision(1.0f / 3.0f), 0.333251953125f);             // fp16 0x3555
  // The fp16 step at 1 is 2^-10: half a step is a tie, broken to the even neighbour.
  EXPECT_EQ(RoundToHalfPrecision(1.0f + 1.0f / 2048.0f), 1.0f);
  EXPECT_EQ(RoundToHalfPrecision(1.0f + 3.0f / 2048.0f), 1.0f + 1.0f / 512.0f);
  EXPECT_EQ(RoundToHalfPrecision(1.0f + 3.0f / 4096.0f), 1.0f + 1.0f / 1024.0f);
  EXPECT_EQ(RoundToHalfPrecision(-2.7182817f), -2.71875f);
  EXPECT_EQ(RoundToHalfPrecision(1e-7f), std::ldexp(2.0f, -24));              // subnormal step
  EXPECT_EQ(RoundToHalfPrecision(1e6f), 65504.0f);
  EXPECT_EQ(RoundToHalfPrecision(-1e6f), -65504.0f);
}

void ExpectOnHalfGrid(const NestedCodebook& cb) {
  for (int b = 0; b < kBaseLevels; ++b) {
    EXPECT_EQ(cb.base[b], RoundToHalfPrecision(cb.base[b])) << "base " << b;
    for (int r = 0; r < kResidualLevels; ++r) {
      // The decoder's float sum, as nested_scalar_codec.cc computes it.
      float level = cb.base[b];
      level += cb.residual[b * kResidualLevels + r];
      EXPECT_EQ(level, RoundToHalfPrecision(level)) << "level " << b << "," << r;
    }
  }
}

TEST(HalfGridTest, DesignedCodebooksAreOnTheGridAndKeepTheirDistortion) {
  for (BaseGrid grid : {BaseGrid::kUniform, BaseGrid::kLloyd}) {
    for (double lambda : {0.0, 0.25, 0.5, 0.75, 1.0}) {
      absl::StatusOr<NestedCodebook> cb = DesignNestedCodebook(lambda, grid);
      ASSERT_TRUE(cb.ok());
      ExpectOnHalfGrid(*cb);
    }
  }
  // lambda = 1 is the 2-bit Lloyd-Max quantiser: its MSE (0.1175) survives the snap.
  absl::StatusOr<NestedCodebook> lloyd = DesignNestedCodebook(1.0, BaseGrid::kLloyd);
  ASSERT_TRUE(lloyd.ok());
  EXPECT_NEAR(GaussianDistortion(*lloyd, 1.0)[0], 0.1175, 5e-4);
}

TEST(HalfGridTest, RefittedCodebooksAreOnTheGrid) {
  // A Lloyd refit moves the levels to this matrix's own means; they are snapped again.
  const int64_t rows = 64, cols = 64;
  std::vector<float> w(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) w[i] = std::sin(0.37f * static_cast<float>(i)) * (1.0f + (i % 7));
  NestedScalarCodec codec;
  EncodeOptions options;
  options.rotation = {.row_block = 64, .col_block = 64, .row_sign_seed = 1, .col_sign_seed = 2};
  options.codebook_refinements = 2;
  absl::StatusOr<EncodedMatrix> m = codec.Encode(w, rows, cols, nullptr, options);
  ASSERT_TRUE(m.ok()) << m.status();
  NestedCodebook cb;
  for (int b = 0; b < kBaseLevels; ++b) cb.base[b] = m->params.base_codebook[b];
  for (int i = 0; i < kBaseLevels * kResidualLevels; ++i) cb.residual[i] = m->params.residual_codebook[i];
  ExpectOnHalfGrid(cb);
  // The default even base grid survives the refits (only its step moves).
  const float step = cb.base[3] - cb.base[2];
  for (int b = 0; b < kBaseLevels; ++b) EXPECT_EQ(cb.base[b], step * (b - 1.5f)) << b;
}

}  // namespace
}  // namespace nq::quant
