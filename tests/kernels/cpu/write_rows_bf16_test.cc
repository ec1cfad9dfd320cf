// CPU WriteRows into a BF16 destination (the BF16 latent KV cache): each F32 value is stored
// rounded to nearest even, checked bit for bit against hand-derived patterns, at an offset that
// leaves the other rows alone; and the dtype combinations WriteRows refuses.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/dtype.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::AllocateOrFail;
using ::nq::kernels::testing::Download;
using ::nq::kernels::testing::MakeCpuBackend;
using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::RandomNormal;
using ::nq::kernels::testing::StatusIs;
using ::nq::kernels::testing::Upload;
using ::testing::HasSubstr;

float FromBits(std::uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

std::uint32_t Bits(float f) {
  std::uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

TEST(CpuWriteRowsBf16, RoundsToNearestEvenBitForBit) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  // {fp32 input bits, expected bf16 bits}. bf16 keeps the top 16 bits of the fp32 pattern; the
  // low 16 bits decide the rounding: above 0x8000 up, below down, exactly 0x8000 (a tie) to the
  // even one of the two neighbours.
  struct Case {
    std::uint32_t in;
    std::uint16_t want;
  };
  const std::vector<Case> cases = {
      {0x3f800000u, 0x3f80u},  // 1.0: exact
      {0x3f808000u, 0x3f80u},  // 1 + 2^-8: tie between 0x3f80 (even) and 0x3f81 -> down
      {0x3f818000u, 0x3f82u},  // 1 + 3 * 2^-8: tie between 0x3f81 and 0x3f82 (even) -> up
      {0x3f807fffu, 0x3f80u},  // just below the tie -> down
      {0x3f808001u, 0x3f81u},  // just above the tie -> up
      {0xbf808000u, 0xbf80u},  // -(1 + 2^-8): ties are symmetric in sign -> -1.0
      {0xbf818000u, 0xbf82u},  // -(1 + 3 * 2^-8) -> -(1 + 2^-6)
      {0xc0a7ffffu, 0xc0a8u},  // -5.25 - 1ulp: the carry goes into the mantissa -> -5.25
      {0x3fffc000u, 0x4000u},  // just under 2: rounds up across the exponent to 2.0
      {0x7f7fffffu, 0x7f80u},  // FLT_MAX overflows to +inf
      {0xff7fffffu, 0xff80u},  // -FLT_MAX to -inf
      {0x00018000u, 0x0002u},  // subnormal tie, odd neighbour 0x0001 -> up to 0x0002
      {0x80000000u, 0x8000u},  // -0.0 keeps its sign
  };
  std::vector<float> src;
  for (const Case& c : cases) src.push_back(FromBits(c.in));
  src.push_back(std::nanf(""));
  const std::int64_t n = static_cast<std::int64_t>(src.size());
  Tensor tsrc = Upload(*backend, src, DType::kF32, {n, 1});
  Tensor tdst = AllocateOrFail(*backend, DType::kBF16, {n, 1});
  NQ_ASSERT_OK(backend->WriteRows(tsrc, tdst, 0));
  // Widening bf16 -> f32 is exact, so the downloaded floats carry the stored bits.
  const std::vector<float> got = Download(*backend, tdst);
  ASSERT_EQ(got.size(), src.size());
  for (std::size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(Bits(got[i]), std::uint32_t{cases[i].want} << 16)
        << "input 0x" << std::hex << cases[i].in;
  }
  EXPECT_TRUE(std::isnan(got.back()));
}

TEST(CpuWriteRowsBf16, WritesAtTheOffsetAndLeavesOtherRows) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  constexpr std::int64_t kRows = 6, kCols = 3;
  // Small integers are exact in bf16, so the untouched rows must come back unchanged.
  std::vector<float> cache(kRows * kCols);
  for (std::size_t i = 0; i < cache.size(); ++i) cache[i] = -static_cast<float>(i);
  Tensor tdst = Upload(*backend, cache, DType::kBF16, {kRows, kCols});
  // 1 + 2^-8 ties down to 1; 3 + 2^-6 (0x40410000) is exact in bf16 (7 mantissa bits).
  const std::vector<float> src = {FromBits(0x3f808000u), 3.015625f, -2.0f,
                                  FromBits(0x3f818000u), 0.5f,      7.0f};
  Tensor tsrc = Upload(*backend, src, DType::kF32, {2, kCols});
  NQ_ASSERT_OK(backend->WriteRows(tsrc, tdst, 3));
  std::vector<float> want = cache;
  const std::vector<float> rounded = {1.0f, 3.015625f, -2.0f, 1.015625f, 0.5f, 7.0f};
  std::copy(rounded.begin(), rounded.end(), want.begin() + 3 * kCols);
  EXPECT_EQ(Download(*backend, tdst), want);
  // An empty write at the very end is in range.
  Tensor empty = AllocateOrFail(*backend, DType::kF32, {0, kCols});
  NQ_EXPECT_OK(backend->WriteRows(empty, tdst, kRows));
}

