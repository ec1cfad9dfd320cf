// The CUDA trellis search's index arithmetic (kernels/cuda/trellis_search_layout.h) on the CPU:
// for every layout phase, the passes of trellis_search.cu visit each of the 65536 positions once,
// each step's groups have their four positions where the in-place layout puts them, each group's
// backpointer goes to a ballot word and bit no other group uses and that BackpointerAt (the trace)
// finds, the value table pairs the two groups a half2 instruction steps, and no pass's shared-memory
// access has a bank conflict. Runs without a GPU, so a layout mistake fails here before a device run.
#include "kernels/cuda/trellis_search_layout.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace nq::kernels::cuda::trellis_layout {
namespace {

// A group as a pass steps it: its four positions, where its ballot bits go, and the value table
// entry and half it reads.
struct SteppedGroup {
  std::array<std::uint32_t, 4> positions;
  std::uint32_t word, bit, pair, half;
};

// The groups step `phase` of a period runs, as trellis_search.cu's passes take them: PairStep for
// phases 1-6 (chunk = m * kThreads + threadIdx.x, rows i then columns k of its 16 words, both
// halves), BoundaryPass for phase 7 (rows k, in pairs) and phase 0 (columns i).
std::vector<SteppedGroup> GroupsOfPhase(int phase) {
  std::vector<SteppedGroup> out;
  const int b = PartnerBit(phase);
  if (phase >= 1 && phase <= 6) {
    const int lo = phase % 2 == 1 ? b - 2 : b;
    const std::uint32_t row = 1u << (lo - 1), column = 1u << (lo + 1);
    for (std::uint32_t chunk = 0; chunk < 2 * kThreads; ++chunk) {
      const std::uint32_t base = PairChunkWord(chunk, lo);
      for (std::uint32_t sub = 0; sub < 4; ++sub) {
        const bool rows = phase % 2 == 1;
        const std::uint32_t w = base | sub * (rows ? row : column);
        for (std::uint32_t half = 0; half < 2; ++half) {
          SteppedGroup g;
          for (std::uint32_t k = 0; k < 4; ++k) g.positions[k] = 2 * (w | k * (rows ? column : row)) + half;
          g.word = PairWord(chunk, sub) + half * 2;
          g.bit = chunk % 32;
          g.pair = PairIndex(w, b);
          g.half = half;
          out.push_back(g);
        }
      }
    }
  } else {
    for (std::uint32_t c = 0; c < 4096; ++c) {
      for (std::uint32_t sub = 0; sub < 4; ++sub) {
        SteppedGroup g;
        for (std::uint32_t k = 0; k < 4; ++k) {
          g.positions[k] = phase == 7 ? (c << 2) + k + (sub << 14) : (c << 2) + sub + (k << 14);
        }
        g.word = BoundaryWord(c) + (sub >> 1) * 4 + (sub & 1u) * 2;
        g.bit = c % 32;
        g.pair = phase == 7 ? (c | (sub >> 1) << 12) : ((c << 1) | (sub >> 1));
        g.half = sub & 1u;
        out.push_back(g);
      }
    }
  }
  return out;
}

TEST(TrellisSearchLayout, EveryGroupStepsOnceAndTheTraceFindsItsBackpointer) {
  for (int phase = 0; phase < kLayoutPeriod; ++phase) {
    SCOPED_TRACE(phase);
    const int b = PartnerBit(phase);
    const std::vector<SteppedGroup> groups = GroupsOfPhase(phase);
    ASSERT_EQ(groups.size(), kGroups);
    std::vector<bool> position_seen(1u << 16, false);
    std::set<std::pair<std::uint32_t, std::uint32_t>> ballot_bits;
    std::map<std::uint32_t, const SteppedGroup*> by_group;
    for (const SteppedGroup& g : groups) {
      for (int k = 0; k < 4; ++k) {
        // The in-place layout: a step's butterfly is p0 + k 2^b.
        ASSERT_EQ(g.positions[k], g.positions[0] + (static_cast<std::uint32_t>(k) << b));
        ASSERT_FALSE(position_seen[g.positions[k]]) << "position " << g.positions[k] << " stepped twice";
        position_seen[g.positions[k]] = true;
      }
      ASSERT_LT(g.word + 1, static_cast<std::uint32_t>(kBackpointerWordsPerStep));
      ASSERT_TRUE(ballot_bits.insert({g.word, g.bit}).second) << "two groups on one ballot bit";
      const std::uint32_t q = QuadIndex(g.positions[0], b);
      std::uint32_t lo = 0, hi = 0;
      PairGroups(phase, g.pair, lo, hi);
      ASSERT_EQ(g.half == 0 ? lo : hi, q) << "value pair " << g.pair;
      by_group[q] = &g;
    }
    // The trace: group g's first position before step t is rotr16(g, 2t), in every period.
    for (int t : {phase, phase + kLayoutPeriod, phase + 248}) {
      for (std::uint32_t group = 0; group < kGroups; ++group) {
        const std::uint32_t p0 = Rotr16(group, 2 * t);
        std::uint32_t word = 0, bit = 0;
        BackpointerAt(t, p0, word, bit);
        const SteppedGroup* g = by_group.at(QuadIndex(p0, b));
        ASSERT_EQ(word, g->word) << "t " << t << " group " << group;
        ASSERT_EQ(bit, g->bit) << "t " << t << " group " << group;
      }
    }
  }
}

// Shared memory: a pair step's 32-bit accesses (one word per lane, for each (i, k)) and a boundary
// pass's 64-bit ones (two words per lane, per half-warp) each touch every bank at most once.
TEST(TrellisSearchLayout, NoPassHasABankConflict) {
  for (int lo : {2, 6, 10}) {
    const std::uint32_t row = 1u << (lo - 1), column = 1u << (lo + 1);
    for (std::uint32_t warp_chunk = 0; warp_chunk < 2 * kThreads; warp_chunk += 32) {
      for (std::uint32_t ik = 0; ik < 16; ++ik) {
        std::set<std::uint32_t> banks;
        for (std::uint32_t lane = 0; lane < 32; ++lane) {
          const std::uint32_t w = PairChunkWord(warp_chunk + lane, lo) | (ik & 3u) * row | (ik >> 2) * column;
          banks.insert(CostWord(w) % 32);
        }
        ASSERT_EQ(banks.size(), 32u) << "pair step lo " << lo << ", chunks from " << warp_chunk;
      }
    }
  }
  for (std::uint32_t half_warp = 0; half_warp < 4096; half_warp += 16) {
    for (std::uint32_t k = 0; k < 4; ++k) {
      std::set<std::uint32_t> bank_pairs;
      for (std::uint32_t lane = 0; lane < 16; ++lane) {
        const std::uint32_t w = ((half_warp + lane) << 1) | (k << 13);
        ASSERT_EQ(CostWord(w) % 2, 0u);                 // 8-byte aligned
        ASSERT_EQ(CostWord(w + 1), CostWord(w) + 1);  // the row's two words stay adjacent
        bank_pairs.insert(CostWord(w) % 32 / 2);
      }
      ASSERT_EQ(bank_pairs.size(), 16u) << "boundary pass, chunks from " << half_warp;
    }
  }
}

}  // namespace
}  // namespace nq::kernels::cuda::trellis_layout
