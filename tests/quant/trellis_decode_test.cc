// trellis_decode.h: the header the GPU kernels include. Its state extraction must agree
// with the documented bit layout, and its computed codebook must be the near-Gaussian,
// unit-variance code the encoder assumes.
#include "services/quant/trellis_decode.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

#include "services/quant/hadamard.h"

namespace nq::quant::trellis {
namespace {

// Evaluated by the compiler: the header is usable in constant expressions (and so in
// __host__ __device__ code under nvcc, where the same functions are marked for the device).
static_assert(TileByteOffset(1, 2, 64) == (1 * 4 + 2) * 64);
static_assert(UnitValue(0x12345u) == UnitValue(0x2345u), "only the low 16 state bits count");

// A random tile: 64 bytes from splitmix64.
std::vector<uint8_t> RandomTile(uint64_t seed) {
  std::vector<uint8_t> bytes(kTileBytes);
  for (auto& b : bytes) b = static_cast<uint8_t>(SplitMix64(seed));
  return bytes;
}

TEST(TrellisDecodeTest, WordAndByteStateExtractionAgree) {
  for (uint64_t seed = 1; seed <= 8; ++seed) {
    const std::vector<uint8_t> bytes = RandomTile(seed);
    uint32_t words[kTileWords];
    for (int k = 0; k < kTileWords; ++k) {
      words[k] = bytes[4 * k] | bytes[4 * k + 1] << 8 | bytes[4 * k + 2] << 16 |
                 static_cast<uint32_t>(bytes[4 * k + 3]) << 24;
    }
    for (int t = 0; t < kTileWeights; ++t) {
      ASSERT_EQ(TileState(words, t), TileStateFromBytes(bytes.data(), t)) << "t = " << t;
    }
  }
}

TEST(TrellisDecodeTest, StateIsTheShiftRegisterOfTheRing) {
  // Symbols c_t = t mod 4 except one marked symbol; the right-shift register after symbol t
  // holds c_t on top and c_{t-7} (wrapping around the ring) at the bottom.
  std::vector<uint8_t> symbols(kTileWeights);
  for (int t = 0; t < kTileWeights; ++t) symbols[t] = static_cast<uint8_t>((t * 7 + 3) % 4);
  std::vector<uint8_t> bytes(kTileBytes, 0);
  for (int t = 0; t < kTileWeights; ++t) bytes[t / 4] |= symbols[t] << (2 * (t % 4));
  for (int t : {0, 1, 6, 7, 100, 255}) {
    uint32_t expected = 0;
    for (int k = 0; k < kStateSpan; ++k) {
      expected |= static_cast<uint32_t>(symbols[(t - k + kTileWeights) % kTileWeights]) << (14 - 2 * k);
    }
    EXPECT_EQ(TileStateFromBytes(bytes.data(), t), expected) << "t = " << t;
  }
}

TEST(TrellisDecodeTest, CodebookIsNearUnitGaussian) {
  double sum = 0.0, sum2 = 0.0, sum4 = 0.0, max_abs = 0.0;
  for (uint32_t s = 0; s < kStateCount; ++s) {
    const double v = UnitValue(s);
    sum += v;
    sum2 += v * v;
    sum4 += v * v * v * v;
    max_abs = std::max(max_abs, std::abs(v));
  }
  const double n = kStateCount;
  const double mean = sum / n, var = sum2 / n - mean * mean;
  EXPECT_NEAR(mean, 0.0, 0.01);
  EXPECT_NEAR(var, 1.0, 0.02);
  // Four uniform bytes: kurtosis 3 - 1.2 / 4 = 2.7, support within 510 / 147.8 = 3.45 sd.
  EXPECT_NEAR(sum4 / n / (var * var), 2.7, 0.05);
  EXPECT_LE(max_abs, 3.46);
}

}  // namespace
}  // namespace nq::quant::trellis
