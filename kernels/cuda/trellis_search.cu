#include "kernels/cuda/trellis_search.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/trellis_search_layout.h"
#include "services/common/status_macros.h"
#include "services/quant/trellis_decode.h"
#include "services/quant/trellis_viterbi.h"

namespace nq::kernels::cuda {
namespace {

namespace tr = quant::trellis;
using namespace trellis_layout;  // NOLINT: this file is the layout's one user

// The search is trellis_viterbi.h's, step for step: the same in-place layout (the cost of
// left-shift state s at step t sits at position rotr16(s, 2t)), the same butterflies (the four
// positions p0 + k 2^b, b = PartnerBit(t), are a group's four predecessors before the step and
// its four successors after it), the same comparisons for the minimum and its index, and the
// same binary16 operations for the costs, each rounded on its own (no fused multiply-add), with
// the same normalisation every eighth step, so the codes equal the CPU's.
//
// The 65536 binary16 costs (128 KB) fit one SM's shared memory: one 1024-thread block per tile.
// Costs are stored as half2 words, positions 2w and 2w + 1 in word w, and every instruction works
// on two groups at once: at partner bits 2 and up, the groups of positions p0 and p0 + 1 (whose
// backpointer indices differ in bit 0); at partner bit 0, where a group's four positions are
// adjacent, two rows of groups transposed into pairs (BoundaryPass). Two consecutive steps touch
// 16 positions closed under both steps' butterflies, so each thread runs them in registers
// (PairStep, BoundaryPass): a layout period of 8 steps takes 4 passes over the costs.
constexpr int kWarps = kThreads / 32;
constexpr int kSteps = tr::kTileWeights;
// Backpointers: bit plane 0 and 1 of the 2-bit index, one ballot word per 32 groups each (which
// 32 groups share a word depends on the pass: trellis_search_layout.h's PairWord, BoundaryWord).
constexpr std::size_t kBackpointerWordsPerBlock = static_cast<std::size_t>(kSteps) * kBackpointerWordsPerStep;
constexpr std::size_t kCostBytes = kCostWords * sizeof(std::uint32_t);  // dynamic shared memory
constexpr int kProbeSeamSymbols = tr::kStateSpan - 1;  // the symbols s_{-1} and s_255 share
constexpr std::uint32_t kHalfInfinityWord = 0x7C007C00u;
constexpr std::uint32_t kNoMinimum = 0xFFFFu;  // above every non-negative binary16, +inf included

static_assert(tr::kProbeSteps == kSteps, "the probe reuses the full run's backpointer scratch");
static_assert(kCostWords / 16 == 2 * kThreads, "two 16-word chunks a thread in a pair step");
static_assert(kLayoutPeriod == tr::kStateBits / tr::kSymbolBits && kSteps % kLayoutPeriod == 0);
static_assert(kGroups == tr::kStateCount >> tr::kSymbolBits && kCostWords == tr::kStateCount / 2);
static_assert(kBackpointerWordsPerStep == static_cast<int>(kGroups / 32) * 2);

// The codebook values of the successor states, per step of the layout period, as binary16 pairs:
// entry (phase, n) holds, for k = 0..3, the values of successor k of the two groups a pass steps
// together (PairIndex), low half first. They depend only on (t mod kLayoutPeriod, group, k), not
// on the tile: tabled once per search (BuildValuesKernel, the CPU's float arithmetic, then rounded
// to binary16). 1 MiB: kLayoutPeriod x kGroups / 2 x 16 bytes.
constexpr std::size_t kValuePairs = static_cast<std::size_t>(kLayoutPeriod) * (kGroups / 2);

struct SearchParams {
  const float* targets;         // tiles x 256, unit-scaled, tile order
  std::uint8_t* symbols;        // tiles x 256
  std::uint32_t* backpointers;  // kBackpointerWordsPerBlock per block
  std::int64_t tiles;
  const uint4* values;  // [t mod kLayoutPeriod][pair]: four half2 successor values
};


__device__ __forceinline__ std::uint32_t Rotl16(std::uint32_t v, int r) {
  r &= 15;
  return ((v << r) | (v >> ((16 - r) & 15))) & tr::kStateMask;
}

// Left-shift state to trellis_decode.h's right-shift state: the eight bit pairs reversed
// (a full 16-bit reversal, then the two bits of each pair swapped back).
__device__ __forceinline__ std::uint32_t LeftToRight(std::uint32_t s) {
  const std::uint32_t r = __brev(s) >> 16;
  return ((r & 0x5555u) << 1) | ((r >> 1) & 0x5555u);
}

// UnitValue (trellis_decode.h) from the byte sum of the state's hash h = state * kHashMul +
// kHashAdd (one dp4a): float(sum) as the float 2^23 + sum minus 2^23 (exact: sum < 2^23), with the
// centring folded into that subtraction (2^23 + 510 is exact too, and so is the difference).
// `biased` is 0x4B000000 | sum.
__device__ __forceinline__ float UnitValueOfBiasedSum(std::uint32_t biased) {
  constexpr float kTwo23PlusMean = 8388608.0f + tr::kByteSumMean;
  return __fmul_rn(__fsub_rn(__uint_as_float(biased), kTwo23PlusMean), tr::kInvByteSumSd);
}

// The value of successor k of group q at a step of layout phase `phase` (t mod kLayoutPeriod):
// position p0 + k 2^b then holds successor rotl16(p0, 2t + 2) | k, whose right-shift state is
// LeftToRight(rotl16(p0, 2t + 2)) | k << 14, so the four hashes differ by k * (kHashMul << 14).
__device__ __forceinline__ float SuccessorValue(int phase, std::uint32_t q, std::uint32_t k) {
  const int b = PartnerBit(phase);
  const std::uint32_t p0 = (q & ((1u << b) - 1u)) | ((q >> b) << (b + tr::kSymbolBits));
  const std::uint32_t h =
      LeftToRight(Rotl16(p0, 2 * phase + 2)) * tr::kHashMul + tr::kHashAdd + k * (tr::kHashMul << 14);
  return UnitValueOfBiasedSum(0x4B000000u | __dp4a(h, 0x01010101u, 0u));
}


__device__ __forceinline__ std::uint32_t HalfBits(float v) { return __half_as_ushort(__float2half_rn(v)); }

// Every entry of the value table: the CPU's UnitValues() of each state, rounded to binary16.
__global__ void BuildValuesKernel(uint4* values) {
  const std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= kValuePairs) return;
  const int phase = static_cast<int>(i / (kGroups / 2));
  const std::uint32_t n = static_cast<std::uint32_t>(i % (kGroups / 2));
  std::uint32_t lo, hi;
  PairGroups(phase, n, lo, hi);
  std::uint32_t w[4];
  for (std::uint32_t k = 0; k < 4; ++k) {
    w[k] = HalfBits(SuccessorValue(phase, lo, k)) | (HalfBits(SuccessorValue(phase, hi, k)) << 16);
  }
  values[i] = make_uint4(w[0], w[1], w[2], w[3]);
}


__device__ __forceinline__ __half2 AsHalf2(std::uint32_t v) {
  __half2 h;
  std::memcpy(&h, &v, sizeof(h));
  return h;
}
__device__ __forceinline__ std::uint32_t AsWord(__half2 h) {
  std::uint32_t v;
  std::memcpy(&v, &h, sizeof(v));
  return v;
}
// Low halves of a and b as one pair, and their high halves (PTX prmt through __byte_perm).
__device__ __forceinline__ std::uint32_t LowHalves(std::uint32_t a, std::uint32_t b) {
  return __byte_perm(a, b, 0x5410);
}
__device__ __forceinline__ std::uint32_t HighHalves(std::uint32_t a, std::uint32_t b) {
  return __byte_perm(a, b, 0x7632);
}

// One step for the two groups of half2 words a[0..3] (predecessor k of both, low half the first
// group), in place: the least of four with trellis_viterbi.h's comparisons (ties keep the lower
// index), minus `r` when normalising, then successor k's cost least + (x - value_k)^2 in binary16,
// each operation rounded on its own. `ballots` gets the warp's backpointer bits: [low group bit 0,
// low bit 1, high bit 0, high bit 1].
template <bool kNormalise>
__device__ __forceinline__ void StepTwoGroups(std::uint32_t (&a)[4], __half2 x, uint4 v, __half2 r,
                                              std::uint32_t (&ballots)[4]) {
  const __half2 a0 = AsHalf2(a[0]), a1 = AsHalf2(a[1]), a2 = AsHalf2(a[2]), a3 = AsHalf2(a[3]);
  const std::uint32_t b01 = __hlt2_mask(a1, a0);
  const __half2 m01 = __hmin2(a0, a1);
  const std::uint32_t b23 = __hlt2_mask(a3, a2);
  const __half2 m23 = __hmin2(a2, a3);
  const std::uint32_t high = __hlt2_mask(m23, m01);
  __half2 least = __hmin2(m01, m23);  // equal costs are equal halves: no tie can differ here
  if constexpr (kNormalise) least = __hsub2_rn(least, r);
  const std::uint32_t bit0 = (high & b23) | (~high & b01);
  ballots[0] = __ballot_sync(0xffffffffu, (bit0 & 1u) != 0);
  ballots[1] = __ballot_sync(0xffffffffu, (high & 1u) != 0);
  ballots[2] = __ballot_sync(0xffffffffu, (bit0 >> 16) != 0);
  ballots[3] = __ballot_sync(0xffffffffu, (high >> 16) != 0);
  const std::uint32_t vk[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const __half2 d = __hsub2_rn(x, AsHalf2(vk[k]));
    a[k] = AsWord(__hadd2_rn(least, __hmul2_rn(d, d)));
  }
}

// Stores the warp's four ballot words of a pair of groups at `words` (16-byte aligned), lane 0.
__device__ __forceinline__ void StoreBallots(std::uint32_t* words, const std::uint32_t (&ballots)[4]) {
  if (threadIdx.x % 32 == 0)
    *reinterpret_cast<uint4*>(words) = make_uint4(ballots[0], ballots[1], ballots[2], ballots[3]);
}

// The least non-negative binary16 of a word's two halves, as bits (their order is the values').
__device__ __forceinline__ std::uint32_t LeastHalf(std::uint32_t w) { return min(w & 0xFFFFu, w >> 16); }

// Steps of partner bits kLo + 2 and then kLo back to back in registers (layout phases 1-2, 3-4,
// 5-6): both steps' butterflies lie within the 16 positions P + i 2^kLo + k 2^(kLo+2) (i, k in
// 0..3) for every P with those four bits clear, and with P's bit 0 as the half of a word, a thread
// holds 16 words (32 positions) at once: w = base | i 2^(kLo-1) | k 2^(kLo+1) for a chunk base
// (the word's other 11 bits, in order, from chunk = m * kThreads + threadIdx.x). The first step's
// groups are the rows i (predecessors and successors k), the second's the columns k (predecessors
// and successors i). A step's ballot words: PairWord. `r` is subtracted in the first step when
// kNormalise (phase 1).

template <int kLo, bool kNormalise>
__device__ __forceinline__ void PairStep(int t, __half2 x0, __half2 x1, __half2 r, std::uint32_t* costs,
                                         std::uint32_t* bp0, std::uint32_t* bp1, const uint4* values) {
  constexpr std::uint32_t kRow = 1u << (kLo - 1), kColumn = 1u << (kLo + 1);  // word strides of i and k
  const uint4* values0 = values + static_cast<std::size_t>(t % kLayoutPeriod) * (kGroups / 2);
  const uint4* values1 = values0 + kGroups / 2;
#pragma unroll 1
  for (std::uint32_t m = 0; m < 2; ++m) {
    const std::uint32_t chunk = m * kThreads + threadIdx.x;
    const std::uint32_t base = PairChunkWord(chunk, kLo);
    uint4 value[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) value[i] = __ldg(values0 + PairIndex(base | i * kRow, kLo + 2));
    std::uint32_t a[4][4];  // [i][k]
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int k = 0; k < 4; ++k) a[i][k] = costs[CostWord(base | i * kRow | k * kColumn)];
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      std::uint32_t ballots[4];
      StepTwoGroups<kNormalise>(a[i], x0, value[i], r, ballots);
      StoreBallots(bp0 + PairWord(chunk, i), ballots);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) value[k] = __ldg(values1 + PairIndex(base | k * kColumn, kLo));
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      std::uint32_t column[4] = {a[0][k], a[1][k], a[2][k], a[3][k]};
      std::uint32_t ballots[4];
      StepTwoGroups<false>(column, x1, value[k], r, ballots);
      StoreBallots(bp1 + PairWord(chunk, k), ballots);
#pragma unroll
      for (int i = 0; i < 4; ++i) costs[CostWord(base | i * kRow | k * kColumn)] = column[i];
    }
  }
}

