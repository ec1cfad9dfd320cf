#include "kernels/cuda/trellis_search.h"

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_util.h"
#include "services/common/status_macros.h"
#include "services/quant/trellis_decode.h"
#include "services/quant/trellis_viterbi.h"

namespace nq::kernels::cuda {
namespace {

namespace cg = cooperative_groups;
namespace tr = quant::trellis;

// The search is trellis_viterbi.cc's, step for step: the same in-place layout (the cost of
// left-shift state s at step t sits at position rotr16(s, 2t)), the same butterflies (the four
// positions p0 + k 2^b, b = PartnerBit(t), are a group's four predecessors before the step and
// its four successors after it), the same comparisons for the minimum and its index, and the
// same float operations for the costs, each rounded on its own (no fused multiply-add), so the
// codes equal the CPU's. Only the order of the work differs: two consecutive steps touch 16
// positions closed under both steps' butterflies, so each thread runs them on those costs in
// registers (PairStep, BoundarySteps) and a layout period of 8 steps takes 4 passes over the costs
// in shared memory, not 8.
constexpr int kClusterBlocks = 2;
constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr uint32_t kPositionsPerBlock = tr::kStateCount / kClusterBlocks;  // 32768: the top bit picks the block
constexpr uint32_t kGroups = tr::kStateCount >> tr::kSymbolBits;            // 16384 butterflies a step
constexpr uint32_t kGroupsPerBlock = kGroups / kClusterBlocks;             // 8192
constexpr int kGroupsPerThread = static_cast<int>(kGroupsPerBlock / kThreads);
// Backpointers of one step: bit plane 0 and 1 of the 2-bit index, one word per 32 groups each
// (which 32 groups share a word depends on the step's kind: SingleStep, PairBackpointerWord).
constexpr int kBackpointerWordsPerStep = static_cast<int>(kGroups / 32) * 2;
constexpr int kSteps = tr::kTileWeights;
constexpr std::size_t kBackpointerWordsPerCluster = static_cast<std::size_t>(kSteps) * kBackpointerWordsPerStep;
constexpr std::size_t kCostBytes = kPositionsPerBlock * sizeof(float);  // dynamic shared memory
// Steps whose butterflies span both blocks: partner bits 14 and 15 (PartnerBit(t) == 14, every
// eighth step from 0). The layout returns to natural order every kLayoutPeriod steps.
constexpr int kLayoutPeriod = tr::kStateBits / tr::kSymbolBits;
constexpr int kProbeSeamSymbols = tr::kStateSpan - 1;  // the symbols s_{-1} and s_255 share

static_assert(tr::kProbeSteps == kSteps, "the probe reuses the full run's backpointer scratch");
static_assert(kGroupsPerBlock % kThreads == 0);

// The codebook values of the successor states, per step of the layout period: step t's group q
// writes the four successors rotl16(p0, 2t + 2) | k, whose values depend only on (t mod
// kLayoutPeriod, q, k), not on the tile. Tabled once per search (BuildValuesKernel, the CPU's
// float arithmetic), a step loads 16 bytes a group from L2 instead of computing four hashes (about
// 16 integer instructions a group) or unpacking four byte sums (3 instructions a value: measured
// 2.7 % slower on the H100). 2 MiB: kLayoutPeriod x kGroups x 4 floats.
constexpr std::size_t kValueEntries = static_cast<std::size_t>(kLayoutPeriod) * kGroups * 4;

struct SearchParams {
  const float* targets;    // tiles x 256, unit-scaled, tile order
  std::uint8_t* symbols;   // tiles x 256
  std::uint32_t* backpointers;  // kBackpointerWordsPerCluster per cluster
  std::int64_t tiles;
  const float4* values;  // [t mod kLayoutPeriod][group q]: the four successors' codebook values
};

__device__ __forceinline__ int PartnerBit(int t) { return (tr::kStateBits - tr::kSymbolBits - tr::kSymbolBits * t) & 15; }

__device__ __forceinline__ std::uint32_t Rotl16(std::uint32_t v, int r) {
  r &= 15;
  return ((v << r) | (v >> ((16 - r) & 15))) & tr::kStateMask;
}
__device__ __forceinline__ std::uint32_t Rotr16(std::uint32_t v, int r) {
  r &= 15;
  return ((v >> r) | (v << ((16 - r) & 15))) & tr::kStateMask;
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

// The byte sum of the hash of successor k of group q at a step of layout phase `phase` (t mod
// kLayoutPeriod): position p0 + k 2^b then holds successor rotl16(p0, 2t + 2) | k, whose
// right-shift state is LeftToRight(rotl16(p0, 2t + 2)) | k << 14, so the four hashes differ by
// k * (kHashMul << 14).
__device__ __forceinline__ std::uint32_t SuccessorByteSum(int phase, std::uint32_t q, std::uint32_t k) {
  const int b = PartnerBit(phase);
  const std::uint32_t p0 = (q & ((1u << b) - 1u)) | ((q >> b) << (b + tr::kSymbolBits));
  const std::uint32_t h = LeftToRight(Rotl16(p0, 2 * phase + 2)) * tr::kHashMul + tr::kHashAdd + k * (tr::kHashMul << 14);
  return __dp4a(h, 0x01010101u, 0u);
}

// Every entry of the value table: the same float as the CPU's UnitValues() of that state.
__global__ void BuildValuesKernel(float* values) {
  const std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= kValueEntries) return;
  const int phase = static_cast<int>(i / (kGroups * 4));
  const std::uint32_t q = static_cast<std::uint32_t>(i / 4 % kGroups), k = static_cast<std::uint32_t>(i % 4);
  values[i] = UnitValueOfBiasedSum(0x4B000000u | SuccessorByteSum(phase, q, k));
}

// Where a position's cost sits in its block's shared memory: bits 2-4 of the position XOR bits 6-8.
// Without it the steps of partner bits 2 and 4 put four lanes on each bank (the lanes of a warp
// differ in position bits 0, 1 and 6-8 there); with it every access pattern below is free of
// bank conflicts, and bits 0-1 (a float4 of the partner-bit-0 step) and 5 and up are unchanged.
__device__ __forceinline__ std::uint32_t CostAddress(std::uint32_t position) {
  return position ^ (((position >> 6) & 7u) << 2);
}

// Successor k's value in a group's entry of the value table.
__device__ __forceinline__ float SuccessorValue(float4 v, int k) {
  return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
}

// The least of a group's four predecessor costs and its index, with trellis_viterbi.cc's
// comparisons (ties keep the lower index).
__device__ __forceinline__ float LeastOfFour(float a0, float a1, float a2, float a3, std::uint32_t& j) {
  const bool b01 = a1 < a0;
  const float m01 = b01 ? a1 : a0;
  const bool b23 = a3 < a2;
  const float m23 = b23 ? a3 : a2;
  const bool high = m23 < m01;
  j = high ? 2u + static_cast<std::uint32_t>(b23) : static_cast<std::uint32_t>(b01);
  return high ? m23 : m01;
}

// A successor's cost, rounded as the CPU rounds it: least + (x - value)^2, no fused multiply-add.
__device__ __forceinline__ float NextCost(float least, float x, float value) {
  const float d = __fsub_rn(x, value);
  return __fadd_rn(least, __fmul_rn(d, d));
}

// One step on its own: a run's first step (the crossing step, partner bit 14) and its last
// (partner bit 0). This block's butterflies are the groups q of the block's range, 32 consecutive q
// a warp, whose 2-bit backpointers are two ballot words per 32 groups (word (q / 32) * 2 and the
// next). The costs of positions with top bit r live in block r's `half[r]`; only the crossing step
// touches the other block's half.
template <bool kCrossing>
__device__ __forceinline__ void SingleStep(int t, float x, float* const (&half)[2], int rank, std::uint32_t* bp,
                                           const float4* values) {
  const int b = PartnerBit(t);
  const std::uint32_t stride = 1u << b;
  const std::uint32_t low = stride - 1u;
  const int lane = threadIdx.x % 32;
  // This step's phase of the value table: four floats a group.
  const float4* phase_values = values + static_cast<std::size_t>(t % kLayoutPeriod) * kGroups;
#pragma unroll 1
  for (int m = 0; m < kGroupsPerThread; ++m) {
    const std::uint32_t q = rank * kGroupsPerBlock + m * kThreads + threadIdx.x;
    const float4 value = __ldg(phase_values + q);  // issued first: its L2 latency overlaps the loads below
    const std::uint32_t p0 = (q & low) | ((q >> b) << (b + tr::kSymbolBits));
    float a[4];
    float* c[4];
    if constexpr (kCrossing) {
      // b = 14: p0 < 2^14; positions p0 and p0 + 2^14 in block 0, p0 + 2^15 and + 3 * 2^14 in block 1.
      const std::uint32_t at = CostAddress(p0);
      c[0] = half[0] + at;
      c[1] = half[0] + at + stride;
      c[2] = half[1] + at;
      c[3] = half[1] + at + stride;
#pragma unroll
      for (int k = 0; k < 4; ++k) a[k] = *c[k];
    } else {
      // b = 0: the four positions are adjacent, and CostAddress keeps them so.
      extern __shared__ float costs[];  // this block's half (the kernel's dynamic shared memory)
      c[0] = costs + CostAddress(p0 & (kPositionsPerBlock - 1u));
      const float4 v = *reinterpret_cast<const float4*>(c[0]);
      a[0] = v.x, a[1] = v.y, a[2] = v.z, a[3] = v.w;
    }
    std::uint32_t j;
    const float least = LeastOfFour(a[0], a[1], a[2], a[3], j);
    // Position p0 + k 2^b now holds successor k.
    float next[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) next[k] = NextCost(least, x, SuccessorValue(value, k));
    if constexpr (kCrossing) {
#pragma unroll
      for (int k = 0; k < 4; ++k) *c[k] = next[k];
    } else {
      *reinterpret_cast<float4*>(c[0]) = make_float4(next[0], next[1], next[2], next[3]);
    }
    const unsigned bit0 = __ballot_sync(0xffffffffu, (j & 1u) != 0);
    const unsigned bit1 = __ballot_sync(0xffffffffu, (j & 2u) != 0);
    if (lane == 0) {
      std::uint32_t* w = bp + (q / 32) * 2;
      w[0] = bit0;
      w[1] = bit1;
    }
  }
}

// One step on the 4 x 4 costs a thread holds: group g's four predecessors, and after the step its
// four successors k, are a[g][k] when the step's groups are the rows (kRows), a[k][g] when they
// are the columns; `values[g]` holds its successors' codebook values. Leaves the groups'
// backpointers as ballot words, bits[g][plane] for the warp's 32 lanes.
template <bool kRows>
__device__ __forceinline__ void StepInRegisters(float (&a)[4][4], float x, const float4 (&values)[4],
                                                std::uint32_t (&bits)[4][2]) {
#pragma unroll
  for (int g = 0; g < 4; ++g) {
    auto cost = [&](int k) -> float& { return kRows ? a[g][k] : a[k][g]; };
    std::uint32_t j;
    const float least = LeastOfFour(cost(0), cost(1), cost(2), cost(3), j);
#pragma unroll
    for (int k = 0; k < 4; ++k) cost(k) = NextCost(least, x, SuccessorValue(values[g], k));
    bits[g][0] = __ballot_sync(0xffffffffu, (j & 1u) != 0);
    bits[g][1] = __ballot_sync(0xffffffffu, (j & 2u) != 0);
  }
}

// Steps of partner bits kLo + 2 and then kLo run back to back in registers (layout phases 1-2,
// 3-4, 5-6): both steps' butterflies lie within the 16 positions P + i 2^kLo + k 2^(kLo+2) (i, k in
// 0..3) for every P with those four bits clear, so a thread loads 16 costs once, runs both steps
// and stores them once: half the shared-memory traffic and no barrier between the two. The first
// step's groups are the rows i (predecessors and successors k), the second's the columns k
// (predecessors and successors i). A thread holds chunks c = m * kThreads + threadIdx.x (the
// position's other 11 bits in order); a step's backpointers are two ballot words per (rank, m,
// warp, group of the chunk), PairBackpointerWord.
__device__ __forceinline__ std::uint32_t ChunkPosition(std::uint32_t chunk, int lo) {
  return (chunk & ((1u << lo) - 1u)) | ((chunk >> lo) << (lo + 4));
}
__device__ __forceinline__ std::uint32_t PairBackpointerWord(int rank, std::uint32_t chunk, std::uint32_t group) {
  const std::uint32_t m = chunk / kThreads, warp = chunk % kThreads / 32;
  return ((((static_cast<std::uint32_t>(rank) * 2u + m) * kWarps + warp) * 4u + group) * 2u);
}
static_assert(kPositionsPerBlock / 16 == 2 * kThreads, "two 16-position chunks a thread");
static_assert(2u * 2u * kWarps * 4u * 2u == static_cast<unsigned>(kBackpointerWordsPerStep));

// A chunk's four groups' ballot words (PairBackpointerWord's eight consecutive words from
// `words`), stored by lane 0.
__device__ __forceinline__ void StoreChunkBallots(std::uint32_t* words, const std::uint32_t (&bits)[4][2]) {
  if (threadIdx.x % 32 != 0) return;
  uint4* w = reinterpret_cast<uint4*>(words);
  w[0] = make_uint4(bits[0][0], bits[0][1], bits[1][0], bits[1][1]);
  w[1] = make_uint4(bits[2][0], bits[2][1], bits[3][0], bits[3][1]);
}

template <int kLo>
__device__ __forceinline__ void PairStep(int t, float x0, float x1, float* costs, int rank, std::uint32_t* bp0,
                                         std::uint32_t* bp1, const float4* values) {
  constexpr std::uint32_t kRow = 1u << kLo, kColumn = 1u << (kLo + 2);
  const float4* values0 = values + static_cast<std::size_t>(t % kLayoutPeriod) * kGroups;
  const float4* values1 = values0 + kGroups;
  const std::uint32_t block_bit = static_cast<std::uint32_t>(rank) << 15;
#pragma unroll 1
  for (std::uint32_t m = 0; m < 2; ++m) {
    const std::uint32_t chunk = m * kThreads + threadIdx.x;
    const std::uint32_t base = ChunkPosition(chunk, kLo);  // in this block; the 4 bits at kLo clear
    // The step's group of p0 is QuadIndex(p0, b): p0 with its two partner bits dropped.
    float4 value0[4], value1[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const std::uint32_t p0 = block_bit | base | i * kRow;  // row i: partner bits kLo + 2, kLo + 3
      value0[i] = __ldg(values0 + ((p0 & (kColumn - 1u)) | ((p0 >> (kLo + 4)) << (kLo + 2))));
    }
    float a[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int k = 0; k < 4; ++k) a[i][k] = costs[CostAddress(base | i * kRow | k * kColumn)];
    }
    std::uint32_t bits[4][2];  // a step's backpointers: [group][ballot plane]
    StepInRegisters<true>(a, x0, value0, bits);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const std::uint32_t p0 = block_bit | base | k * kColumn;  // column k: partner bits kLo, kLo + 1
      value1[k] = __ldg(values1 + ((p0 & (kRow - 1u)) | ((p0 >> (kLo + 2)) << kLo)));
    }
    const std::uint32_t word = PairBackpointerWord(rank, chunk, 0);
    StoreChunkBallots(bp0 + word, bits);
    StepInRegisters<false>(a, x1, value1, bits);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int k = 0; k < 4; ++k) costs[CostAddress(base | i * kRow | k * kColumn)] = a[i][k];
    }
    StoreChunkBallots(bp1 + word, bits);
  }
}

