// The NVFP4 GEMV's register-level code (kernels/cuda/nvfp4_fragment.h, run by nvfp4_gemv.cu) on
// the host: the E2M1 prmt decode against the format's definition for every code in every nibble
// position, and a whole 16-row tile emulated warp step by warp step -- each lane's loads, decode,
// scaling and fragments exactly as the kernel makes them, the m16n8k16 MMA from the PTX ISA's
// fragment layout, the accumulators stored as the kernel stores them -- against a double
// reference. Runs without a GPU, so a layout or decode mistake fails here before a device run.
#include "kernels/cuda/nvfp4_fragment.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "kernels/nvfp4_codes.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::RandomE4M3;

constexpr int kWarpSize = 32;
constexpr int kTileRows = 16;
constexpr int kMmaCols = 8;

float HalfValue(std::uint16_t bits) { return ToFloat(F16{bits}); }
float LowHalf(std::uint32_t pair) { return HalfValue(static_cast<std::uint16_t>(pair & 0xFFFFu)); }
float HighHalf(std::uint32_t pair) { return HalfValue(static_cast<std::uint16_t>(pair >> 16)); }

void ExpectSameValue(float got, float want, const std::string& what) {
  if (std::isnan(want)) {
    EXPECT_TRUE(std::isnan(got)) << what;
    return;
  }
  EXPECT_EQ(got, want) << what;
  EXPECT_EQ(std::signbit(got), std::signbit(want)) << what;
}

// Every code in every nibble of a word, the other nibbles random: element 2i is the low nibble of
// byte i (ModelOpt); pair i holds elements PairElement(i, 0) and PairElement(i, 1), each the code's
// value times 2^-14.
TEST(Nvfp4Fragment, DecodeE2M1WordMatchesTheDefinition) {
  std::mt19937_64 rng = MakeRng(5401);
  for (int position = 0; position < 8; ++position) {
    for (std::uint32_t code = 0; code < 16; ++code) {
      const std::uint32_t w =
          (static_cast<std::uint32_t>(rng()) & ~(0xFu << (4 * position))) | (code << (4 * position));
      std::uint32_t pairs[4];
      nvfp4::DecodeE2M1Word(w, pairs);
      for (int i = 0; i < 4; ++i) {
        for (int half = 0; half < 2; ++half) {
          const int e = nvfp4::PairElement(i, half);
          const float got = (half == 0 ? LowHalf(pairs[i]) : HighHalf(pairs[i])) * 16384.0f;
          const std::uint8_t element_code = static_cast<std::uint8_t>((w >> (4 * e)) & 0xFu);
          ExpectSameValue(got, E2M1ToFloat(element_code),
                          absl::StrCat("word ", absl::Hex(w), " element ", e, " code ", element_code));
        }
      }
    }
  }
}

// The pairs cover the word's eight elements once each, in the order the inputs are stored.
TEST(Nvfp4Fragment, PairsCoverTheWordInTheInputOrder) {
  std::array<int, 8> seen{};
  for (int i = 0; i < 4; ++i) {
    for (int half = 0; half < 2; ++half) {
      const int e = nvfp4::PairElement(i, half);
      ASSERT_GE(e, 0);
      ASSERT_LT(e, 8);
      ++seen[e];
      EXPECT_EQ(nvfp4::Nvfp4InputPosition(e), 2 * i + half) << "element " << e;
    }
  }
  for (int e = 0; e < 8; ++e) EXPECT_EQ(seen[e], 1) << "element " << e;
}

// Host PTX prmt against hand-worked selectors (the emulation the decode test relies on).
TEST(Nvfp4Fragment, PrmtEmulationFollowsThePtxDefinition) {
  EXPECT_EQ(nvfp4::Prmt(0x33221100u, 0x77665544u, 0x3210u), 0x33221100u);
  EXPECT_EQ(nvfp4::Prmt(0x33221100u, 0x77665544u, 0x4567u), 0x44556677u);
  // Sign-replicate mode: selector 9 reads byte 1 (0x7F) as 0x00, selector 8 byte 0 (0x80) as 0xFF.
  EXPECT_EQ(nvfp4::Prmt(0x7F80u, 0u, 0x8989u), 0xFF00FF00u);
  // Only the low 16 bits of the selector count.
  EXPECT_EQ(nvfp4::Prmt(0x33221100u, 0x77665544u, 0xFFFF3210u), 0x33221100u);
}

struct TileCase {
  int rows;    // rows of the projection (the tile is rows 0..15; fewer than 16 is a tail tile)
  int cols;    // multiple of 32
  int tokens;  // MMA columns with a token
  bool full_range_scales;
};