// The partner-bit-0 step (layout phase 7, "rows") and the partner-bit-14 step (phase 0: the next
// period's first step, or a run's first step alone, "columns"): both steps' butterflies lie within
// the 16 positions P + i + k 2^14 (i, k in 0..3) for P = c << 2, c = the positions' bits 2-13 (the
// thread's chunks c = m * kThreads + threadIdx.x). Row k is two words, (i 0, 1) and (i 2, 3), read
// as one 64-bit access. The row step's groups are the rows k (predecessors and successors i), two
// rows a pair after a transpose; the column step's the columns i (predecessors and successors k),
// columns 0-1 and 2-3 the halves of the rows' words as they are. Ballot words: BoundaryWord. With
// kColumns, the least cost written goes to *least (an atomic minimum over the block).

template <bool kRows, bool kColumns>
__device__ __forceinline__ void BoundaryPass(int t_rows, __half2 x_rows, __half2 x_columns, std::uint32_t* costs,
                                             std::uint32_t* bp_rows, std::uint32_t* bp_columns, const uint4* values,
                                             std::uint32_t* least) {
  const uint4* values_rows = values + static_cast<std::size_t>(t_rows % kLayoutPeriod) * (kGroups / 2);
  const uint4* values_columns = values;  // phase 0
  std::uint32_t lowest = kNoMinimum;
#pragma unroll 1
  for (std::uint32_t m = 0; m < 4; ++m) {
    const std::uint32_t c = m * kThreads + threadIdx.x;
    std::uint32_t a[4], b[4];  // row k: words (i 0, 1) and (i 2, 3)
    uint2* row[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      row[k] = reinterpret_cast<uint2*>(costs + CostWord((c << 1) | (static_cast<std::uint32_t>(k) << 13)));
      const uint2 w = *row[k];
      a[k] = w.x;
      b[k] = w.y;
    }
    if constexpr (kRows) {
      uint4 value[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) value[h] = __ldg(values_rows + (c | static_cast<std::uint32_t>(h) << 12));
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // Rows 2h and 2h + 1 as pairs: predecessor i of both.
        std::uint32_t p[4] = {LowHalves(a[2 * h], a[2 * h + 1]), HighHalves(a[2 * h], a[2 * h + 1]),
                              LowHalves(b[2 * h], b[2 * h + 1]), HighHalves(b[2 * h], b[2 * h + 1])};
        std::uint32_t ballots[4];
        StepTwoGroups<false>(p, x_rows, value[h], __half2{}, ballots);
        StoreBallots(bp_rows + BoundaryWord(c) + 4 * h, ballots);
        a[2 * h] = LowHalves(p[0], p[1]);
        a[2 * h + 1] = HighHalves(p[0], p[1]);
        b[2 * h] = LowHalves(p[2], p[3]);
        b[2 * h + 1] = HighHalves(p[2], p[3]);
      }
    }
    if constexpr (kColumns) {
      const uint4 value_a = __ldg(values_columns + (c << 1)), value_b = __ldg(values_columns + (c << 1 | 1u));
      std::uint32_t ballots[4];
      StepTwoGroups<false>(a, x_columns, value_a, __half2{}, ballots);
      StoreBallots(bp_columns + BoundaryWord(c), ballots);
      StepTwoGroups<false>(b, x_columns, value_b, __half2{}, ballots);
      StoreBallots(bp_columns + BoundaryWord(c) + 4, ballots);
#pragma unroll
      for (int k = 0; k < 4; ++k) lowest = min(lowest, min(LeastHalf(a[k]), LeastHalf(b[k])));
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) *row[k] = make_uint2(a[k], b[k]);
  }
  if constexpr (kColumns) {
    lowest = __reduce_min_sync(0xffffffffu, lowest);
    if (threadIdx.x % 32 == 0) atomicMin(least, lowest);
  }
}