// The partner-bit-0 step (layout phase 7) and the next period's crossing step (partner bit 14)
// back to back in registers: both steps' butterflies lie within the 16 positions P + i + k 2^14
// (i, k in 0..3; bits 14 and 15 pick the block, so half of each thread's positions are in the
// other block's shared memory) for every P = c << 2, c the positions' bits 2-13. Block r holds
// the chunks c with bit 11 = r, thread chunk = c % 2048 = m * kThreads + threadIdx.x. The first
// step's groups are the rows k (q = c | k << 12: the single steps' ballot words), the second's
// the columns i (q = P | i: PairBackpointerWord(r, chunk, i)).
__device__ __forceinline__ void BoundarySteps(int t, float x_first, float x_second, float* const (&half)[2], int rank,
                                              std::uint32_t* bp_first, std::uint32_t* bp_second,
                                              const float4* values) {
  const int lane = threadIdx.x % 32;
  const float4* values_first = values + static_cast<std::size_t>(t % kLayoutPeriod) * kGroups;
  const float4* values_second = values;  // layout phase 0
#pragma unroll 1
  for (std::uint32_t m = 0; m < 2; ++m) {
    const std::uint32_t chunk = m * kThreads + threadIdx.x;
    const std::uint32_t c = (static_cast<std::uint32_t>(rank) << 11) | chunk;
    const std::uint32_t base = c << 2;
    float4 value_first[4], value_second[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) value_first[k] = __ldg(values_first + (c | static_cast<std::uint32_t>(k) << 12));
    float a[4][4];  // [k][i]: position base + i + k 2^14
    float* row[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      row[k] = half[k >> 1] + CostAddress(base + ((k & 1u) << 14));
      const float4 v = *reinterpret_cast<const float4*>(row[k]);
      a[k][0] = v.x, a[k][1] = v.y, a[k][2] = v.z, a[k][3] = v.w;
    }
    std::uint32_t bits[4][2];
    StepInRegisters<true>(a, x_first, value_first, bits);
#pragma unroll
    for (int i = 0; i < 4; ++i) value_second[i] = __ldg(values_second + (base | static_cast<std::uint32_t>(i)));
    if (lane == 0) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        std::uint32_t* w = bp_first + (((c | static_cast<std::uint32_t>(k) << 12) / 32) * 2);
        w[0] = bits[k][0];
        w[1] = bits[k][1];
      }
    }
    StepInRegisters<false>(a, x_second, value_second, bits);
    StoreChunkBallots(bp_second + PairBackpointerWord(rank, chunk, 0), bits);
