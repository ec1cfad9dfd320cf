// TileSearcher (services/quant/trellis_viterbi.cc) against a plain Viterbi written here the
// textbook way: costs by left-shift state in natural order, a new array every step, each state's
// four predecessors read where they are, the binary16 arithmetic of trellis_viterbi.h's contract
// spelt out with the compiler's own conversion. The searcher runs in place over a rotating
// layout, four or eight groups a vector, rounding in software (SSE2) or with F16C; it must find
// the same ring, symbol for symbol, with the same comparisons (ties keep the lower predecessor
// and the lower end state), in either build.
#include "services/quant/trellis_viterbi.h"

#include <algorithm>
#include <cmath>
#include <array>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "services/common/cpu_features.h"
#include "services/quant/trellis_decode.h"

namespace nq::quant::trellis {
namespace {

constexpr uint32_t kGroups = kStateCount >> kSymbolBits;

// Left-shift state to the right-shift state UnitValues is indexed by: the bit pairs reversed.
uint32_t LeftToRight(uint32_t s) {
  uint32_t out = 0;
  for (int k = 0; k < kStateSpan; ++k) out |= ((s >> (2 * k)) & 3u) << (2 * (kStateSpan - 1 - k));
  return out;
}

// h(y) of the contract: y rounded to binary16 by the compiler's conversion (to nearest even,
// overflow to inf), back in a float. Only conversions: arithmetic on _Float16 itself may be kept
// at a higher precision. With F16C the compiler converts in one instruction; its software
// conversion (libgcc) takes four times as long, and a plain search converts 10^8 times.
// (tests/quant/trellis_half_test.cc checks that the two agree.)
__attribute__((target("f16c"))) float HWithF16c(float y) { return static_cast<float>(static_cast<_Float16>(y)); }
float HInSoftware(float y) { return static_cast<float>(static_cast<_Float16>(y)); }
float H(float y) { return CpuHasAvx2F16c() ? HWithF16c(y) : HInSoftware(y); }

// What a plain search met, so a test can tell that its tile reaches the edges it is there for.
struct PlainStats {
  int64_t infinite_costs = 0;      // successor costs that overflowed to +inf
  int64_t subnormal_squares = 0;   // nonzero squared errors below binary16's least normal, 2^-14
  int64_t nan_costs = 0;           // none, by the targets' clamp
};

// The plain search over `steps` targets from `cost` (by left-shift state), keeping every
// group's chosen predecessor (0..3, the predecessor's top symbol) per step. vh: the values,
// rounded, by right-shift state.
void PlainRun(const std::vector<float>& vh, const float* x, int steps, std::vector<float>& cost,
              std::vector<uint8_t>& backpointers, PlainStats& stats) {
  backpointers.assign(static_cast<size_t>(steps) * kGroups, 0);
  std::vector<float> next(kStateCount);
  for (int t = 0; t < steps; ++t) {
    const float xh = H(std::fmin(std::fmax(x[t], -kTargetLimit), kTargetLimit));
    const bool normalise = t % 8 == 1;
    const float floor = normalise ? *std::min_element(cost.begin(), cost.end()) : 0.0f;
    for (uint32_t g = 0; g < kGroups; ++g) {
      std::array<float, 4> a;
      for (uint32_t j = 0; j < 4; ++j) a[j] = cost[g | j << 14];
      const bool b01 = a[1] < a[0];
      const float m01 = b01 ? a[1] : a[0];
      const bool b23 = a[3] < a[2];
      const float m23 = b23 ? a[3] : a[2];
      const bool high = m23 < m01;
      const float m = high ? m23 : m01;
      const float least = normalise ? H(m - floor) : m;
      backpointers[static_cast<size_t>(t) * kGroups + g] = static_cast<uint8_t>(high ? 2 + b23 : b01);
      for (uint32_t c = 0; c < 4; ++c) {
        const uint32_t successor = g << 2 | c;
        const float d = H(xh - vh[LeftToRight(successor)]);
        const float squared = H(d * d);  // rounded on its own (no fused multiply-add)
        next[successor] = H(least + squared);
        stats.subnormal_squares += squared > 0.0f && squared < 0x1p-14f;
        stats.infinite_costs += next[successor] == std::numeric_limits<float>::infinity();
        stats.nan_costs += std::isnan(next[successor]);
      }
    }
    cost.swap(next);
  }
}

void PlainTrace(const std::vector<uint8_t>& backpointers, uint32_t state, int steps, uint8_t* symbols) {
  for (int t = steps - 1; t >= 0; --t) {
    symbols[t] = static_cast<uint8_t>(state & 3u);
    const uint32_t g = state >> 2;
    state = g | static_cast<uint32_t>(backpointers[static_cast<size_t>(t) * kGroups + g]) << 14;
  }
}

// TileSearcher::Search's tail-biting, on the plain search: a free-start probe over the ring from
// its seam fixes the seven symbols the first and last states share, then the full ring.
std::vector<uint8_t> PlainSearch(const std::vector<float>& values, const float* x, PlainStats& stats) {
  std::vector<float> vh(values.size());
  for (size_t s = 0; s < values.size(); ++s) vh[s] = H(values[s]);
  std::vector<float> probe_x(kProbeSteps);
  for (int k = 0; k < kProbeSteps; ++k) probe_x[k] = x[(kTileWeights - kProbeSteps / 2 + k) % kTileWeights];
  std::vector<float> cost(kStateCount, 0.0f);
  std::vector<uint8_t> backpointers;
  PlainRun(vh, probe_x.data(), kProbeSteps, cost, backpointers, stats);
  const uint32_t probe_end = static_cast<uint32_t>(std::min_element(cost.begin(), cost.end()) - cost.begin());
  std::vector<uint8_t> probe_symbols(kProbeSteps);
  PlainTrace(backpointers, probe_end, kProbeSteps, probe_symbols.data());
  uint32_t overlap = 0;
  for (int k = 0; k < kStateSpan - 1; ++k) {
    overlap = (overlap << 2) | probe_symbols[kProbeSteps / 2 - (kStateSpan - 1) + k];
  }
  cost.assign(kStateCount, std::numeric_limits<float>::infinity());
  for (uint32_t j = 0; j < 4; ++j) cost[overlap | j << 14] = 0.0f;
  PlainRun(vh, x, kTileWeights, cost, backpointers, stats);
  uint32_t end = overlap;
  for (uint32_t j = 1; j < 4; ++j) {
    if (cost[overlap | j << 14] < cost[end]) end = overlap | j << 14;
  }
  std::vector<uint8_t> symbols(kTileWeights);
  PlainTrace(backpointers, end, kTileWeights, symbols.data());
  return symbols;
}

TEST(TileSearcher, FindsThePlainViterbisRing) {
  const std::vector<float>& values = UnitValues();
  std::mt19937 rng(20261205);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // The edge of binary16 a tile is there to reach, checked on the plain search's stats.
  enum class Edge { kNone, kInfiniteCosts, kSubnormalSquares, kNoNaN };
  struct Tile {
    const char* what;
    std::vector<float> x;
    Edge edge;
  };
  std::vector<Tile> tiles;
  const auto gaussian = [&](const char* what, float scale, Edge edge) {
    std::vector<float> x(kTileWeights);
    for (float& v : x) v = scale * normal(rng);
    tiles.push_back({what, x, edge});
  };
  gaussian("N(0,1)", 1.0f, Edge::kNone);
  gaussian("N(0,2.5^2)", 2.5f, Edge::kNone);
  tiles.push_back({"zeros (ties everywhere)", std::vector<float>(kTileWeights, 0.0f), Edge::kNone});
  std::vector<float> two_valued(kTileWeights);
  for (int i = 0; i < kTileWeights; ++i) two_valued[i] = i % 2 == 0 ? 1.5f : -1.5f;
  tiles.push_back({"two-valued", two_valued, Edge::kNone});
  gaussian("N(0,40^2): costs in binary16's top binades, some +inf", 40.0f, Edge::kInfiniteCosts);
  gaussian("N(0,1e-4^2): subnormal squares", 1e-4f, Edge::kSubnormalSquares);
  // Without the targets' clamp every cost would overflow at the first step and the first
  // normalisation (inf - inf) would make them NaN; clamped, the search still finds the ring of the
  // largest values, and a NaN target is the clamp's lower limit.
  tiles.push_back({"all 1000", std::vector<float>(kTileWeights, 1000.0f), Edge::kNoNaN});
  std::vector<float> with_nan(kTileWeights, 0.5f);
  with_nan[17] = std::numeric_limits<float>::quiet_NaN();
  with_nan[200] = -std::numeric_limits<float>::infinity();
  tiles.push_back({"a NaN and a -inf target", with_nan, Edge::kNoNaN});

  // Both builds of the steps: AVX2 + F16C where this CPU has them, and SSE2 (what a CPU without
  // them runs).
  TileSearcher best(values, TileSearcher::Isa::kBest);
  TileSearcher portable(values, TileSearcher::Isa::kPortable);
  for (const Tile& tile : tiles) {
    PlainStats stats;
    const std::vector<uint8_t> want = PlainSearch(values, tile.x.data(), stats);
    for (TileSearcher* searcher : {&best, &portable}) {
      std::vector<uint8_t> got(kTileWeights);
      std::vector<float> decoded(kTileWeights);
      searcher->Search(tile.x.data(), got.data(), decoded.data());
      EXPECT_EQ(got, want) << tile.what << (searcher == &best ? ", best build" : ", portable build");
    }
    switch (tile.edge) {
      case Edge::kNone:
        break;
      case Edge::kInfiniteCosts:
        EXPECT_GT(stats.infinite_costs, 0) << tile.what;
        break;
      case Edge::kSubnormalSquares:
        EXPECT_GT(stats.subnormal_squares, 0) << tile.what;
        break;
      case Edge::kNoNaN:
        EXPECT_EQ(stats.nan_costs, 0) << tile.what;
        EXPECT_NE(want, std::vector<uint8_t>(kTileWeights, 0)) << tile.what;
        break;
    }
  }
}

}  // namespace
}  // namespace nq::quant::trellis