// The steps of one run, a layout period (8 steps) at a time: the run's first step (partner bit
// 14) alone, then per period the pairs of partner bits 12-10, 8-6 and 4-2 and the partner-bit-0
// step with the next period's partner-bit-14 step, on block barriers; the run's last
// partner-bit-0 step alone. The first pair step of each period subtracts the least cost the pass
// before it wrote (trellis_viterbi.h's normalisation at t % 8 == 1), from one of two alternating
// slots of `least` (the other is reset for the period's last pass). `least[0]` must hold kNoMinimum
// on entry, the costs the run's start.
__device__ void Run(const __half* xs, int x_offset, std::uint32_t* costs, std::uint32_t* bps, const uint4* values,
                    std::uint32_t* least) {
  auto x = [&](int t) { return __half2half2(xs[(t + x_offset) % kSteps]); };
  auto bp = [&](int t) { return bps + static_cast<std::size_t>(t) * kBackpointerWordsPerStep; };
  __syncthreads();
  BoundaryPass<false, true>(0, x(0), x(0), costs, nullptr, bp(0), values, &least[0]);
  for (int t = 0; t < kSteps; t += kLayoutPeriod) {
    __syncthreads();
    const int slot = (t / kLayoutPeriod) & 1;
    const std::uint32_t r = least[slot];
    const __half2 r2 = AsHalf2(r | (r << 16));
    if (threadIdx.x == 0) least[slot ^ 1] = kNoMinimum;
    PairStep<10, true>(t + 1, x(t + 1), x(t + 2), r2, costs, bp(t + 1), bp(t + 2), values);
    __syncthreads();
    PairStep<6, false>(t + 3, x(t + 3), x(t + 4), r2, costs, bp(t + 3), bp(t + 4), values);
    __syncthreads();
    PairStep<2, false>(t + 5, x(t + 5), x(t + 6), r2, costs, bp(t + 5), bp(t + 6), values);
    __syncthreads();
    if (t + kLayoutPeriod < kSteps) {
      BoundaryPass<true, true>(t + 7, x(t + 7), x(t + 8), costs, bp(t + 7), bp(t + 8), values, &least[slot ^ 1]);
    } else {
      BoundaryPass<true, false>(t + 7, x(t + 7), x(t + 7), costs, bp(t + 7), nullptr, values, nullptr);
    }
  }
  __syncthreads();
}