#pragma unroll
    for (int k = 0; k < 4; ++k) *reinterpret_cast<float4*>(row[k]) = make_float4(a[k][0], a[k][1], a[k][2], a[k][3]);
  }
}

// The steps of one run, a layout period (8 steps) at a time: the pairs of partner bits 12-10 (on
// a cluster barrier: the crossing step before them wrote into this block's half), 8-6 and 4-2 (on
// block barriers), then the partner-bit-0 step with the next period's crossing step (on a cluster
// barrier: they read the other block's half). The run's first crossing step and its last
// partner-bit-0 step run alone. 4 passes over the costs a period, against 8 a step at a time.
__device__ void Run(const float* xs, int x_offset, float* const (&half)[2], int rank, std::uint32_t* bps,
                    const float4* values, cg::cluster_group& cluster) {
  extern __shared__ float costs[];
  static_assert(kLayoutPeriod == 8 && kSteps % kLayoutPeriod == 0);
  auto x = [&](int t) { return xs[(t + x_offset) % kSteps]; };
  auto bp = [&](int t) { return bps + static_cast<std::size_t>(t) * kBackpointerWordsPerStep; };
  cluster.sync();
  SingleStep<true>(0, x(0), half, rank, bp(0), values);
  for (int t = 0; t < kSteps; t += kLayoutPeriod) {
    cluster.sync();
    PairStep<10>(t + 1, x(t + 1), x(t + 2), costs, rank, bp(t + 1), bp(t + 2), values);
    __syncthreads();
    PairStep<6>(t + 3, x(t + 3), x(t + 4), costs, rank, bp(t + 3), bp(t + 4), values);
    __syncthreads();
    PairStep<2>(t + 5, x(t + 5), x(t + 6), costs, rank, bp(t + 5), bp(t + 6), values);
    if (t + kLayoutPeriod < kSteps) {
      cluster.sync();
      BoundarySteps(t + 7, x(t + 7), x(t + 8), half, rank, bp(t + 7), bp(t + 8), values);
    } else {
      __syncthreads();
      SingleStep<false>(t + 7, x(t + 7), half, rank, bp(t + 7), values);
    }
  }
}

