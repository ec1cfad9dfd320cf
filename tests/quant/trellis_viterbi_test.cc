// TileSearcher (services/quant/trellis_viterbi.cc) against a plain Viterbi written here the
// textbook way: costs by left-shift state in natural order, a new array every step, each state's
// four predecessors read where they are. The searcher runs in place over a rotating layout, four
// or eight groups a vector; it must find the same ring, symbol for symbol, with the same
// comparisons (ties keep the lower predecessor and the lower end state), in either build.
#include "services/quant/trellis_viterbi.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
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

// The plain search over `steps` targets from `cost` (by left-shift state), keeping every
// group's chosen predecessor (0..3, the predecessor's top symbol) per step.
void PlainRun(const std::vector<float>& values, const float* x, int steps, std::vector<float>& cost,
              std::vector<uint8_t>& backpointers) {
  backpointers.assign(static_cast<size_t>(steps) * kGroups, 0);
  std::vector<float> next(kStateCount);
  for (int t = 0; t < steps; ++t) {
    for (uint32_t g = 0; g < kGroups; ++g) {
      std::array<float, 4> a;
      for (uint32_t j = 0; j < 4; ++j) a[j] = cost[g | j << 14];
      const bool b01 = a[1] < a[0];
      const float m01 = b01 ? a[1] : a[0];
      const bool b23 = a[3] < a[2];
      const float m23 = b23 ? a[3] : a[2];
      const bool high = m23 < m01;
      const float least = high ? m23 : m01;
      backpointers[static_cast<size_t>(t) * kGroups + g] = static_cast<uint8_t>(high ? 2 + b23 : b01);
      for (uint32_t c = 0; c < 4; ++c) {
        const uint32_t successor = g << 2 | c;
        const float d = x[t] - values[LeftToRight(successor)];
        const float squared = d * d;  // rounded on its own, as the searcher's (no fused multiply-add)
        next[successor] = least + squared;
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
std::vector<uint8_t> PlainSearch(const std::vector<float>& values, const float* x) {
  std::vector<float> probe_x(kProbeSteps);
  for (int k = 0; k < kProbeSteps; ++k) probe_x[k] = x[(kTileWeights - kProbeSteps / 2 + k) % kTileWeights];
  std::vector<float> cost(kStateCount, 0.0f);
  std::vector<uint8_t> backpointers;
  PlainRun(values, probe_x.data(), kProbeSteps, cost, backpointers);
  const uint32_t probe_end = static_cast<uint32_t>(std::min_element(cost.begin(), cost.end()) - cost.begin());
  std::vector<uint8_t> probe_symbols(kProbeSteps);
  PlainTrace(backpointers, probe_end, kProbeSteps, probe_symbols.data());
  uint32_t overlap = 0;
  for (int k = 0; k < kStateSpan - 1; ++k) {
    overlap = (overlap << 2) | probe_symbols[kProbeSteps / 2 - (kStateSpan - 1) + k];
  }
  cost.assign(kStateCount, std::numeric_limits<float>::infinity());
  for (uint32_t j = 0; j < 4; ++j) cost[overlap | j << 14] = 0.0f;
  PlainRun(values, x, kTileWeights, cost, backpointers);
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
  std::vector<std::vector<float>> tiles;
  for (float scale : {1.0f, 2.5f}) {
    std::vector<float> x(kTileWeights);
    for (float& v : x) v = scale * normal(rng);
    tiles.push_back(x);
  }
  tiles.push_back(std::vector<float>(kTileWeights, 0.0f));  // ties everywhere
  std::vector<float> two_valued(kTileWeights);
  for (int i = 0; i < kTileWeights; ++i) two_valued[i] = i % 2 == 0 ? 1.5f : -1.5f;
  tiles.push_back(two_valued);

  // Both builds of the steps: AVX2 where this CPU has it, and SSE2 (what a CPU without it runs).
  TileSearcher best(values, TileSearcher::Isa::kBest);
  TileSearcher portable(values, TileSearcher::Isa::kPortable);
  for (size_t t = 0; t < tiles.size(); ++t) {
    const std::vector<uint8_t> want = PlainSearch(values, tiles[t].data());
    for (TileSearcher* searcher : {&best, &portable}) {
      std::vector<uint8_t> got(kTileWeights);
      std::vector<float> decoded(kTileWeights);
      searcher->Search(tiles[t].data(), got.data(), decoded.data());
      EXPECT_EQ(got, want) << "tile " << t << (searcher == &best ? ", best build" : ", portable build");
    }
  }
}

}  // namespace
}  // namespace nq::quant::trellis
