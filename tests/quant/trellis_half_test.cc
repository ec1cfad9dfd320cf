// h(y), the trellis search's rounding to binary16 (services/quant/trellis_half.h), in each of its
// forms against the compiler's float -> _Float16 conversion: the edges where rounding is easy to
// get wrong, then a sweep over float bit patterns. The forms must agree on every float, or the
// search's builds would find different rings. (A one-off run over all 2^32 floats, too slow for
// every build, found no difference either.)
#include "services/quant/trellis_half.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "gtest/gtest.h"
#include "services/common/cpu_features.h"

namespace nq::quant::trellis {
namespace {

float Reference(float y) { return static_cast<float>(static_cast<_Float16>(y)); }

// The edges, each with its negative.
std::vector<float> Edges() {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const std::vector<float> positive = {
      0.0f,
      1.0f,
      1.0f + 0x1p-11f,              // tie at the 10-bit mantissa: to 1 (even)
      1.0f + 3 * 0x1p-11f,          // tie: up to 1 + 2^-9 (even)
      1.0f + 0x1p-11f + 0x1p-23f,   // just past the tie: up
      1.0f + 0x1p-11f - 0x1p-24f,   // just short of it: down
      2049.0f,                      // tie between 2048 and 2050: 2048
      2051.0f,                      // tie: 2052
      0.1f,
      3.14159265f,
      0x1p-14f,                     // least normal
      0x1p-14f + 0x1p-25f,          // tie in the least normal binade (step 2^-24): down
      0x1p-14f + 3 * 0x1p-25f,      // tie: up
      0x1p-14f - 0x1p-25f,          // tie between the largest subnormal and 2^-14: to 2^-14 (even)
      0x1p-14f - 0x1p-24f,          // the largest subnormal
      0x1p-14f - 0x1.8p-24f,        // tie between subnormals 1022 and 1023 * 2^-24: 1022
      0x1p-24f,                     // least subnormal
      0x1p-25f,                     // tie between 0 and 2^-24: 0
      0x1p-25f + 0x1p-40f,          // just past it: 2^-24
      3 * 0x1p-25f,                 // tie between 2^-24 and 2^-23: 2^-23
      1e-8f,                        // below half the least subnormal: 0
      0x1p-126f,                    // least normal float
      0x1p-149f,                    // least subnormal float
      65504.0f,                     // largest binary16
      65519.99f,                    // the float just below 65520: 65504
      65520.0f,                     // tie between 65504 and 2^16: 2^16, past the range: inf
      65536.0f,
      1e30f,
      std::numeric_limits<float>::max(),
      kInf,
  };
  std::vector<float> edges;
  for (float y : positive) {
    edges.push_back(y);
    edges.push_back(-y);
  }
  return edges;
}

// Every 65521st float bit pattern (a prime step, so every exponent and many mantissas), NaNs too.
std::vector<float> Sweep() {
  std::vector<float> sweep;
  for (uint64_t u = 0; u <= 0xFFFFFFFFu; u += 65521) sweep.push_back(std::bit_cast<float>(static_cast<uint32_t>(u)));
  return sweep;
}

// Same bits, or both NaN (a NaN's payload is not part of h's contract).
void ExpectSameAsReference(const std::vector<float>& in, const std::vector<float>& out, const char* form) {
  ASSERT_EQ(in.size(), out.size());
  for (size_t i = 0; i < in.size(); ++i) {
    const float want = Reference(in[i]);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(out[i])) << form << ": h(" << std::hexfloat << in[i] << ") = " << out[i];
    } else {
      EXPECT_EQ(std::bit_cast<uint32_t>(out[i]), std::bit_cast<uint32_t>(want))
          << form << ": h(" << std::hexfloat << in[i] << ") = " << out[i] << ", want " << want;
    }
  }
}