// The backpointer of the group holding left-shift `state` before step t (trellis_viterbi.cc's
// Trace: group g at position rotr16(g, 2t)), where Run's step stored it.
__device__ __forceinline__ std::uint32_t PreviousState(const std::uint32_t* bps, int t, std::uint32_t state) {
  const std::uint32_t group = state >> tr::kSymbolBits;
  const int b = PartnerBit(t);
  const std::uint32_t p0 = Rotr16(group, tr::kSymbolBits * t);
  const int phase = t % kLayoutPeriod;
  std::uint32_t word, bit;
  if (phase == 0 && t > 0) {
    // BoundarySteps' second step: column i = bits 0-1 of p0, chunk c = bits 2-13.
    const std::uint32_t c = p0 >> 2;
    word = PairBackpointerWord(static_cast<int>(c >> 11), c & 2047u, p0 & 3u);
    bit = c % 32;
  } else if (phase == 0 || phase == kLayoutPeriod - 1) {
    const std::uint32_t q = (p0 & ((1u << b) - 1u)) | ((p0 >> (b + tr::kSymbolBits)) << b);
    word = (q / 32) * 2;
    bit = q % 32;
  } else {
    // A pair's first step (odd phases, partner bit lo + 2) holds row i = bits lo, lo + 1 of p0;
    // its second (partner bit lo) column k = bits lo + 2, lo + 3.
    const int lo = phase % 2 == 1 ? b - 2 : b;
    const std::uint32_t in_pair = phase % 2 == 1 ? (p0 >> lo) & 3u : (p0 >> (lo + 2)) & 3u;
    const std::uint32_t local = p0 & (kPositionsPerBlock - 1u);
    const std::uint32_t chunk = (local & ((1u << lo) - 1u)) | ((local >> (lo + 4)) << lo);
    word = PairBackpointerWord(static_cast<int>(p0 >> 15), chunk, in_pair);
    bit = chunk % 32;
  }
  const std::uint32_t* w = bps + static_cast<std::size_t>(t) * kBackpointerWordsPerStep + word;
  const std::uint32_t j = ((w[0] >> bit) & 1u) | (((w[1] >> bit) & 1u) << 1);
  return group | (j << (tr::kStateBits - tr::kSymbolBits));
}