// The backpointer of the group holding left-shift `state` before step t (trellis_viterbi.cc's
// Trace: group g at position rotr16(g, 2t)), where Run's passes stored it.
__device__ __forceinline__ std::uint32_t PreviousState(const std::uint32_t* bps, int t, std::uint32_t state) {
  const std::uint32_t group = state >> tr::kSymbolBits;
  std::uint32_t word, bit;
  BackpointerAt(t, Rotr16(group, tr::kSymbolBits * t), word, bit);  // the group's first position
  const std::uint32_t* wp = bps + static_cast<std::size_t>(t) * kBackpointerWordsPerStep + word;
  const std::uint32_t j = ((wp[0] >> bit) & 1u) | (((wp[1] >> bit) & 1u) << 1);
  return group | (j << (tr::kStateBits - tr::kSymbolBits));
}

// A position's cost as binary16 bits (positions 2w and 2w + 1 in word w).
__device__ __forceinline__ std::uint32_t CostBits(const std::uint32_t* costs, std::uint32_t position) {
  return (costs[CostWord(position >> 1)] >> (16 * (position & 1u))) & 0xFFFFu;
}

// The block's least cost and its first position (block-wide; the result in thread 0). Costs are
// non-negative, so their binary16 bits order as their values.
__device__ std::uint32_t BlockArgmin(const std::uint32_t* costs, std::uint32_t* warp_value, std::uint32_t* warp_index) {
  // Ascending words with strict comparisons: each thread keeps its first least.
  std::uint32_t best = kNoMinimum + 1, at = 0;
  for (std::uint32_t w = threadIdx.x; w < kCostWords; w += kThreads) {
    const std::uint32_t word = costs[CostWord(w)];
    if ((word & 0xFFFFu) < best) {
      best = word & 0xFFFFu;
      at = 2 * w;
    }
    if ((word >> 16) < best) {
      best = word >> 16;
      at = 2 * w + 1;
    }
  }
  auto take = [](std::uint32_t& v, std::uint32_t& i, std::uint32_t ov, std::uint32_t oi) {
    if (ov < v || (ov == v && oi < i)) {
      v = ov;
      i = oi;
    }
  };
  for (int o = 16; o > 0; o /= 2)
    take(best, at, __shfl_down_sync(0xffffffffu, best, o), __shfl_down_sync(0xffffffffu, at, o));
  if (threadIdx.x % 32 == 0) {
    warp_value[threadIdx.x / 32] = best;
    warp_index[threadIdx.x / 32] = at;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) take(best, at, warp_value[w], warp_index[w]);
  }
  return at;
}