TEST(TrellisHalfTest, ReferenceRoundsToNearestEvenAndOverflowsToInf) {
  // The reference conversion itself, on a few edges with their values spelt out.
  EXPECT_EQ(Reference(1.0f + 0x1p-11f), 1.0f);
  EXPECT_EQ(Reference(1.0f + 3 * 0x1p-11f), 1.0f + 0x1p-9f);
  EXPECT_EQ(Reference(0x1p-14f - 0x1p-25f), 0x1p-14f);
  EXPECT_EQ(Reference(0x1p-25f), 0.0f);
  EXPECT_EQ(Reference(3 * 0x1p-25f), 0x1p-23f);
  EXPECT_EQ(Reference(65519.99f), 65504.0f);
  EXPECT_EQ(Reference(65520.0f), std::numeric_limits<float>::infinity());
  EXPECT_EQ(Reference(-65520.0f), -std::numeric_limits<float>::infinity());
}

TEST(TrellisHalfTest, ScalarFormMatchesTheCompilersConversion) {
  for (const std::vector<float>& in : {Edges(), Sweep()}) {
    std::vector<float> out(in.size());
    for (size_t i = 0; i < in.size(); ++i) out[i] = RoundHalf(in[i]);
    ExpectSameAsReference(in, out, "scalar");
  }
  EXPECT_TRUE(std::isnan(RoundHalf(std::numeric_limits<float>::quiet_NaN())));
}

#if defined(__SSE2__)
TEST(TrellisHalfTest, Sse2FormMatchesTheCompilersConversion) {
  for (std::vector<float> in : {Edges(), Sweep()}) {
    in.resize((in.size() + 3) / 4 * 4, 0.0f);
    std::vector<float> out(in.size());
    for (size_t i = 0; i < in.size(); i += 4) _mm_storeu_ps(&out[i], RoundHalfSse2(_mm_loadu_ps(&in[i])));
    ExpectSameAsReference(in, out, "SSE2");
  }
}
#endif

// Every binary16 bit pattern that is not NaN, as the float it stands for.
std::vector<float> AllHalfValues() {
  std::vector<float> values;
  for (uint32_t bits = 0; bits <= 0xFFFF; ++bits) {
    const float v = static_cast<float>(std::bit_cast<_Float16>(static_cast<uint16_t>(bits)));
    if (!std::isnan(v)) values.push_back(v);
  }
  return values;
}

// The differences RoundDifference* is for: xh - vh as the search forms them, xh a target (binary16,
// |xh| <= 64; every 97th pattern, a prime step, and the edges) and vh any binary16 value but NaN
// (every 5th, and the edges).
std::vector<float> Differences() {
  const std::vector<float> all = AllHalfValues();
  std::vector<float> targets = {0.0f, -0.0f, 1.0f, -1.0f, 0x1p-24f, -0x1p-24f, 64.0f, -64.0f, 0x1p-14f};
  std::vector<float> values = {0.0f, 0x1p-24f, 0x1p-14f, 65504.0f, -65504.0f, std::numeric_limits<float>::infinity(),
                               -std::numeric_limits<float>::infinity()};
  for (size_t i = 0; i < all.size(); ++i) {
    if (i % 97 == 0 && std::fabs(all[i]) <= 64.0f) targets.push_back(all[i]);
    if (i % 5 == 0) values.push_back(all[i]);
  }
  std::vector<float> differences;
  for (float xh : targets) {
    for (float vh : values) differences.push_back(xh - vh);
  }
  return differences;
}

// What the search needs of d = RoundDifference*(y): h(y) itself below 65520 (bit for bit, the sign
// of zero too), and beyond, a value whose square rounds to inf as h(y)'s does.
void ExpectSameDifference(const std::vector<float>& in, const std::vector<float>& out, const char* form) {
  ASSERT_EQ(in.size(), out.size());
  for (size_t i = 0; i < in.size(); ++i) {
    const float want = Reference(in[i]);
    if (std::fabs(in[i]) < 65520.0f) {
      EXPECT_EQ(std::bit_cast<uint32_t>(out[i]), std::bit_cast<uint32_t>(want))
          << form << ": d(" << std::hexfloat << in[i] << ") = " << out[i] << ", want " << want;
    } else {
      EXPECT_EQ(Reference(out[i] * out[i]), std::numeric_limits<float>::infinity())
          << form << ": d(" << std::hexfloat << in[i] << ") = " << out[i] << " squares to a finite value";
    }
  }
}