// This block's least cost and its first position (block-wide; the result in thread 0).
__device__ void BlockArgmin(const float* costs, std::uint32_t first_position, float* warp_value,
                            std::uint32_t* warp_index, float& value, std::uint32_t& index) {
  // Ascending positions with a strict comparison: each thread keeps its first least.
  float best = costs[CostAddress(threadIdx.x)];
  std::uint32_t at = threadIdx.x;
  for (std::uint32_t p = threadIdx.x + kThreads; p < kPositionsPerBlock; p += kThreads) {
    const float c = costs[CostAddress(p)];
    if (c < best) {
      best = c;
      at = p;
    }
  }
  auto take = [](float& v, std::uint32_t& i, float ov, std::uint32_t oi) {
    if (ov < v || (ov == v && oi < i)) {
      v = ov;
      i = oi;
    }
  };
  for (int o = 16; o > 0; o /= 2) take(best, at, __shfl_down_sync(0xffffffffu, best, o), __shfl_down_sync(0xffffffffu, at, o));
  if (threadIdx.x % 32 == 0) {
    warp_value[threadIdx.x / 32] = best;
    warp_index[threadIdx.x / 32] = at;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) take(best, at, warp_value[w], warp_index[w]);
    value = best;
    index = first_position + at;
  }
}

