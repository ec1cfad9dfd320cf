// FP8 block dequantization (partial edge blocks) and LoadFloat32 over a checkpoint.
#include "services/model/safetensors_load.h"

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "services/model/dtype_convert.h"
#include "services/model/safetensors_writer.h"
#include "tests/common/status_matchers.h"
#include "tests/model/safetensors_test_util.h"

namespace nq::model {
namespace {

using ::nq::model::testing::TempDirTest;
using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// 200 x 300: neither dim is a multiple of 128, so the last row and column of blocks are
// partial (72 rows, 44 columns).
constexpr int64_t kRows = 200;
constexpr int64_t kCols = 300;

TEST(DequantizeFp8BlockTest, AppliesEachBlocksScaleIncludingPartialEdges) {
  std::vector<std::byte> codes(kRows * kCols);
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<std::byte>((i * 37) % 256);
  // scale[i][j] = 2^(i*3 + j): distinct powers of two, so products are exact.
  std::vector<float> scales(2 * 3);
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 3; ++j) scales[i * 3 + j] = std::ldexp(1.0f, i * 3 + j - 2);
  }
  Fp8BlockTensor tensor{codes, kRows, kCols, scales, 2, 3};
  absl::StatusOr<std::vector<float>> out = DequantizeFp8Block(tensor);
  ASSERT_THAT(out, IsOk());
  ASSERT_EQ(out->size(), codes.size());
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t c = 0; c < kCols; ++c) {
      const float code = Fp8E4M3ToFloat(static_cast<uint8_t>(codes[r * kCols + c]));
      const float expected = code * scales[(r / 128) * 3 + c / 128];
      const float got = (*out)[r * kCols + c];
      if (std::isnan(expected)) {
        EXPECT_TRUE(std::isnan(got));
      } else {
        ASSERT_EQ(got, expected) << r << "," << c;
      }
    }
  }
  // Spot checks at the corners of the partial blocks.
  EXPECT_EQ((*out)[199 * kCols + 299],
            Fp8E4M3ToFloat(static_cast<uint8_t>(codes[199 * kCols + 299])) * scales[5]);
  EXPECT_EQ((*out)[128 * kCols + 0],
            Fp8E4M3ToFloat(static_cast<uint8_t>(codes[128 * kCols])) * scales[3]);
}

TEST(DequantizeFp8BlockTest, RejectsMisShapedScalesAndCodes) {
  std::vector<std::byte> codes(kRows * kCols);
  std::vector<float> scales(3, 1.0f);
  EXPECT_THAT(DequantizeFp8Block(Fp8BlockTensor{codes, kRows, kCols, scales, 1, 3}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("FP8 weight [200, 300] with 128x128 blocks needs a scale_inv of "
                                 "shape [2, 3], got [1, 3] holding 3 values")));
  EXPECT_THAT(DequantizeFp8Block(Fp8BlockTensor{std::span(codes).first(10), kRows, kCols, scales,
                                                2, 3}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("needs 200 x 300 codes, got 10")));
  EXPECT_THAT(DequantizeFp8Block(Fp8BlockTensor{codes, kRows, kCols, scales, 2, 3, 0}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("block positive")));
}

TEST(QuantizeFp8BlockTest, RoundTripWithinFp8Precision) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> w(kRows * kCols);
  for (size_t i = 0; i < w.size(); ++i) {
    // A different magnitude per block, to make the scales matter.
    const int64_t r = i / kCols, c = i % kCols;
    w[i] = normal(rng) * std::ldexp(1.0f, static_cast<int>((r / 128) * 3 + c / 128) - 3);
  }
  w[5] = 0.0f;
  absl::StatusOr<Fp8BlockQuantized> q = QuantizeFp8Block(w, kRows, kCols);
  ASSERT_THAT(q, IsOk());
  EXPECT_EQ(q->scale_rows, 2);
  EXPECT_EQ(q->scale_cols, 3);
  absl::StatusOr<std::vector<float>> back =
      DequantizeFp8Block(Fp8BlockTensor{q->codes, kRows, kCols, q->scale_inv, 2, 3});
  ASSERT_THAT(back, IsOk());
  std::vector<float> amax(6, 0.0f);
  for (size_t i = 0; i < w.size(); ++i) {
    const size_t b = (i / kCols / 128) * 3 + (i % kCols) / 128;
    amax[b] = std::max(amax[b], std::fabs(w[i]));
  }
  for (int b = 0; b < 6; ++b) EXPECT_FLOAT_EQ(q->scale_inv[b], amax[b] / 448.0f) << b;
  for (size_t i = 0; i < w.size(); ++i) {
    const size_t b = (i / kCols / 128) * 3 + (i % kCols) / 128;
    const float scale = q->scale_inv[b];
    // Normals carry 3 mantissa bits (relative error <= 2^-4); subnormals a step of 2^-9.
    const float bound = std::max(std::fabs(w[i]) * 0x1p-4f, scale * 0x1p-10f) * 1.0001f;
    ASSERT_LE(std::fabs((*back)[i] - w[i]), bound) << i;
  }
  EXPECT_EQ((*back)[5], 0.0f);
}

