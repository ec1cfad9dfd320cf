// dtype_convert: bit-exact conversions against hand-computed values and reference formulas.
#include "services/model/dtype_convert.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/common/status_matchers.h"

namespace nq::model {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;

// float8_e4m3fn by its definition: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent
// 0 is subnormal (m/8 * 2^-6); S.1111.111 is NaN; there are no infinities.
double Fp8Reference(int code) {
  const int sign = code >> 7;
  const int exponent = (code >> 3) & 0xF;
  const int mantissa = code & 0x7;
  if (exponent == 15 && mantissa == 7) return std::numeric_limits<double>::quiet_NaN();
  const double magnitude = exponent == 0 ? std::pow(2.0, -6) * (mantissa / 8.0)
                                         : std::pow(2.0, exponent - 7) * (1.0 + mantissa / 8.0);
  return sign ? -magnitude : magnitude;
}

TEST(Fp8E4M3Test, AllCodesMatchReferenceFormula) {
  for (int code = 0; code < 256; ++code) {
    const double expected = Fp8Reference(code);
    const float got = Fp8E4M3ToFloat(static_cast<uint8_t>(code));
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << code;
    } else {
      EXPECT_EQ(static_cast<double>(got), expected) << "code " << code;
      EXPECT_EQ(std::signbit(got), code >= 0x80) << "code " << code;
    }
  }
}

TEST(Fp8E4M3Test, HandComputedCodes) {
  EXPECT_EQ(Fp8E4M3ToFloat(0x00), 0.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x01), 0x1p-9f);  // smallest subnormal
  EXPECT_EQ(Fp8E4M3ToFloat(0x07), 7 * 0x1p-9f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x08), 0x1p-6f);  // smallest normal
  EXPECT_EQ(Fp8E4M3ToFloat(0x38), 1.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x3C), 1.5f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x7E), 448.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0xFE), -448.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0xC0), -2.0f);
  EXPECT_TRUE(std::isnan(Fp8E4M3ToFloat(0x7F)));
  EXPECT_TRUE(std::isnan(Fp8E4M3ToFloat(0xFF)));
  EXPECT_EQ(Fp8E4M3ToFloat(0x78), 256.0f);  // exponent 15 is finite in the fn variant
}

TEST(Fp8E4M3Test, EncodeRoundTripsEveryCode) {
  for (int code = 0; code < 256; ++code) {
    EXPECT_EQ(FloatToFp8E4M3(Fp8E4M3ToFloat(static_cast<uint8_t>(code))), code) << "code " << code;
  }
}

TEST(Fp8E4M3Test, EncodeRoundsToNearestEvenAndSaturates) {
  EXPECT_EQ(FloatToFp8E4M3(1.0625f), 0x38);  // halfway 1 / 1.125: even mantissa 0
  EXPECT_EQ(FloatToFp8E4M3(1.1875f), 0x3A);  // halfway 1.125 / 1.25: even mantissa 2
  EXPECT_EQ(FloatToFp8E4M3(1.07f), 0x39);
  EXPECT_EQ(FloatToFp8E4M3(0x1p-10f), 0x00);        // halfway 0 / 2^-9: even 0
  EXPECT_EQ(FloatToFp8E4M3(3 * 0x1p-10f), 0x02);    // halfway 2^-9 / 2^-8: even 2
  EXPECT_EQ(FloatToFp8E4M3(15 * 0x1p-10f), 0x08);   // halfway 7*2^-9 / 2^-6: rounds to normal
  EXPECT_EQ(FloatToFp8E4M3(-0.0f), 0x80);
  EXPECT_EQ(FloatToFp8E4M3(432.0f), 0x7E);   // halfway 416 / 448: even mantissa 6
  EXPECT_EQ(FloatToFp8E4M3(430.0f), 0x7D);
  EXPECT_EQ(FloatToFp8E4M3(448.0f), 0x7E);
  EXPECT_EQ(FloatToFp8E4M3(500.0f), 0x7E);
  EXPECT_EQ(FloatToFp8E4M3(-1e30f), 0xFE);
  EXPECT_EQ(FloatToFp8E4M3(std::numeric_limits<float>::infinity()), 0x7E);
  EXPECT_EQ(FloatToFp8E4M3(-std::numeric_limits<float>::infinity()), 0xFE);
  EXPECT_EQ(FloatToFp8E4M3(std::numeric_limits<float>::quiet_NaN()) & 0x7F, 0x7F);
}