// One 16-row tile of one expert through every warp step of the kernel, emulated.
void EmulateTile(const TileCase& c, std::mt19937_64& rng) {
  SCOPED_TRACE(absl::StrCat("rows ", c.rows, " cols ", c.cols, " tokens ", c.tokens,
                            c.full_range_scales ? " full-range" : " typical"));
  std::vector<std::uint8_t> packed(static_cast<std::size_t>(c.rows) * c.cols / 2);
  for (std::uint8_t& b : packed) b = static_cast<std::uint8_t>(rng());
  std::vector<std::uint8_t> scales;
  if (c.full_range_scales) {
    scales = RandomE4M3(rng, static_cast<std::size_t>(c.rows) * c.cols / kNvfp4BlockSize, /*allow_nan=*/false);
  } else {
    scales.resize(static_cast<std::size_t>(c.rows) * c.cols / kNvfp4BlockSize);
    for (std::uint8_t& s : scales) s = static_cast<std::uint8_t>(0x38 + rng() % (0x7E - 0x38 + 1));
  }
  const float global = 0.0173f;
  // The kernel's inputs are fp16 (nvfp4_moe.cu converts them): draw them as fp16 values.
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::uint16_t> x(static_cast<std::size_t>(c.tokens) * c.cols);
  for (std::uint16_t& v : x) v = ToF16(normal(rng)).bits;

  // acc[lane][mma][register], as the kernel keeps them.
  std::vector<std::array<std::array<double, 4>, 2>> acc(kWarpSize);
  for (auto& a : acc) a = {};
  const int steps = (c.cols + nvfp4::kStepCols - 1) / nvfp4::kStepCols;
  const int row_bytes = c.cols / 2, row_scales = c.cols / kNvfp4BlockSize;
  for (int step = 0; step < steps; ++step) {
    for (int q = 0; q < 4; ++q) {
      // Each lane's operands of the two MMAs of word q.
      std::uint32_t a[kWarpSize][2][4], b[kWarpSize][2][2];
      for (int lane = 0; lane < kWarpSize; ++lane) {
        const int grp = lane / 4, quad_lane = lane % 4;
        const int c0 = nvfp4::LaneColumn(step, quad_lane);
        const bool valid = c0 < c.cols;
        std::uint32_t pairs[2][4];
        for (int h = 0; h < 2; ++h) {
          const int row = std::min(grp + 8 * h, c.rows - 1);
          std::uint32_t word = 0, scale_codes = 0;
          if (valid) {
            std::memcpy(&word, packed.data() + static_cast<std::size_t>(row) * row_bytes + c0 / 2 + 4 * q, 4);
            std::memcpy(&scale_codes, scales.data() + static_cast<std::size_t>(row) * row_scales + c0 / 16, 2);
          }
          nvfp4::DecodeE2M1Word(word, pairs[h]);
          // cvt.rn.f16x2.e4m3x2: the low byte's value in the low half (exact).
          const std::uint8_t scale_code =
              static_cast<std::uint8_t>(nvfp4::WordBlock(q) == 0 ? scale_codes & 0xFFu : scale_codes >> 8);
          // The kernel multiplies by the scale times 2^kScaleBias (exact in fp16: 448 * 128 fits).
          const float scale = E4M3ToFloat(scale_code) * static_cast<float>(1 << nvfp4::kScaleBias);
          for (int i = 0; i < 4; ++i) {
            // __hmul2: each product rounded to fp16, which the kernel relies on being exact.
            const float lo = LowHalf(pairs[h][i]) * scale, hi = HighHalf(pairs[h][i]) * scale;
            const F16 lo16 = ToF16(lo), hi16 = ToF16(hi);
            if (!std::isnan(lo)) {
              EXPECT_EQ(HalfValue(lo16.bits), lo) << "inexact scaled weight";
            }
            if (!std::isnan(hi)) {
              EXPECT_EQ(HalfValue(hi16.bits), hi) << "inexact scaled weight";
            }
            pairs[h][i] = std::uint32_t{lo16.bits} | (std::uint32_t{hi16.bits} << 16);
          }
        }
        // Column grp's token, or the first token for a column without one (not stored), as the
        // kernel's 16-byte load finds it: the vector stored in the pairs' order.
        const int token = grp < c.tokens ? grp : 0;
        std::uint32_t xs[4] = {0, 0, 0, 0};
        if (valid) {
          std::uint16_t stored[8];
          for (int e = 0; e < 8; ++e) {
            stored[nvfp4::Nvfp4InputPosition(e)] = x[static_cast<std::size_t>(token) * c.cols + c0 + 8 * q + e];
          }
          for (int i = 0; i < 4; ++i) xs[i] = std::uint32_t{stored[2 * i]} | (std::uint32_t{stored[2 * i + 1]} << 16);
        }
        nvfp4::WordFragments(pairs[0], pairs[1], xs, a[lane], b[lane]);
      }
      // The MMAs, from the PTX ISA's m16n8k16 .f16 fragment layout (independent of the header):
      // A register r of lane l: row l / 4 + 8 (r & 1), k 2 (l % 4) + 8 (r >> 1) + {0, 1};
      // B register r: k 2 (l % 4) + 8 r + {0, 1}, column l / 4;
      // C register r: row l / 4 + 8 (r >> 1), column 2 (l % 4) + (r & 1).
      for (int m = 0; m < 2; ++m) {
        double A[kTileRows][16] = {}, B[16][kMmaCols] = {};
        for (int lane = 0; lane < kWarpSize; ++lane) {
          const int g = lane / 4, t = lane % 4;
          for (int r = 0; r < 4; ++r) {
            const int row = g + 8 * (r & 1), k = 2 * t + 8 * (r >> 1);
            A[row][k] = LowHalf(a[lane][m][r]);
            A[row][k + 1] = HighHalf(a[lane][m][r]);
          }
          for (int r = 0; r < 2; ++r) {
            const int k = 2 * t + 8 * r;
            B[k][g] = LowHalf(b[lane][m][r]);
            B[k + 1][g] = HighHalf(b[lane][m][r]);
          }
        }
        for (int lane = 0; lane < kWarpSize; ++lane) {
          const int g = lane / 4, t = lane % 4;
          for (int r = 0; r < 4; ++r) {
            const int row = g + 8 * (r >> 1), col = 2 * t + (r & 1);
            double sum = 0.0;
            for (int k = 0; k < 16; ++k) sum += A[row][k] * B[k][col];
            acc[lane][m][r] += sum;
          }
        }
      }
    }
  }

  // Stored as the kernel stores them; every (row, token) of the tile exactly once.
  std::vector<double> got(static_cast<std::size_t>(c.rows) * c.tokens, NAN);
  std::vector<int> stores(got.size(), 0);
  for (int lane = 0; lane < kWarpSize; ++lane) {
    for (int r = 0; r < 4; ++r) {
      const int row = nvfp4::AccRow(lane, r), token = nvfp4::AccToken(lane, r);
      if (row < c.rows && token < c.tokens) {
        got[static_cast<std::size_t>(row) * c.tokens + token] =
            global * static_cast<float>(1 << nvfp4::kScaleBias) * (acc[lane][0][r] + acc[lane][1][r]);
        ++stores[static_cast<std::size_t>(row) * c.tokens + token];
      }
    }
  }
  double worst = 0.0, largest = 0.0;
  for (int row = 0; row < c.rows; ++row) {
    for (int token = 0; token < c.tokens; ++token) {
      double want = 0.0;
      for (int col = 0; col < c.cols; ++col) {
        const std::uint8_t byte = packed[static_cast<std::size_t>(row) * row_bytes + col / 2];
        const std::uint8_t code = col % 2 == 0 ? byte & 0x0F : byte >> 4;
        const double weight = double{E2M1ToFloat(code)} *
                              double{E4M3ToFloat(scales[static_cast<std::size_t>(row) * row_scales + col / 16])} *
                              double{global};
        want += weight * double{HalfValue(x[static_cast<std::size_t>(token) * c.cols + col])};
      }
      const std::size_t at = static_cast<std::size_t>(row) * c.tokens + token;
      ASSERT_EQ(stores[at], 1) << "row " << row << " token " << token;
      worst = std::max(worst, std::abs(got[at] - want));
      largest = std::max(largest, std::abs(want));
    }
  }
  // The emulated MMA sums in double, so only the summation order differs from the reference.
  EXPECT_LE(worst, 1e-9 * std::max(largest, 1.0));
}

TEST(Nvfp4Fragment, WarpStepEmulationMatchesTheDecodedWeights) {
  std::mt19937_64 rng = MakeRng(5402);
  // Whole steps, a last step of one, two and three lane chunks, a tail tile, one to eight tokens.
  for (const TileCase c : {TileCase{16, 256, 1, false}, TileCase{16, 256, 8, true}, TileCase{16, 160, 3, true},
                           TileCase{16, 96, 5, false}, TileCase{13, 224, 8, true}, TileCase{5, 32, 2, false},
                           TileCase{16, 1024, 4, true}}) {
    EmulateTile(c, rng);
  }
}

}  // namespace
}  // namespace nq::kernels
