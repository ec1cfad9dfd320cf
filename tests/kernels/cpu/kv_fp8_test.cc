// FP8 rows of the latent KV cache (kernels/kv_fp8.h): the tile scale, the rounding bound of E4M3
// codes, partial tiles, zero and NaN tiles, and Backend::WriteRows into packed rows on the CPU
// backend with its width check. Attention over packed rows: cpu/mla_attention_test.cc.
#include "kernels/kv_fp8.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/dtype.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::AllocateOrFail;
using ::nq::kernels::testing::MakeCpuBackend;
using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::RandomNormal;
using ::nq::kernels::testing::StatusIs;
using ::nq::kernels::testing::Upload;
using ::testing::HasSubstr;

float TileScale(const std::vector<std::uint8_t>& row, std::int64_t c, std::int64_t tile) {
  float scale;
  std::memcpy(&scale, row.data() + c + tile * 4, sizeof(scale));
  return scale;
}

TEST(KvFp8, RowsRoundEachValueWithinHalfAnE4M3StepOfItsTile) {
  EXPECT_EQ(KvFp8RowBytes(512), 512 + 16);    // DeepSeek-V3's and GLM-5's latent: 528 bytes
  EXPECT_EQ(KvFp8RowBytes(64), 64 + 4 + 12);  // glm5_nano's: one partial tile, padded to 16
  EXPECT_EQ(KvFp8RowBytes(160), 160 + 8 + 8);
  std::mt19937_64 rng = MakeRng(51);
  for (const std::int64_t c : {std::int64_t{512}, std::int64_t{64}, std::int64_t{160}}) {
    std::vector<float> x = RandomNormal(rng, static_cast<std::size_t>(c), 3.0f);
    x[5] = 0.0f;
    x[c - 1] = -1e-6f;  // deep below its tile's largest: a subnormal code
    std::vector<std::uint8_t> row(static_cast<std::size_t>(KvFp8RowBytes(c)), 0xee);
    std::vector<float> back(static_cast<std::size_t>(c));
    PackKvFp8Row(x.data(), c, row.data());
    for (std::int64_t i = c + 4 * KvFp8Tiles(c); i < KvFp8RowBytes(c); ++i) EXPECT_EQ(row[i], 0) << "padding " << i;
    UnpackKvFp8Row(row.data(), c, back.data());
    for (std::int64_t t = 0; t < KvFp8Tiles(c); ++t) {
      const std::int64_t begin = t * kKvFp8Tile, end = std::min(c, begin + kKvFp8Tile);
      float amax = 0;
      for (std::int64_t i = begin; i < end; ++i) amax = std::max(amax, std::fabs(x[i]));
      const float scale = TileScale(row, c, t);
      EXPECT_EQ(scale, amax / 448.0f) << "c " << c << " tile " << t;
      for (std::int64_t i = begin; i < end; ++i) {
        // E4M3: 3 mantissa bits, so a normal value is within 2^-4 of itself; below 2^-6 (times
        // the scale) codes are subnormal, spaced 2^-9.
        const double bound = std::max(std::fabs(x[i]) * 0.0625, scale * std::ldexp(1.0, -10)) * 1.0001;
        EXPECT_LE(std::fabs(back[i] - x[i]), bound) << "c " << c << " value " << i << " = " << x[i];
      }
    }
    EXPECT_EQ(back[5], 0.0f);
  }
}

TEST(KvFp8, ZeroTilesStayZeroAndNanPoisonsOnlyItsTile) {
  std::vector<float> x(256, 0.0f);
  for (std::int64_t i = 128; i < 256; ++i) x[i] = 0.5f;
  x[130] = std::numeric_limits<float>::quiet_NaN();
  std::vector<std::uint8_t> row(static_cast<std::size_t>(KvFp8RowBytes(256)));
  std::vector<float> back(256);
  PackKvFp8Row(x.data(), 256, row.data());
  UnpackKvFp8Row(row.data(), 256, back.data());
  EXPECT_EQ(TileScale(row, 256, 0), 0.0f);
  for (std::int64_t i = 0; i < 128; ++i) EXPECT_EQ(back[i], 0.0f) << i;
  for (std::int64_t i = 128; i < 256; ++i) EXPECT_TRUE(std::isnan(back[i])) << i;
}

TEST(KvFp8, WriteRowsPacksEachRowAtItsOffset) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  std::mt19937_64 rng = MakeRng(52);
  const std::int64_t c = 160, width = KvFp8RowBytes(c);
  const std::vector<float> src = RandomNormal(rng, static_cast<std::size_t>(2 * c), 1.0f);
  Tensor s = Upload(*backend, src, DType::kF32, {2, c});
  Tensor cache = AllocateOrFail(*backend, DType::kU8, {5, width});
  std::memset(cache.data(), 0xee, cache.nbytes());
  NQ_ASSERT_OK(backend->WriteRows(s, cache, StepPosition(3)));
  std::vector<std::uint8_t> want(static_cast<std::size_t>(width));
  for (std::int64_t r = 0; r < 2; ++r) {
    PackKvFp8Row(src.data() + r * c, c, want.data());
    EXPECT_EQ(std::memcmp(cache.data_as<std::uint8_t>() + (3 + r) * width, want.data(), want.size()), 0) << r;
  }
  EXPECT_EQ(cache.data_as<std::uint8_t>()[2 * width], 0xee);  // rows before the offset untouched
  Tensor narrow = AllocateOrFail(*backend, DType::kU8, {5, c});
  EXPECT_THAT(backend->WriteRows(s, narrow, StepPosition(0)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("packed FP8 rows of 160 values need 176")));
}

}  // namespace
}  // namespace nq::kernels