// Against exhaustive search: the nearest finite code, ties to the even mantissa.
TEST(Fp8E4M3Test, EncodeIsNearestEvenOnRandomValues) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> log_magnitude(-12.0f, 9.5f);
  for (int i = 0; i < 20000; ++i) {
    float x = std::exp2(log_magnitude(rng)) * ((rng() & 1) ? -1.0f : 1.0f);
    if (i % 7 == 0) {  // exact midpoints between neighbouring codes
      const int code = static_cast<int>(rng() % 0x7E);
      x = (Fp8E4M3ToFloat(code) + Fp8E4M3ToFloat(code + 1)) / 2;
    }
    if (std::fabs(x) >= 448.0f) continue;
    int best = -1;
    double best_error = 1e300;
    for (int code = 0; code < 256; ++code) {
      if ((code & 0x7F) == 0x7F) continue;
      const double error = std::fabs(static_cast<double>(Fp8E4M3ToFloat(code)) - x);
      if (error < best_error || (error == best_error && (code & 1) == 0 && (best & 1) == 1)) {
        best = code;
        best_error = error;
      }
    }
    const uint8_t got = FloatToFp8E4M3(x);
    EXPECT_EQ(std::fabs(static_cast<double>(Fp8E4M3ToFloat(got)) - x), best_error) << x;
    if ((got & 0x7F) != 0) {  // +-0 are both nearest for tiny x
      EXPECT_EQ(got, best) << x;
    }
  }
}

TEST(Bf16Test, HandComputedValues) {
  EXPECT_EQ(Bf16ToFloat(0x3F80), 1.0f);
  EXPECT_EQ(Bf16ToFloat(0xC000), -2.0f);
  EXPECT_EQ(Bf16ToFloat(0x0001), 0x1p-133f);  // smallest subnormal
  EXPECT_EQ(Bf16ToFloat(0x7F80), std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(Bf16ToFloat(0x7FC0)));
  EXPECT_EQ(FloatToBf16(1.0f), 0x3F80);
  EXPECT_EQ(FloatToBf16(1.0f + 0x1p-8f), 0x3F80);      // halfway: even
  EXPECT_EQ(FloatToBf16(1.0f + 3 * 0x1p-8f), 0x3F82);  // halfway: even
  EXPECT_EQ(FloatToBf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3F81);
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()), 0x7F80);  // rounds to inf
  EXPECT_EQ(FloatToBf16(-std::numeric_limits<float>::infinity()), 0xFF80);
  const uint16_t nan = FloatToBf16(std::bit_cast<float>(0x7F800001u));  // payload in low bits
  EXPECT_TRUE(std::isnan(Bf16ToFloat(nan)));
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const float value = Bf16ToFloat(static_cast<uint16_t>(bits));
    if (!std::isnan(value)) {
      EXPECT_EQ(FloatToBf16(value), bits);
    }
  }
}