__global__ void __cluster_dims__(kClusterBlocks, 1, 1) __launch_bounds__(kThreads, 1)
    TrellisSearchKernel(const __grid_constant__ SearchParams p) {
  extern __shared__ float costs[];  // this block's half: positions [rank * 2^15, rank * 2^15 + 2^15)
  __shared__ float xs[kSteps];
  __shared__ float warp_value[kWarps];
  __shared__ std::uint32_t warp_index[kWarps];
  __shared__ float block_least;
  __shared__ std::uint32_t block_least_at;
  __shared__ std::uint32_t overlap;

  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  float* other = cluster.map_shared_rank(costs, rank ^ 1);
  float* const half[2] = {rank == 0 ? costs : other, rank == 0 ? other : costs};
  const std::int64_t cluster_id = blockIdx.x / kClusterBlocks;
  const std::int64_t clusters = gridDim.x / kClusterBlocks;
  std::uint32_t* bps = p.backpointers + cluster_id * kBackpointerWordsPerCluster;

  for (std::int64_t tile = cluster_id; tile < p.tiles; tile += clusters) {
    // The last tile's end read this block's costs (the other block's thread 0): wait for it.
    cluster.sync();
    if (threadIdx.x < kSteps) xs[threadIdx.x] = p.targets[tile * kSteps + threadIdx.x];
    // Probe: the ring from the seam (targets 128.., 0..127), from a free start.
    for (std::uint32_t i = threadIdx.x; i < kPositionsPerBlock; i += kThreads) costs[i] = 0.0f;
    __syncthreads();
    Run(xs, kSteps / 2, half, rank, bps, p.values, cluster);
    cluster.sync();
    BlockArgmin(costs, rank * kPositionsPerBlock, warp_value, warp_index, block_least, block_least_at);
    cluster.sync();
    if (rank == 0 && threadIdx.x == 0) {
      // Block 0's positions come first: it keeps a tie.
      const float other_least = *cluster.map_shared_rank(&block_least, 1);
      const std::uint32_t end = other_least < block_least ? *cluster.map_shared_rank(&block_least_at, 1)
                                                          : block_least_at;
      // The seven symbols before the seam (probe steps 121..127) are the overlap, oldest first.
      std::uint32_t state = end, seam = 0;
      for (int t = kSteps - 1; t >= kSteps / 2 - kProbeSeamSymbols; --t) {
        if (t < kSteps / 2) seam |= (state & 3u) << (tr::kSymbolBits * (kSteps / 2 - 1 - t));
        state = PreviousState(bps, t, state);
      }
      overlap = seam;
    }
    cluster.sync();
    // Full ring: s_{-1} is any state carrying the overlap; every other start is unreachable.
    const std::uint32_t seam = *cluster.map_shared_rank(&overlap, 0);
    for (std::uint32_t i = threadIdx.x; i < kPositionsPerBlock; i += kThreads) costs[i] = INFINITY;
    __syncthreads();
    if (threadIdx.x < 2) costs[CostAddress(seam + threadIdx.x * (1u << 14))] = 0.0f;  // j = 2 rank + threadIdx.x
    Run(xs, 0, half, rank, bps, p.values, cluster);
    cluster.sync();
    if (rank == 0 && threadIdx.x == 0) {
      std::uint32_t end = seam;
      float least = half[0][CostAddress(seam)];
      for (std::uint32_t j = 1; j < 4; ++j) {
        const float c = half[j >> 1][CostAddress(seam + (j & 1u) * (1u << 14))];
        if (c < least) {
          least = c;
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
  cluster.sync();  // no block leaves while the other may still read its shared memory
}

class CudaTrellisTileSearch final : public quant::TrellisTileSearch {
 public:
  CudaTrellisTileSearch(int device, int clusters) : device_(device), clusters_(clusters) {}
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
    NQ_CUDA_RETURN_IF_ERROR(cudaMalloc(&backpointers_, clusters_ * kBackpointerWordsPerCluster * sizeof(std::uint32_t)));
    NQ_CUDA_RETURN_IF_ERROR(cudaMalloc(&values_, kValueEntries * sizeof(float)));
    constexpr unsigned kBuildThreads = 256;
    BuildValuesKernel<<<static_cast<unsigned>((kValueEntries + kBuildThreads - 1) / kBuildThreads), kBuildThreads, 0,
                        stream_>>>(values_);
    RETURN_IF_ERROR(CheckLaunch("BuildValuesKernel"));
    NQ_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

  std::string where() const override {
    return absl::StrCat("cuda:", device_, ", ", clusters_, " clusters of ", kClusterBlocks, " SMs");
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
    const SearchParams params{targets_, symbols_, backpointers_, tiles, reinterpret_cast<const float4*>(values_)};
    const unsigned clusters = static_cast<unsigned>(std::min<std::int64_t>(clusters_, tiles));
    TrellisSearchKernel<<<clusters * kClusterBlocks, kThreads, kCostBytes, stream_>>>(params);
    RETURN_IF_ERROR(CheckLaunch("TrellisSearchKernel"));
    NQ_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(symbols.data(), symbols_, symbols.size_bytes(), cudaMemcpyDeviceToHost, stream_));
    NQ_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

 private:
  int device_;
  int clusters_;  // clusters resident at once: the grid, each looping over tiles
  cudaStream_t stream_ = nullptr;
  std::uint32_t* backpointers_ = nullptr;
  float* values_ = nullptr;  // kValueEntries (SearchParams::values)
  float* targets_ = nullptr;
  std::uint8_t* symbols_ = nullptr;
  std::int64_t capacity_ = 0;  // tiles the buffers hold
};

}  // namespace

absl::StatusOr<std::unique_ptr<quant::TrellisTileSearch>> MakeCudaTrellisTileSearch(int device) {
  int count = 0;
  NQ_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count));
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(absl::StrCat("trellis search: no CUDA device ", device, " (", count, " present)"));
  }
  int major = 0;
  NQ_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (major < 9) {
    return absl::FailedPreconditionError(
        absl::StrCat("trellis search: CUDA device ", device, " is compute capability ", major,
                     ".x; the search needs thread-block clusters (9.0, Hopper)"));
  }
  NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  NQ_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(TrellisSearchKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(kCostBytes)));
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(kClusterBlocks);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = kCostBytes;
  int clusters = 0;
  NQ_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveClusters(&clusters, TrellisSearchKernel, &config));
  if (clusters < 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("trellis search: CUDA device ", device, " cannot run a cluster of ", kClusterBlocks,
                     " blocks with ", kCostBytes, " bytes of shared memory each"));
  }
  auto search = std::make_unique<CudaTrellisTileSearch>(device, clusters);
  RETURN_IF_ERROR(search->Init());
  return search;
}

}  // namespace nq::kernels::cuda
