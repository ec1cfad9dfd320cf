// Host FP8 quantization (kernels/fp8_block_quantize.h): E4M3 rounding against the exact decoder,
// the block scales of FP8 checkpoints coming back to their stored bytes, and bad input.
#include "kernels/fp8_block_quantize.h"

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::StatusIs;
using ::testing::HasSubstr;

TEST(ToF8E4M3, EveryCodeComesBackFromItsValue) {
  for (int bits = 0; bits < 256; ++bits) {
    const F8E4M3 code{static_cast<std::uint8_t>(bits)};
    EXPECT_EQ(ToF8E4M3(ToFloat(code)).bits, code.bits) << "code 0x" << std::hex << bits;
  }
}

TEST(ToF8E4M3, RoundsHalfwayToEvenAndOtherwiseToNearest) {
  // Every pair of neighbouring positive codes below 448: the midpoint goes to the even code, a
  // hair either side to the nearer one.
  for (int bits = 0; bits < 0x7e; ++bits) {
    const float lo = ToFloat(F8E4M3{static_cast<std::uint8_t>(bits)});
    const float hi = ToFloat(F8E4M3{static_cast<std::uint8_t>(bits + 1)});
    const float mid = 0.5f * (lo + hi);
    const int even = bits % 2 == 0 ? bits : bits + 1;
    EXPECT_EQ(ToF8E4M3(mid).bits, even) << "between codes " << bits << " and " << bits + 1;
    EXPECT_EQ(ToF8E4M3(std::nextafter(mid, 0.0f)).bits, bits);
    EXPECT_EQ(ToF8E4M3(std::nextafter(mid, 1000.0f)).bits, bits + 1);
    EXPECT_EQ(ToF8E4M3(-mid).bits, 0x80 | even);
  }
}

TEST(ToF8E4M3, SaturatesAtTheLargestFiniteValue) {
  EXPECT_EQ(ToF8E4M3(448.0f).bits, 0x7e);
  EXPECT_EQ(ToF8E4M3(470.0f).bits, 0x7e);
  EXPECT_EQ(ToF8E4M3(1e30f).bits, 0x7e);
  EXPECT_EQ(ToF8E4M3(-INFINITY).bits, 0xfe);
  EXPECT_TRUE(std::isnan(ToFloat(ToF8E4M3(NAN))));
  EXPECT_EQ(ToF8E4M3(1e-30f).bits, 0x00);  // below half the smallest subnormal
}

// A matrix as an FP8 checkpoint holds it, dequantized the way the loader reads it (code * scale
// in fp32), with every block's largest magnitude at code 448 as DeepSeek's quantizer leaves it.
TEST(QuantizeBlockScaledFp8, AnFp8CheckpointMatrixComesBackToItsStoredBytes) {
  std::mt19937_64 rng = MakeRng(2301);
  constexpr std::int64_t kRows = 300, kCols = 200;  // partial blocks at both edges
  const std::int64_t rb = 3, cb = 2;
  std::vector<float> scales(rb * cb);
  std::uniform_real_distribution<float> log_scale(-12.0f, -4.0f);
  for (float& s : scales) s = std::exp2(log_scale(rng));
  std::vector<F8E4M3> codes(kRows * kCols);
  std::uniform_int_distribution<int> byte(0, 255);
  for (F8E4M3& c : codes) {
    do c.bits = static_cast<std::uint8_t>(byte(rng));
    while ((c.bits & 0x7f) == 0x7f);  // no NaN
  }
  for (std::int64_t b = 0; b < rb * cb; ++b) {  // each block's first element at +-448
    codes[(b / cb) * 128 * kCols + (b % cb) * 128].bits = b % 2 == 0 ? 0x7e : 0xfe;
  }
  std::vector<float> w(codes.size());
  for (std::int64_t r = 0; r < kRows; ++r) {
    for (std::int64_t c = 0; c < kCols; ++c) {
      w[r * kCols + c] = ToFloat(codes[r * kCols + c]) * scales[(r / 128) * cb + c / 128];
    }
  }
  absl::StatusOr<BlockScaledFp8> q = QuantizeBlockScaledFp8(w, kRows, kCols);
  NQ_ASSERT_OK(q.status());
  EXPECT_EQ(q->scale_rows, rb);
  EXPECT_EQ(q->scale_cols, cb);
  ASSERT_EQ(q->scale_inv.size(), scales.size());
  for (std::size_t b = 0; b < scales.size(); ++b) EXPECT_FLOAT_EQ(q->scale_inv[b], scales[b]) << "block " << b;
  int differing = 0;
  for (std::size_t i = 0; i < codes.size(); ++i) {
    // -0 and +0 dequantize alike; any other byte must be the stored one.
    if (q->values[i].bits != codes[i].bits && (codes[i].bits & 0x7f) != 0) ++differing;
  }
  EXPECT_EQ(differing, 0);
}

TEST(QuantizeBlockScaledFp8, ErrorStaysWithinHalfAStepOfItsBlock) {
  std::mt19937_64 rng = MakeRng(2302);
  constexpr std::int64_t kRows = 130, kCols = 257;
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<float> w(kRows * kCols);
  for (float& v : w) v = normal(rng);
  w[5] = 0.5f;  // one outlier: its block's small values fall into subnormals
  absl::StatusOr<BlockScaledFp8> q = QuantizeBlockScaledFp8(w, kRows, kCols);
  NQ_ASSERT_OK(q.status());
  const std::int64_t cb = (kCols + 127) / 128;
  for (std::int64_t r = 0; r < kRows; ++r) {
    for (std::int64_t c = 0; c < kCols; ++c) {
      const float s = q->scale_inv[(r / 128) * cb + c / 128];
      const float x = w[r * kCols + c] / s, back = ToFloat(q->values[r * kCols + c]);
      // Normals: half of the 3-bit mantissa's step; subnormals: half of 2^-9.
      const float bound = std::fabs(x) >= 0.015625f ? std::fabs(x) / 16.0f : 1.0f / 1024.0f;
      ASSERT_LE(std::fabs(back - x), bound * 1.0001f) << "[" << r << ", " << c << "] " << x << " -> " << back;
    }
  }
}

TEST(QuantizeBlockScaledFp8, AllZeroBlocksGetUnitScalesAndEmptyIsFine) {
  absl::StatusOr<BlockScaledFp8> q = QuantizeBlockScaledFp8(std::vector<float>(3 * 4, 0.0f), 3, 4);
  NQ_ASSERT_OK(q.status());
  EXPECT_EQ(q->scale_inv, std::vector<float>{1.0f});
  for (F8E4M3 v : q->values) EXPECT_EQ(v.bits, 0);
  absl::StatusOr<BlockScaledFp8> empty = QuantizeBlockScaledFp8({}, 0, 5);
  NQ_ASSERT_OK(empty.status());
  EXPECT_TRUE(empty->values.empty());
  EXPECT_TRUE(empty->scale_inv.empty());
}

TEST(QuantizeBlockScaledFp8, RefusesAWrongSizeOrANonFiniteWeight) {
  EXPECT_THAT(QuantizeBlockScaledFp8(std::vector<float>(5), 2, 3).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("5 values for a [2, 3] matrix")));
  std::vector<float> w(6, 1.0f);
  w[4] = NAN;
  EXPECT_THAT(QuantizeBlockScaledFp8(w, 2, 3).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("weight [1, 1] is nan")));
}

}  // namespace
}  // namespace nq::kernels