TEST(F16Test, HandComputedValues) {
  EXPECT_EQ(F16ToFloat(0x3C00), 1.0f);
  EXPECT_EQ(F16ToFloat(0xC000), -2.0f);
  EXPECT_EQ(F16ToFloat(0x0001), 0x1p-24f);          // smallest subnormal
  EXPECT_EQ(F16ToFloat(0x03FF), 1023 * 0x1p-24f);   // largest subnormal
  EXPECT_EQ(F16ToFloat(0x0400), 0x1p-14f);          // smallest normal
  EXPECT_EQ(F16ToFloat(0x7BFF), 65504.0f);
  EXPECT_EQ(F16ToFloat(0x7C00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(F16ToFloat(0xFC00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(F16ToFloat(0x7E00)));
  EXPECT_TRUE(std::isnan(F16ToFloat(0xFC01)));
  EXPECT_TRUE(std::signbit(F16ToFloat(0x8000)));
  EXPECT_TRUE(std::signbit(F16ToFloat(0x8001)));
}

TEST(F16Test, EncodeRoundTripsAndRoundsToNearestEven) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const float value = F16ToFloat(static_cast<uint16_t>(bits));
    if (!std::isnan(value)) {
      EXPECT_EQ(FloatToF16(value), bits) << bits;
    }
  }
  EXPECT_EQ(FloatToF16(0x1p-25f), 0x0000);        // halfway 0 / 2^-24: even
  EXPECT_EQ(FloatToF16(3 * 0x1p-25f), 0x0002);    // halfway 1 / 2: even
  EXPECT_EQ(FloatToF16(2047 * 0x1p-25f), 0x0400); // halfway largest subnormal / smallest normal
  EXPECT_EQ(FloatToF16(1.0f + 0x1p-11f), 0x3C00); // halfway: even
  EXPECT_EQ(FloatToF16(1.0f + 3 * 0x1p-11f), 0x3C02);
  EXPECT_EQ(FloatToF16(65519.0f), 0x7BFF);
  EXPECT_EQ(FloatToF16(65520.0f), 0x7C00);        // halfway 65504 / 2^16: rounds to inf
  EXPECT_EQ(FloatToF16(-1e10f), 0xFC00);
  EXPECT_EQ(FloatToF16(0x1p-30f), 0x0000);
  EXPECT_EQ(FloatToF16(-0x1p-30f), 0x8000);
  EXPECT_EQ(FloatToF16(std::numeric_limits<float>::quiet_NaN()) & 0x7E00, 0x7E00);
}

TEST(ConvertTest, ReadsUnalignedBuffers) {
  std::vector<std::byte> buffer(1 + 3 * 2);
  const uint16_t bf16[3] = {0x3F80, 0xC000, 0x4040};  // 1, -2, 3
  std::memcpy(buffer.data() + 1, bf16, sizeof(bf16));
  absl::StatusOr<std::vector<float>> out =
      ConvertToFloat32(DType::kBF16, std::span<const std::byte>(buffer).subspan(1));
  ASSERT_THAT(out, IsOk());
  EXPECT_EQ(*out, (std::vector<float>{1.0f, -2.0f, 3.0f}));
}

TEST(ConvertTest, EveryFloatDTypeRoundTripsRepresentableValues) {
  const std::vector<float> values = {0.0f, 1.0f, -2.0f, 0.5f, 3.0f, -448.0f, 0.015625f};
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16, DType::kF8E4M3}) {
    absl::StatusOr<std::vector<std::byte>> bytes = ConvertFromFloat32(values, dtype);
    ASSERT_THAT(bytes, IsOk());
    EXPECT_EQ(bytes->size(), values.size() * DTypeSize(dtype));
    absl::StatusOr<std::vector<float>> back = ConvertToFloat32(dtype, *bytes);
    ASSERT_THAT(back, IsOk());
    EXPECT_EQ(*back, values) << DTypeName(dtype);
  }
  const std::vector<std::byte> e5m2 = {std::byte{0x3C}, std::byte{0xC0}, std::byte{0x7C}};
  absl::StatusOr<std::vector<float>> out = ConvertToFloat32(DType::kF8E5M2, e5m2);
  ASSERT_THAT(out, IsOk());
  EXPECT_EQ(*out, (std::vector<float>{1.0f, -2.0f, std::numeric_limits<float>::infinity()}));
}

TEST(ConvertTest, RejectsUnsupportedDTypesAndPartialElements) {
  EXPECT_THAT(ConvertToFloat32(DType::kI32, std::vector<std::byte>(8)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("cannot convert I32 to F32: not a floating-point dtype")));
  EXPECT_THAT(ConvertToFloat32(DType::kF32, std::vector<std::byte>(6)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("6 bytes are not a whole number of F32 elements")));
  EXPECT_THAT(ConvertFromFloat32(std::vector<float>{1.0f}, DType::kU8),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cannot convert F32 to U8")));
}

}  // namespace
}  // namespace nq::model