TEST(CpuWriteRowsBf16, LargeWriteMatchesElementwiseRounding) {
  // Past the CPU backend's threading threshold (2^20 elements): the threads split the
  // destination and each element is still rounded on its own.
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  std::mt19937_64 rng = MakeRng(3601);
  constexpr std::int64_t kRows = 2100, kCols = 576, kOffset = 7, kCacheRows = kRows + 9;
  const std::vector<float> src = RandomNormal(rng, kRows * kCols, 3.0f);
  Tensor tsrc = Upload(*backend, src, DType::kF32, {kRows, kCols});
  Tensor tdst = Upload(*backend, std::vector<float>(kCacheRows * kCols, 0.25f), DType::kBF16,
                       {kCacheRows, kCols});
  NQ_ASSERT_OK(backend->WriteRows(tsrc, tdst, kOffset));
  const std::vector<float> got = Download(*backend, tdst);
  ASSERT_EQ(got.size(), static_cast<std::size_t>(kCacheRows * kCols));
  std::int64_t mismatches = 0;
  for (std::int64_t i = 0; i < kCacheRows * kCols; ++i) {
    const std::int64_t row = i / kCols;
    const float want = row >= kOffset && row < kOffset + kRows
                           ? ToFloat(ToBf16(src[i - kOffset * kCols]))
                           : 0.25f;
    mismatches += Bits(got[i]) != Bits(want);
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(CpuWriteRowsBf16, RejectsOtherDTypeCombinations) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  Tensor f32 = AllocateOrFail(*backend, DType::kF32, {2, 4});
  Tensor bf16_src = AllocateOrFail(*backend, DType::kBF16, {2, 4});
  Tensor bf16_dst = AllocateOrFail(*backend, DType::kBF16, {8, 4});
  Tensor f16_dst = AllocateOrFail(*backend, DType::kF16, {8, 4});
  Tensor i32_dst = AllocateOrFail(*backend, DType::kI32, {8, 4});
  // The cache is written from the model's F32 activations only: a BF16 source is refused, to
  // either destination dtype.
  EXPECT_THAT(backend->WriteRows(bf16_src, bf16_dst, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("WriteRows: src must be F32, got BF16[2, 4]")));
  EXPECT_THAT(backend->WriteRows(bf16_src, f32, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("WriteRows: src must be F32, got BF16[2, 4]")));
  EXPECT_THAT(backend->WriteRows(f32, f16_dst, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("WriteRows: dst must be F32, BF16 or U8, got F16[8, 4]")));
  EXPECT_THAT(backend->WriteRows(f32, i32_dst, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("WriteRows: dst must be F32, BF16 or U8, got I32[8, 4]")));
  // Shape errors still name the BF16 destination.
  EXPECT_THAT(backend->WriteRows(f32, bf16_dst, 7),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("WriteRows: rows [7, 7 + 2) of src F32[2, 4] do not fit in dst "
                                 "BF16[8, 4]")));
}

}  // namespace
}  // namespace nq::kernels