__global__ void __launch_bounds__(kThreads, 1) TrellisSearchKernel(const __grid_constant__ SearchParams p) {
  extern __shared__ std::uint32_t costs[];  // kCostWords half2 words
  __shared__ __half xs[kSteps];
  __shared__ std::uint32_t warp_value[kWarps];
  __shared__ std::uint32_t warp_index[kWarps];
  __shared__ std::uint32_t least[2];
  __shared__ std::uint32_t overlap;
  std::uint32_t* bps = p.backpointers + blockIdx.x * kBackpointerWordsPerBlock;

  for (std::int64_t tile = blockIdx.x; tile < p.tiles; tile += gridDim.x) {
    // The last tile's trace read xs and the costs (thread 0): wait for it.
    __syncthreads();
    if (threadIdx.x < kSteps) {
      // trellis_viterbi.h's xh: the target clamped to +-kTargetLimit (fmaxf first: NaN becomes the
      // lower limit, as on the CPU), then rounded.
      const float target = p.targets[tile * kSteps + threadIdx.x];
      xs[threadIdx.x] = __float2half_rn(fminf(fmaxf(target, -tr::kTargetLimit), tr::kTargetLimit));
    }
    if (threadIdx.x == 0) least[0] = kNoMinimum;
    // Probe: the ring from the seam (targets 128.., 0..127), from a free start.
    for (std::uint32_t i = threadIdx.x; i < kCostWords; i += kThreads) costs[i] = 0u;
    Run(xs, kSteps / 2, costs, bps, p.values, least);
    const std::uint32_t end = BlockArgmin(costs, warp_value, warp_index);
    if (threadIdx.x == 0) {
      // The seven symbols before the seam (probe steps 121..127) are the overlap, oldest first.
      std::uint32_t state = end, seam = 0;
      for (int t = kSteps - 1; t >= kSteps / 2 - kProbeSeamSymbols; --t) {
        if (t < kSteps / 2) seam |= (state & 3u) << (tr::kSymbolBits * (kSteps / 2 - 1 - t));
        state = PreviousState(bps, t, state);
      }
      overlap = seam;
      least[0] = kNoMinimum;
    }
    __syncthreads();
    // Full ring: s_{-1} is any state carrying the overlap; every other start is unreachable.
    const std::uint32_t seam = overlap;
    for (std::uint32_t i = threadIdx.x; i < kCostWords; i += kThreads) costs[i] = kHalfInfinityWord;
    __syncthreads();
    if (threadIdx.x < 4) {
      const std::uint32_t position = seam | (threadIdx.x << 14);
      reinterpret_cast<unsigned short*>(costs)[2 * CostWord(position >> 1) + (position & 1u)] = 0;
    }
    Run(xs, 0, costs, bps, p.values, least);
    if (threadIdx.x == 0) {
      std::uint32_t end = seam, least_bits = CostBits(costs, seam);
      for (std::uint32_t j = 1; j < 4; ++j) {
        const std::uint32_t c = CostBits(costs, seam | (j << 14));
        if (c < least_bits) {
          least_bits = c;
          end = seam | (j << 14);
        }
      }
      std::uint8_t* out = p.symbols + tile * kSteps;
      std::uint32_t state = end;
      for (int t = kSteps - 1; t >= 0; --t) {
        out[t] = static_cast<std::uint8_t>(state & 3u);
        state = PreviousState(bps, t, state);
      }
    }
  }
}