#if defined(__SSE2__)
TEST(TrellisHalfTest, Sse2DifferenceFormMatchesTheCompilersConversion) {
  std::vector<float> in = Differences();
  in.resize((in.size() + 3) / 4 * 4, 0.0f);
  std::vector<float> out(in.size());
  for (size_t i = 0; i < in.size(); i += 4) _mm_storeu_ps(&out[i], RoundDifferenceSse2(_mm_loadu_ps(&in[i])));
  ExpectSameDifference(in, out, "SSE2 difference");
}

TEST(TrellisHalfTest, Sse2WidensEveryNonNegativePatternExactly) {
  for (uint32_t bits = 0; bits <= 0x7C00; bits += 4) {
    const __m128i four = _mm_setr_epi32(static_cast<int>(bits), static_cast<int>(bits + 1), static_cast<int>(bits + 2),
                                        static_cast<int>(bits + 3));
    float out[4];
    _mm_storeu_ps(out, HalfBitsToFloatSse2(four));
    for (uint32_t k = 0; k < 4 && bits + k <= 0x7C00; ++k) {
      const float want = static_cast<float>(std::bit_cast<_Float16>(static_cast<uint16_t>(bits + k)));
      EXPECT_EQ(std::bit_cast<uint32_t>(out[k]), std::bit_cast<uint32_t>(want)) << "pattern 0x" << std::hex << bits + k;
    }
  }
}

TEST(TrellisHalfTest, Sse2PacksNonNegativeFloatsAsTheCompilerConverts) {
  for (const std::vector<float>& sample : {Edges(), Sweep()}) {
    std::vector<float> in;
    for (float y : sample) {
      if (!std::signbit(y) && !std::isnan(y)) in.push_back(y);
    }
    in.resize((in.size() + 7) / 8 * 8, 0.0f);
    for (size_t i = 0; i < in.size(); i += 8) {
      uint16_t out[8];
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                       PackHalfBitsSse2(_mm_loadu_ps(&in[i]), _mm_loadu_ps(&in[i + 4])));
      for (size_t k = 0; k < 8; ++k) {
        EXPECT_EQ(out[k], std::bit_cast<uint16_t>(static_cast<_Float16>(in[i + k])))
            << "h(" << std::hexfloat << in[i + k] << ")";
      }
    }
  }
}
#endif

#if defined(__x86_64__)
__attribute__((target("avx2,f16c"))) void RoundEightF16c(const float* in, float* out) {
  _mm256_storeu_ps(out, RoundHalfF16c(_mm256_loadu_ps(in)));
}

TEST(TrellisHalfTest, F16cFormMatchesTheCompilersConversion) {
  if (!CpuHasAvx2F16c()) GTEST_SKIP() << "this CPU has no AVX2 + F16C";
  for (std::vector<float> in : {Edges(), Sweep()}) {
    in.resize((in.size() + 7) / 8 * 8, 0.0f);
    std::vector<float> out(in.size());
    for (size_t i = 0; i < in.size(); i += 8) RoundEightF16c(&in[i], &out[i]);
    ExpectSameAsReference(in, out, "F16C");
  }
}

__attribute__((target("avx2,f16c"))) void RoundEightDifferencesAvx2(const float* in, float* out) {
  _mm256_storeu_ps(out, RoundDifferenceAvx2(_mm256_loadu_ps(in)));
}

TEST(TrellisHalfTest, Avx2DifferenceFormMatchesTheCompilersConversion) {
  if (!CpuHasAvx2F16c()) GTEST_SKIP() << "this CPU has no AVX2 + F16C";
  std::vector<float> in = Differences();
  in.resize((in.size() + 7) / 8 * 8, 0.0f);
  std::vector<float> out(in.size());
  for (size_t i = 0; i < in.size(); i += 8) RoundEightDifferencesAvx2(&in[i], &out[i]);
  ExpectSameDifference(in, out, "AVX2 difference");
}
#endif

}  // namespace
}  // namespace nq::quant::trellis
