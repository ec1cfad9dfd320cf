// CPU MatMulBlockScaled (FP8 E4M3 weights with 128 x 128 block scales) against a double reference
// that decodes E4M3 on its own (not through kernels/dtype.h), and its argument errors.
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::AllocateOrFail;
using ::nq::kernels::testing::Download;
using ::nq::kernels::testing::MakeCpuBackend;
using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::NormalizedError;
using ::nq::kernels::testing::RandomE4M3;
using ::nq::kernels::testing::RandomInt;
using ::nq::kernels::testing::RandomUniform;
using ::nq::kernels::testing::StatusIs;
using ::nq::kernels::testing::Upload;
using ::nq::kernels::testing::UploadBytes;
using ::testing::HasSubstr;

// fp32 products (weight * scale rounded once) summed in fp32 over k <= ~700 terms.
constexpr double kTolerance = 1e-5;
constexpr std::int64_t kBlock = 128;  // the checkpoints' weight_block_size

// OCP E4M3 by its definition: exponent field e (bias 7), mantissa m; e == 0 is subnormal
// (m * 2^-9); S.1111.111 is NaN; no infinities.
double DecodeE4M3(std::uint8_t b) {
  const int e = (b >> 3) & 0xf;
  const int m = b & 0x7;
  if (e == 0xf && m == 0x7) return std::numeric_limits<double>::quiet_NaN();
  const double magnitude = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
  return (b & 0x80) != 0 ? -magnitude : magnitude;
}

std::int64_t Blocks(std::int64_t d) { return (d + kBlock - 1) / kBlock; }

struct Dims {
  std::int64_t m, n, k;
};

// Scales as checkpoints hold them: positive, a few binades apart block to block.
std::vector<float> RandomScales(std::mt19937_64& rng, const Dims& d) {
  std::vector<float> scales = RandomUniform(rng, Blocks(d.n) * Blocks(d.k), 0.5f, 1.0f);
  for (float& s : scales) s = std::ldexp(s, static_cast<int>(RandomInt(rng, -12, -4)));
  return scales;
}

std::vector<double> RefBlockScaled(std::span<const float> x, std::span<const std::uint8_t> w,
                                   std::span<const float> scales, const Dims& d) {
  std::vector<double> y(d.m * d.n);
  for (std::int64_t i = 0; i < d.m; ++i) {
    for (std::int64_t j = 0; j < d.n; ++j) {
      double sum = 0.0;
      for (std::int64_t p = 0; p < d.k; ++p) {
        const double scale = scales[(j / kBlock) * Blocks(d.k) + p / kBlock];
        sum += double{x[i * d.k + p]} * DecodeE4M3(w[j * d.k + p]) * scale;
      }
      y[i * d.n + j] = sum;
    }
  }
  return y;
}

TEST(CpuMatMulBlockScaled, DecodesEveryE4M3Byte) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  // w[j, 0] = byte j with scale 1 and x = 1: y[0, j] is the decoded byte itself.
  std::vector<std::uint8_t> bytes(256);
  for (int j = 0; j < 256; ++j) bytes[j] = static_cast<std::uint8_t>(j);
  Tensor x = Upload(*backend, std::vector<float>{1.0f}, DType::kF32, {1, 1});
  Tensor w = UploadBytes(*backend, bytes, DType::kF8E4M3, {256, 1});
  Tensor scale = Upload(*backend, std::vector<float>{1.0f, 1.0f}, DType::kF32, {2, 1});
  Tensor y = AllocateOrFail(*backend, DType::kF32, {1, 256});
  NQ_ASSERT_OK(backend->MatMulBlockScaled(x, w, scale, y));
  const std::vector<float> got = Download(*backend, y);
  for (int j = 0; j < 256; ++j) {
    const double want = DecodeE4M3(static_cast<std::uint8_t>(j));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got[j])) << "byte 0x" << std::hex << j;
    } else {
      EXPECT_EQ(double{got[j]}, want) << "byte 0x" << std::hex << j;
    }
  }
  EXPECT_EQ(got[0x7e], 448.0f);
  EXPECT_EQ(got[0x01], 0.001953125f);  // the smallest subnormal, 2^-9
  EXPECT_EQ(got[0x80], 0.0f);  // -0 (its sign is lost in the sum, which starts at +0)
}

TEST(CpuMatMulBlockScaled, MatchesDoubleReferenceOnRaggedShapes) {
  std::mt19937_64 rng = MakeRng(131);
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  // n and k cross and miss 128-block boundaries; m covers the decode sizes and beyond.
  std::vector<Dims> cases = {{1, 1, 1},    {1, 129, 257}, {2, 128, 128}, {3, 300, 130},
                             {5, 7, 700},  {8, 257, 383}, {9, 130, 129}};
  for (int i = 0; i < 4; ++i) {
    cases.push_back({RandomInt(rng, 1, 12), RandomInt(rng, 1, 400), RandomInt(rng, 1, 600)});
  }
  for (const Dims& d : cases) {
    SCOPED_TRACE(absl::StrCat("m=", d.m, " n=", d.n, " k=", d.k));
    const std::vector<float> x = RandomUniform(rng, d.m * d.k, -1.0f, 1.0f);
    const std::vector<std::uint8_t> w = RandomE4M3(rng, d.n * d.k, /*allow_nan=*/false);
    const std::vector<float> scales = RandomScales(rng, d);
    Tensor tx = Upload(*backend, x, DType::kF32, {d.m, d.k});
    Tensor tw = UploadBytes(*backend, w, DType::kF8E4M3, {d.n, d.k});
    Tensor ts = Upload(*backend, scales, DType::kF32, {Blocks(d.n), Blocks(d.k)});
    Tensor ty = AllocateOrFail(*backend, DType::kF32, {d.m, d.n});
    NQ_ASSERT_OK(backend->MatMulBlockScaled(tx, tw, ts, ty));
    EXPECT_LT(NormalizedError(Download(*backend, ty), RefBlockScaled(x, w, scales, d)),
              kTolerance);
  }
}

