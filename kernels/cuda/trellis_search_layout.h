// Where the CUDA trellis search (trellis_search.cu) keeps things: the half2 words of the costs in
// shared memory, the chunks a thread's passes take, the value table's group pairs, and the ballot
// words each step's backpointers go to and the trace reads them from. Plain integer arithmetic,
// __host__ __device__ under nvcc, so tests/kernels/cpu/trellis_search_layout_test.cc checks on the
// CPU that every (step, group) is written once, where the trace looks, and without bank conflicts.
//
// The layout is trellis_viterbi.cc's: at step t the cost of left-shift state s sits at position
// rotr16(s, 2t); a step's four positions p0 + k 2^b (b = PartnerBit(t)) are a group's predecessors
// before it and its successors after it. Positions 2w and 2w + 1 share half2 word w.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define NQ_TRELLIS_LAYOUT_FN __host__ __device__ __forceinline__ constexpr
#else
#define NQ_TRELLIS_LAYOUT_FN inline constexpr
#endif

namespace nq::kernels::cuda::trellis_layout {

inline constexpr int kThreads = 1024;                     // a block: one tile
inline constexpr std::uint32_t kGroups = 1u << 14;        // butterflies a step
inline constexpr std::uint32_t kCostWords = 1u << 15;     // half2 words of the 65536 costs
inline constexpr int kBackpointerWordsPerStep = 1024;     // two ballot words per 32 groups
inline constexpr int kLayoutPeriod = 8;                   // steps until the layout is natural again

NQ_TRELLIS_LAYOUT_FN int PartnerBit(int t) { return (14 - 2 * t) & 15; }

NQ_TRELLIS_LAYOUT_FN std::uint32_t Rotr16(std::uint32_t v, int r) {
  r &= 15;
  return ((v >> r) | (v << ((16 - r) & 15))) & 0xFFFFu;
}

// The 14-bit index of the group whose first position is p0 (its partner bits clear).
NQ_TRELLIS_LAYOUT_FN std::uint32_t QuadIndex(std::uint32_t p0, int b) {
  return (p0 & ((1u << b) - 1u)) | ((p0 >> (b + 2)) << b);
}

// Where a cost word sits in shared memory: word bits 1-4 XOR bits 5-8. Without it the pair step of
// partner bits 4 and 2 puts sixteen lanes on one bank pair (the lanes of a warp differ in word
// bits 0 and 5-8 there); with it no pass has a bank conflict, and bit 0 (the two words of a
// boundary row, one 64-bit access) is unchanged.
NQ_TRELLIS_LAYOUT_FN std::uint32_t CostWord(std::uint32_t word) { return word ^ (((word >> 5) & 15u) << 1); }

// A pair step over partner bits lo + 2 then lo (lo = 2, 6, 10) holds the 16 words
// base | i 2^(lo-1) | k 2^(lo+1) of a chunk (0..2047: m * kThreads + threadIdx.x): base is the
// chunk's bits spread over the word bits other than lo-1 .. lo+2.
NQ_TRELLIS_LAYOUT_FN std::uint32_t PairChunkWord(std::uint32_t chunk, int lo) {
  return (chunk & ((1u << (lo - 1)) - 1u)) | ((chunk >> (lo - 1)) << (lo + 3));
}

// The value table's pair for the two groups at word w (its partner bits clear) of a step whose
// partner bit is b >= 2: QuadIndex(2w, b) / 2, so its groups are 2n and 2n + 1.
NQ_TRELLIS_LAYOUT_FN std::uint32_t PairIndex(std::uint32_t w, int b) {
  return (w & ((1u << (b - 1)) - 1u)) | ((w >> (b + 1)) << (b - 1));
}

// The two groups of entry n of layout phase `phase` in the value table (low half first): 2n and
// 2n + 1 wherever the partner bit is 2 or more; at partner bit 0 (phase 7) rows 2h and 2h + 1 of a
// boundary chunk c, groups c | k << 12 with n = c | h << 12.
NQ_TRELLIS_LAYOUT_FN void PairGroups(int phase, std::uint32_t n, std::uint32_t& lo, std::uint32_t& hi) {
  if (phase == kLayoutPeriod - 1) {
    lo = (n & 4095u) | ((n >> 12) << 13);
    hi = lo | (1u << 12);
  } else {
    lo = 2 * n;
    hi = lo + 1;
  }
}

// Ballot words of a pair step: 16 per 32 chunks, [row or column (sub)][half][plane].
NQ_TRELLIS_LAYOUT_FN std::uint32_t PairWord(std::uint32_t chunk, std::uint32_t sub) {
  return ((chunk >> 5) * 4 + sub) * 4;
}

// Ballot words of a boundary pass (chunks c = 0..4095, the positions' bits 2-13): 8 per 32
// chunks, [row or column pair][half][plane].
NQ_TRELLIS_LAYOUT_FN std::uint32_t BoundaryWord(std::uint32_t c) { return (c >> 5) * 8; }

// Where step t stored the backpointer of the group whose first position is p0: the first of its
// two plane words (the second follows) within the step's words, and the bit (the storing lane).
NQ_TRELLIS_LAYOUT_FN void BackpointerAt(int t, std::uint32_t p0, std::uint32_t& word, std::uint32_t& bit) {
  const int b = PartnerBit(t);
  const int phase = t % kLayoutPeriod;
  if (phase == 0 || phase == kLayoutPeriod - 1) {
    // A boundary pass: chunk c = bits 2-13; the column step's group is column i = bits 0-1
    // (b = 14), the row step's row k = bits 14-15 (b = 0).
    const std::uint32_t c = (p0 >> 2) & 4095u;
    const std::uint32_t sub = phase == 0 ? (p0 & 3u) : (p0 >> 14);
    word = BoundaryWord(c) + (sub >> 1) * 4 + (sub & 1u) * 2;
    bit = c % 32;
  } else {
    // A pair's first step (odd phases, partner bit lo + 2) holds row i = bits lo, lo + 1 of p0;
    // its second (partner bit lo) column k = bits lo + 2, lo + 3; the half is bit 0.
    const int lo = phase % 2 == 1 ? b - 2 : b;
    const std::uint32_t sub = phase % 2 == 1 ? (p0 >> lo) & 3u : (p0 >> (lo + 2)) & 3u;
    const std::uint32_t w = p0 >> 1;
    const std::uint32_t chunk = (w & ((1u << (lo - 1)) - 1u)) | ((w >> (lo + 3)) << (lo - 1));
    word = PairWord(chunk, sub) + (p0 & 1u) * 2;
    bit = chunk % 32;
  }
}

}  // namespace nq::kernels::cuda::trellis_layout

#undef NQ_TRELLIS_LAYOUT_FN