TEST(QuantizeFp8BlockTest, ZeroBlockAndBadInput) {
  absl::StatusOr<Fp8BlockQuantized> q = QuantizeFp8Block(std::vector<float>(4, 0.0f), 2, 2);
  ASSERT_THAT(q, IsOk());
  EXPECT_THAT(q->scale_inv, ElementsAre(1.0f));
  EXPECT_THAT(QuantizeFp8Block(std::vector<float>{1, NAN, 2, 3}, 2, 2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("value at [0, 1] is not finite")));
  EXPECT_THAT(QuantizeFp8Block(std::vector<float>(3), 2, 2),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("got 3 values")));
}

class LoadFloat32Test : public TempDirTest {
 protected:
  void SetUp() override {
    TempDirTest::SetUp();
    weight_.resize(kRows * kCols);
    for (size_t i = 0; i < weight_.size(); ++i) weight_[i] = std::sin(0.01f * i);
  }
  std::vector<float> weight_;
};

TEST_F(LoadFloat32Test, DequantizesFp8WithItsScaleAcrossShards) {
  SafetensorsWriter writer;
  ASSERT_THAT(writer.AddFp8BlockQuantized("layers.0.mlp.down_proj.weight", kRows, kCols, weight_),
              IsOk());
  ASSERT_THAT(writer.AddFloat32("norm.weight", {3}, std::vector<float>{1, 2.5f, -3},
                                DType::kBF16),
              IsOk());
  // Small shards put the weight and its scale in different files.
  ASSERT_THAT(writer.WriteCheckpoint(dir(), 1024), IsOk());
  absl::StatusOr<Checkpoint> checkpoint = Checkpoint::Open(dir());
  ASSERT_THAT(checkpoint, IsOk());
  ASSERT_GT(checkpoint->shards().size(), 1u);

  absl::StatusOr<FloatTensor> w = LoadFloat32(*checkpoint, "layers.0.mlp.down_proj.weight");
  ASSERT_THAT(w, IsOk());
  EXPECT_THAT(w->shape, ElementsAre(kRows, kCols));
  absl::StatusOr<Fp8BlockQuantized> q = QuantizeFp8Block(weight_, kRows, kCols);
  ASSERT_THAT(q, IsOk());
  EXPECT_EQ(w->values,
            *DequantizeFp8Block(Fp8BlockTensor{q->codes, kRows, kCols, q->scale_inv, 2, 3}));

  absl::StatusOr<FloatTensor> norm = LoadFloat32(*checkpoint, "norm.weight");
  ASSERT_THAT(norm, IsOk());
  EXPECT_EQ(norm->values, (std::vector<float>{1, 2.5f, -3}));
}

TEST_F(LoadFloat32Test, MissingScaleIsNotFound) {
  SafetensorsWriter writer;
  absl::StatusOr<std::vector<std::byte>> codes = ConvertFromFloat32(weight_, DType::kF8E4M3);
  ASSERT_THAT(codes, IsOk());
  ASSERT_THAT(writer.Add("w.weight", DType::kF8E4M3, {kRows, kCols}, *codes), IsOk());
  ASSERT_THAT(writer.WriteCheckpoint(dir()), IsOk());
  absl::StatusOr<Checkpoint> checkpoint = Checkpoint::Open(dir());
  ASSERT_THAT(checkpoint, IsOk());
  EXPECT_THAT(LoadFloat32(*checkpoint, "w.weight"),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("FP8 tensor 'w.weight' needs its block scale "
                                 "'w.weight_scale_inv', which checkpoint " + dir() +
                                 " does not hold")));
  EXPECT_THAT(LoadFloat32(*checkpoint, "x"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("tensor 'x' not found")));
}

TEST_F(LoadFloat32Test, MisShapedScaleIsInvalid) {
  SafetensorsWriter writer;
  absl::StatusOr<std::vector<std::byte>> codes = ConvertFromFloat32(weight_, DType::kF8E4M3);
  ASSERT_THAT(codes, IsOk());
  ASSERT_THAT(writer.Add("w.weight", DType::kF8E4M3, {kRows, kCols}, *codes), IsOk());
  // [1, 2] as if the weight were 128 x 256 blocks short.
  ASSERT_THAT(writer.AddFloat32("w.weight_scale_inv", {1, 2}, std::vector<float>{1, 1}), IsOk());
  ASSERT_THAT(writer.Add("w2.weight", DType::kF8E4M3, {4}, std::vector<std::byte>(4)), IsOk());
  ASSERT_THAT(writer.AddFloat32("w2.weight_scale_inv", {1, 1}, std::vector<float>{1}), IsOk());
  ASSERT_THAT(writer.Add("ids", DType::kI32, {1}, std::vector<std::byte>(4)), IsOk());
  ASSERT_THAT(writer.WriteCheckpoint(dir()), IsOk());
  absl::StatusOr<Checkpoint> checkpoint = Checkpoint::Open(dir());
  ASSERT_THAT(checkpoint, IsOk());
  EXPECT_THAT(LoadFloat32(*checkpoint, "w.weight"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("FP8 tensor 'w.weight' with scale 'w.weight_scale_inv'"),
                             HasSubstr("needs a scale_inv of shape [2, 3], got [1, 2]"))));
  EXPECT_THAT(LoadFloat32(*checkpoint, "w2.weight"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("the weight must be 2-D F8_E4M3, got F8_E4M3 [4]")));
  EXPECT_THAT(LoadFloat32(*checkpoint, "ids"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tensor 'ids' in " + dir() + ": cannot convert I32 to F32")));
}

}  // namespace
}  // namespace nq::model