TEST(CpuMatMulBlockScaled, NanWeightPoisonsOnlyItsOutputs) {
  std::mt19937_64 rng = MakeRng(132);
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  const Dims d{2, 6, 40};
  std::vector<std::uint8_t> w = RandomE4M3(rng, d.n * d.k, /*allow_nan=*/false);
  w[3 * d.k + 17] = 0xff;  // -NaN in row 3
  Tensor tx = Upload(*backend, RandomUniform(rng, d.m * d.k, -1.0f, 1.0f), DType::kF32, {2, 40});
  Tensor tw = UploadBytes(*backend, w, DType::kF8E4M3, {d.n, d.k});
  Tensor ts = Upload(*backend, std::vector<float>{0.01f}, DType::kF32, {1, 1});
  Tensor ty = AllocateOrFail(*backend, DType::kF32, {d.m, d.n});
  NQ_ASSERT_OK(backend->MatMulBlockScaled(tx, tw, ts, ty));
  const std::vector<float> y = Download(*backend, ty);
  for (std::int64_t i = 0; i < d.m; ++i) {
    for (std::int64_t j = 0; j < d.n; ++j) {
      EXPECT_EQ(std::isnan(y[i * d.n + j]), j == 3) << "y[" << i << ", " << j << "]";
    }
  }
}

class CpuMatMulBlockScaledErrors : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> backend_ = MakeCpuBackend();
  Tensor x_ = AllocateOrFail(*backend_, DType::kF32, {2, 300});
  Tensor w_ = AllocateOrFail(*backend_, DType::kF8E4M3, {130, 300});
  Tensor scale_ = AllocateOrFail(*backend_, DType::kF32, {2, 3});
  Tensor y_ = AllocateOrFail(*backend_, DType::kF32, {2, 130});
};

TEST_F(CpuMatMulBlockScaledErrors, PlainMatMulRefusesFp8Weights) {
  EXPECT_THAT(backend_->MatMul(x_, w_, y_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("MatMul: w F8_E4M3[130, 300] needs its block scales; use "
                                 "MatMulBlockScaled")));
}

TEST_F(CpuMatMulBlockScaledErrors, PlainMatMulRefusesIntegerWeights) {
  Tensor w = AllocateOrFail(*backend_, DType::kI32, {130, 300});
  EXPECT_THAT(backend_->MatMul(x_, w, y_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("MatMul: w must be F32, BF16 or F16, got I32[130, 300]")));
}

TEST_F(CpuMatMulBlockScaledErrors, RejectsWeightsThatAreNotFp8) {
  Tensor w = AllocateOrFail(*backend_, DType::kBF16, {130, 300});
  EXPECT_THAT(backend_->MatMulBlockScaled(x_, w, scale_, y_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("MatMulBlockScaled: w_fp8 must be F8_E4M3, got BF16[130, 300]")));
}

TEST_F(CpuMatMulBlockScaledErrors, RejectsScalesOfTheWrongShape) {
  Tensor scale = AllocateOrFail(*backend_, DType::kF32, {2, 2});
  EXPECT_THAT(backend_->MatMulBlockScaled(x_, w_, scale, y_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("MatMulBlockScaled: scale_inv is F32[2, 2], expected [2, 3] "
                                 "from w_fp8 F8_E4M3[130, 300] in 128 x 128 blocks")));
}

TEST_F(CpuMatMulBlockScaledErrors, RejectsScalesThatAreNotF32) {
  Tensor scale = AllocateOrFail(*backend_, DType::kBF16, {2, 3});
  EXPECT_THAT(backend_->MatMulBlockScaled(x_, w_, scale, y_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("MatMulBlockScaled: scale_inv must be F32, got BF16[2, 3]")));
}

TEST_F(CpuMatMulBlockScaledErrors, RejectsInnerDimensionMismatch) {
  Tensor x = AllocateOrFail(*backend_, DType::kF32, {2, 299});
  EXPECT_THAT(backend_->MatMulBlockScaled(x, w_, scale_, y_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("MatMulBlockScaled: x F32[2, 299] and w F8_E4M3[130, 300] "
                                 "disagree on k (299 vs 300)")));
}

TEST_F(CpuMatMulBlockScaledErrors, RejectsScalesFromAnotherBackend) {
  std::unique_ptr<Backend> other = MakeCpuBackend();
  Tensor scale = AllocateOrFail(*other, DType::kF32, {2, 3});
  EXPECT_THAT(backend_->MatMulBlockScaled(x_, w_, scale, y_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("MatMulBlockScaled: scale_inv F32[2, 3] belongs to another "
                                 "backend")));
}

}  // namespace
}  // namespace nq::kernels