class CudaTrellisTileSearch final : public quant::TrellisTileSearch {
 public:
  CudaTrellisTileSearch(int device, int blocks) : device_(device), blocks_(blocks) {}
  CudaTrellisTileSearch(const CudaTrellisTileSearch&) = delete;
  CudaTrellisTileSearch& operator=(const CudaTrellisTileSearch&) = delete;

  ~CudaTrellisTileSearch() override {
    if (cudaSetDevice(device_) != cudaSuccess) return;
    cudaFree(backpointers_);
    cudaFree(values_);
    cudaFree(targets_);
    cudaFree(symbols_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  absl::Status Init() {
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    NQ_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    NQ_CUDA_RETURN_IF_ERROR(cudaMalloc(&backpointers_, blocks_ * kBackpointerWordsPerBlock * sizeof(std::uint32_t)));
    NQ_CUDA_RETURN_IF_ERROR(cudaMalloc(&values_, kValuePairs * sizeof(uint4)));
    constexpr unsigned kBuildThreads = 256;
    BuildValuesKernel<<<static_cast<unsigned>((kValuePairs + kBuildThreads - 1) / kBuildThreads), kBuildThreads, 0,
                        stream_>>>(values_);
    RETURN_IF_ERROR(CheckLaunch("BuildValuesKernel"));
    NQ_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

  std::string where() const override {
    return absl::StrCat("cuda:", device_, ", ", blocks_, " blocks of ", kThreads, " threads");
  }

  absl::Status Search(std::span<const float> targets, std::span<std::uint8_t> symbols) override {
    RETURN_IF_ERROR(quant::CheckTileSearchArguments(targets, symbols));
    const std::int64_t tiles = static_cast<std::int64_t>(targets.size()) / kSteps;
    if (tiles == 0) return absl::OkStatus();
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    if (tiles > capacity_) {
      NQ_CUDA_RETURN_IF_ERROR(cudaFree(targets_));
      NQ_CUDA_RETURN_IF_ERROR(cudaFree(symbols_));
      targets_ = nullptr;
      symbols_ = nullptr;
      capacity_ = 0;
      NQ_CUDA_RETURN_IF_ERROR(cudaMalloc(&targets_, targets.size_bytes()));
      NQ_CUDA_RETURN_IF_ERROR(cudaMalloc(&symbols_, symbols.size_bytes()));
      capacity_ = tiles;
    }
    NQ_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(targets_, targets.data(), targets.size_bytes(), cudaMemcpyHostToDevice, stream_));
    const SearchParams params{targets_, symbols_, backpointers_, tiles, values_};
    const unsigned blocks = static_cast<unsigned>(std::min<std::int64_t>(blocks_, tiles));
    TrellisSearchKernel<<<blocks, kThreads, kCostBytes, stream_>>>(params);
    RETURN_IF_ERROR(CheckLaunch("TrellisSearchKernel"));
    NQ_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(symbols.data(), symbols_, symbols.size_bytes(), cudaMemcpyDeviceToHost, stream_));
    NQ_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

 private:
  int device_;
  int blocks_;  // blocks resident at once: the grid, each looping over tiles
  cudaStream_t stream_ = nullptr;
  std::uint32_t* backpointers_ = nullptr;
  uint4* values_ = nullptr;  // kValuePairs (SearchParams::values)
  float* targets_ = nullptr;
  std::uint8_t* symbols_ = nullptr;
  std::int64_t capacity_ = 0;  // tiles the buffers hold
};

}  // namespace

absl::StatusOr<std::unique_ptr<quant::TrellisTileSearch>> MakeCudaTrellisTileSearch(int device) {
  int count = 0;
  NQ_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count));
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("trellis search: no CUDA device ", device, " (", count, " present)"));
  }
  int major = 0;
  NQ_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (major < 9) {
    return absl::FailedPreconditionError(absl::StrCat("trellis search: CUDA device ", device,
                                                      " is compute capability ", major, ".x; this build runs on 9.0"));
  }
  NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  NQ_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(TrellisSearchKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(kCostBytes)));
  int per_sm = 0, sms = 0;
  NQ_CUDA_RETURN_IF_ERROR(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, TrellisSearchKernel, kThreads, kCostBytes));
  NQ_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  if (per_sm < 1) {
    return absl::FailedPreconditionError(absl::StrCat("trellis search: CUDA device ", device, " cannot run a block of ",
                                                      kThreads, " threads with ", kCostBytes,
                                                      " bytes of shared memory"));
  }
  auto search = std::make_unique<CudaTrellisTileSearch>(device, per_sm * sms);
  RETURN_IF_ERROR(search->Init());
  return search;
}

}  // namespace nq::kernels::cuda
