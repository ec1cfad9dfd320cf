#include "services/quant/trellis_viterbi.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/dtype.h"
#include "services/common/cpu_features.h"
#include "services/quant/trellis_half.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace nq::quant::trellis {
namespace {

// The search runs the trellis in left-shift form, s^L_t = ((s^L_{t-1} << 2) | c_t) & 0xFFFF
// (the same symbols as trellis_decode.h's right-shift state, bit pairs reversed): the
// predecessors of s' are g | j << 14 for g = s' >> 2 ("group"), j = 0..3.
//
// Layout: at step t (counted from the start of a run) the cost of state s sits at position
// rotr16(s, 2t). With g and j as above, the four predecessors of group g and its four
// successors g << 2 | c then occupy the same four positions rotr16(g | k << 14, 2t), which
// differ only in the two bits at b = (14 - 2t) mod 16: a step is an in-place min-of-four
// and update over position quadruples p0 + k * 2^b. For b >= 4 these are runs of 16 or more
// contiguous costs per partner; every eighth step the layout is back to natural order.
//
// Costs are kept as binary16 bit patterns. The contract's costs are never negative and never
// NaN, so their patterns order as their values (+inf, 0x7C00, above every finite one): the
// four-way minima, the normalisation's minimum and the end rules compare 16-bit integers, and
// only each group's least is widened to a float, for the additions. The rest is float operations
// each followed by h (trellis_half.h), which gives the binary16 operation's result exactly
// (trellis_viterbi.h says why); a new cost's last rounding is its conversion to a pattern.
constexpr uint32_t kGroups = kStateCount >> kSymbolBits;  // 16384
constexpr int kSymbols = 1 << kSymbolBits;
constexpr int kLayouts = kStateBits / kSymbolBits;  // 8: the layout's period in steps
constexpr uint16_t kZeroCost = 0x0000;              // binary16 +0
constexpr uint16_t kUnreachable = 0x7C00;           // binary16 +inf
// The contract's normalising steps: t % kNormalisePeriod == kNormalisePhase (as the period
// equals kLayouts, always partner bit 12; the steps take any, though).
constexpr int kNormalisePeriod = 8;
constexpr int kNormalisePhase = 1;

constexpr uint32_t Rotr16(uint32_t v, int r) {
  r &= 15;
  return ((v >> r) | (v << ((16 - r) & 15))) & kStateMask;
}
constexpr uint32_t Rotl16(uint32_t v, int r) { return Rotr16(v, 16 - (r & 15)); }

// Left-shift state to trellis_decode.h's right-shift state: reverse the eight bit pairs.
constexpr uint32_t LeftToRight(uint32_t s) {
  uint32_t out = 0;
  for (int k = 0; k < kStateSpan; ++k) out |= ((s >> (2 * k)) & 3u) << (2 * (kStateSpan - 1 - k));
  return out;
}

// Partner bit of step t's layout, and the 14-bit backpointer index of a quadruple's p0.
constexpr int PartnerBit(int t) { return (kStateBits - kSymbolBits - kSymbolBits * t) & 15; }
constexpr uint32_t QuadIndex(uint32_t p0, int b) {
  return (p0 & ((1u << b) - 1u)) | ((p0 >> (b + kSymbolBits)) << b);
}

}  // namespace

TileSearcher::TileSearcher(std::span<const float> values, Isa isa)
    : isa_(isa),
      values_(values.begin(), values.end()),
      layout_values_(static_cast<size_t>(kLayouts) * kStateCount),
      cost_(kStateCount),
      backpointers_(static_cast<size_t>(kTileWeights) * kGroups) {
  // Step t writes the successor s' = rotl16(p, 2t + 2) at position p; the steps read vh.
  for (int t = 0; t < kLayouts; ++t) {
    float* v = layout_values_.data() + static_cast<size_t>(t) * kStateCount;
    for (uint32_t p = 0; p < kStateCount; ++p) v[p] = RoundHalf(values_[LeftToRight(Rotl16(p, 2 * t + 2))]);
  }
}

namespace {

// One step's operands: the rounded target, the normalisation (floor: r_t, used when normalise),
// the values vh of the step's layout by position, the costs (patterns, updated in place) and the
// step's backpointers (by QuadIndex).
struct StepParams {
  float xh;
  bool normalise;
  float floor;
  const float* values;
  uint16_t* cost;
  uint8_t* bp;
};

// Every step below visits the quadruples of partner bit b = log2(stride): the four rows of a
// run of them start at cost + k * stride, and their groups' backpointers are consecutive.
// Partner bits are even, so strides are 1, 4, 16 or more. The steps take StepParams by value: a
// copy of their own, which the backpointer stores (uint8_t may alias anything) cannot change, so
// GCC keeps its fields in registers instead of reloading them every vector.

#if !defined(__SSE2__)
// The contract's step, one group at a time (builds without SSE2; the x86-64 steps below are
// the same eight or sixteen groups a vector).
void StepScalar(const StepParams p, size_t stride) {
  for (size_t hi = 0; hi < kStateCount; hi += 4 * stride) {
    uint16_t* c = p.cost + hi;
    const float* v = p.values + hi;
    uint8_t* bp = p.bp + (hi >> kSymbolBits);
    for (size_t lo = 0; lo < stride; ++lo) {
      uint16_t* const row[4] = {c + lo, c + stride + lo, c + 2 * stride + lo, c + 3 * stride + lo};
      const uint16_t a0 = *row[0], a1 = *row[1], a2 = *row[2], a3 = *row[3];
      const bool b01 = a1 < a0;
      const uint16_t m01 = b01 ? a1 : a0;
      const bool b23 = a3 < a2;
      const uint16_t m23 = b23 ? a3 : a2;
      const bool high = m23 < m01;
      bp[lo] = static_cast<uint8_t>(high ? 2 + b23 : b01);
      float least = kernels::ToFloat(kernels::F16{high ? m23 : m01});
      if (p.normalise) least = RoundHalf(least - p.floor);
      for (size_t k = 0; k < 4; ++k) {
        const float d = RoundHalf(p.xh - v[lo + k * stride]);
        *row[k] = kernels::ToF16(least + RoundHalf(d * d)).bits;
      }
    }
  }
}
#endif

#if defined(__SSE2__)
inline __m128i LoadCosts(const uint16_t* c) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(c)); }
inline void StoreCosts(uint16_t* c, __m128i v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(c), v); }

// The least of four predecessor costs and its index, eight groups a vector, with the contract's
// comparisons. Patterns stay below 0x8000, so SSE2's signed 16-bit compares and minimum order
// them as their values.
struct LeastOfFour {
  __m128i least;
  __m128i index;
};
inline LeastOfFour Least(__m128i a0, __m128i a1, __m128i a2, __m128i a3) {
  const __m128i b01 = _mm_cmpgt_epi16(a0, a1);  // a1 < a0
  const __m128i b23 = _mm_cmpgt_epi16(a2, a3);  // a3 < a2
  const __m128i m01 = _mm_min_epi16(a0, a1);
  const __m128i m23 = _mm_min_epi16(a2, a3);
  const __m128i high = _mm_cmpgt_epi16(m01, m23);  // m23 < m01
  // Masks are 0 or -1, so j = (high ? 2 : 0) - (high ? b23 : b01).
  const __m128i low_bit = _mm_or_si128(_mm_and_si128(high, b23), _mm_andnot_si128(high, b01));
  return {_mm_min_epi16(m01, m23), _mm_sub_epi16(_mm_and_si128(high, _mm_set1_epi16(2)), low_bit)};
}

// Eight groups' indices as eight bytes.
inline void StoreIndices(__m128i j, uint8_t* out) {
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(j, j));
}

// Eight groups' least costs as floats, as the step uses them: h(least - floor) on a normalising
// step. lo: groups 0-3, hi: groups 4-7.
struct LeastFloats {
  __m128 lo;
  __m128 hi;
};
inline __m128 Normalised(__m128 least, const StepParams& p) {
  return p.normalise ? RoundHalfSse2(_mm_sub_ps(least, _mm_set1_ps(p.floor))) : least;
}
inline LeastFloats Widen(__m128i least, const StepParams& p) {
  const __m128i zero = _mm_setzero_si128();
  return {Normalised(HalfBitsToFloatSse2(_mm_unpacklo_epi16(least, zero)), p),
          Normalised(HalfBitsToFloatSse2(_mm_unpackhi_epi16(least, zero)), p)};
}

// least + h(d * d) with d = h(xh - value): a new cost before its last rounding. (d's rounding
// differs from h only where both square to inf; trellis_half.h.)
inline __m128 CostSum(__m128 least, __m128 xh, __m128 value) {
  const __m128 d = RoundDifferenceSse2(_mm_sub_ps(xh, value));
  return _mm_add_ps(least, RoundHalfSse2(_mm_mul_ps(d, d)));
}

// The new costs of eight consecutive positions as patterns: values at v, their groups' leasts
// in lo (first four) and hi (last four). The packing is the last rounding.
inline __m128i NextCosts(__m128 lo, __m128 hi, __m128 xh, const float* v) {
  return PackHalfBitsSse2(CostSum(lo, xh, _mm_loadu_ps(v)), CostSum(hi, xh, _mm_loadu_ps(v + 4)));
}

// Stride 16 or more: a quadruple row's runs give eight groups a vector as they lie.
void StepRows(const StepParams p, size_t stride) {
  const __m128 xv = _mm_set1_ps(p.xh);
  for (size_t hi = 0; hi < kStateCount; hi += 4 * stride) {
    uint16_t* c = p.cost + hi;
    const float* v = p.values + hi;
    uint8_t* bp = p.bp + (hi >> kSymbolBits);
    for (size_t lo = 0; lo < stride; lo += 8) {
      const LeastOfFour m = Least(LoadCosts(c + lo), LoadCosts(c + stride + lo), LoadCosts(c + 2 * stride + lo),
                                  LoadCosts(c + 3 * stride + lo));
      StoreIndices(m.index, bp + lo);
      const LeastFloats least = Widen(m.least, p);
      for (size_t k = 0; k < 4; ++k) {
        StoreCosts(c + k * stride + lo, NextCosts(least.lo, least.hi, xv, v + k * stride + lo));
      }
    }
  }
}

// Stride 4: a quadruple is 16 positions (row k of its group lo at 4k + lo), so a vector of
// eight groups takes 64-bit quarters of two quadruples' rows. The new costs go by position:
// along a quadruple its four leasts repeat.
void StepQuads(const StepParams p) {
  const __m128 xv = _mm_set1_ps(p.xh);
  for (size_t pos = 0; pos < kStateCount; pos += 32) {
    uint16_t* c = p.cost + pos;
    const __m128i q0_rows01 = LoadCosts(c), q0_rows23 = LoadCosts(c + 8);
    const __m128i q1_rows01 = LoadCosts(c + 16), q1_rows23 = LoadCosts(c + 24);
    const LeastOfFour m = Least(_mm_unpacklo_epi64(q0_rows01, q1_rows01), _mm_unpackhi_epi64(q0_rows01, q1_rows01),
                                _mm_unpacklo_epi64(q0_rows23, q1_rows23), _mm_unpackhi_epi64(q0_rows23, q1_rows23));
    StoreIndices(m.index, p.bp + (pos >> kSymbolBits));
    const LeastFloats least = Widen(m.least, p);  // lo: quadruple 0's groups, hi: quadruple 1's
    const float* v = p.values + pos;
    for (size_t r = 0; r < 4; ++r) {
      const __m128 l = r < 2 ? least.lo : least.hi;
      StoreCosts(c + 8 * r, NextCosts(l, l, xv, v + 8 * r));
    }
  }
}

template <int kLane>
inline __m128 Broadcast(__m128 v) {
  return _mm_shuffle_ps(v, v, _MM_SHUFFLE(kLane, kLane, kLane, kLane));
}

// Stride 1: a group's four costs are adjacent (position 4g + k). Eight groups' 32 costs are
// transposed into one vector per predecessor (three rounds of interleaving); the new costs go by
// position, each group's least repeated over its four.
void StepAdjacent(const StepParams p) {
  const __m128 xv = _mm_set1_ps(p.xh);
  for (size_t pos = 0; pos < kStateCount; pos += 32) {
    uint16_t* c = p.cost + pos;
    const __m128i r0 = LoadCosts(c), r1 = LoadCosts(c + 8), r2 = LoadCosts(c + 16), r3 = LoadCosts(c + 24);
    const __m128i u0 = _mm_unpacklo_epi16(r0, r1), u1 = _mm_unpackhi_epi16(r0, r1);  // groups 0, 2 and 1, 3
    const __m128i u2 = _mm_unpacklo_epi16(r2, r3), u3 = _mm_unpackhi_epi16(r2, r3);  // groups 4, 6 and 5, 7
    const __m128i w0 = _mm_unpacklo_epi16(u0, u1), w1 = _mm_unpackhi_epi16(u0, u1);  // a0 a1, a2 a3 of 0-3
    const __m128i w2 = _mm_unpacklo_epi16(u2, u3), w3 = _mm_unpackhi_epi16(u2, u3);  // a0 a1, a2 a3 of 4-7
    const LeastOfFour m = Least(_mm_unpacklo_epi64(w0, w2), _mm_unpackhi_epi64(w0, w2), _mm_unpacklo_epi64(w1, w3),
                                _mm_unpackhi_epi64(w1, w3));
    StoreIndices(m.index, p.bp + (pos >> kSymbolBits));
    const LeastFloats least = Widen(m.least, p);
    const float* v = p.values + pos;
    StoreCosts(c, NextCosts(Broadcast<0>(least.lo), Broadcast<1>(least.lo), xv, v));
    StoreCosts(c + 8, NextCosts(Broadcast<2>(least.lo), Broadcast<3>(least.lo), xv, v + 8));
    StoreCosts(c + 16, NextCosts(Broadcast<0>(least.hi), Broadcast<1>(least.hi), xv, v + 16));
    StoreCosts(c + 24, NextCosts(Broadcast<2>(least.hi), Broadcast<3>(least.hi), xv, v + 24));
  }
}
#endif

#if defined(__x86_64__)
// The steps again, sixteen groups a vector (AVX2 + F16C, chosen at run time): the same
// comparisons on the patterns and the same float operations (no FMA), each rounded alike: d by
// the same integer rounding, the rest by F16C's conversions where SSE2 converts in software. So
// both give the same costs and indices.
constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

__attribute__((target("avx2,f16c"))) inline __m256i LoadCostsWide(const uint16_t* c) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
}

struct LeastOfFourWide {
  __m256i least;
  __m256i index;
};
__attribute__((target("avx2,f16c"))) inline LeastOfFourWide LeastWide(__m256i a0, __m256i a1, __m256i a2,
                                                                        __m256i a3) {
  const __m256i b01 = _mm256_cmpgt_epi16(a0, a1);  // a1 < a0
  const __m256i b23 = _mm256_cmpgt_epi16(a2, a3);  // a3 < a2
  const __m256i m01 = _mm256_min_epu16(a0, a1);
  const __m256i m23 = _mm256_min_epu16(a2, a3);
  const __m256i high = _mm256_cmpgt_epi16(m01, m23);  // m23 < m01
  const __m256i low_bit = _mm256_blendv_epi8(b01, b23, high);
  return {_mm256_min_epu16(m01, m23), _mm256_sub_epi16(_mm256_and_si256(high, _mm256_set1_epi16(2)), low_bit)};
}

// Sixteen groups' indices as sixteen bytes.
__attribute__((target("avx2,f16c"))) inline void StoreIndicesWide(__m256i j, uint8_t* out) {
  const __m128i bytes = _mm_packus_epi16(_mm256_castsi256_si128(j), _mm256_extracti128_si256(j, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), bytes);
}

// Sixteen groups' least costs as floats, as the step uses them. lo: groups 0-7, hi: 8-15.
struct LeastFloatsWide {
  __m256 lo;
  __m256 hi;
};
__attribute__((target("avx2,f16c"))) inline __m256 NormalisedWide(__m256 least, const StepParams& p) {
  return p.normalise ? RoundHalfF16c(_mm256_sub_ps(least, _mm256_set1_ps(p.floor))) : least;
}
__attribute__((target("avx2,f16c"))) inline LeastFloatsWide WidenWide(__m256i least, const StepParams& p) {
  return {NormalisedWide(_mm256_cvtph_ps(_mm256_castsi256_si128(least)), p),
          NormalisedWide(_mm256_cvtph_ps(_mm256_extracti128_si256(least, 1)), p)};
}

// The new costs of eight consecutive positions, stored as patterns: values at v, their groups'
// leasts in `least`. As CostSum; the conversion to binary16 is the last rounding.
__attribute__((target("avx2,f16c"))) inline void StoreNextCostsWide(uint16_t* c, __m256 least, __m256 xh,
                                                                      const float* v) {
  const __m256 d = RoundDifferenceAvx2(_mm256_sub_ps(xh, _mm256_loadu_ps(v)));
  const __m256 sum = _mm256_add_ps(least, RoundHalfF16c(_mm256_mul_ps(d, d)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(c), _mm256_cvtps_ph(sum, kNearest));
}

// Stride 16 or more, as StepRows.
__attribute__((target("avx2,f16c"))) void StepRowsWide(const StepParams p, size_t stride) {
  const __m256 xv = _mm256_set1_ps(p.xh);
  for (size_t hi = 0; hi < kStateCount; hi += 4 * stride) {
    uint16_t* c = p.cost + hi;
    const float* v = p.values + hi;
    uint8_t* bp = p.bp + (hi >> kSymbolBits);
    for (size_t lo = 0; lo < stride; lo += 16) {
      const LeastOfFourWide m = LeastWide(LoadCostsWide(c + lo), LoadCostsWide(c + stride + lo),
                                          LoadCostsWide(c + 2 * stride + lo), LoadCostsWide(c + 3 * stride + lo));
      StoreIndicesWide(m.index, bp + lo);
      const LeastFloatsWide least = WidenWide(m.least, p);
      for (size_t k = 0; k < 4; ++k) {
        StoreNextCostsWide(c + k * stride + lo, least.lo, xv, v + k * stride + lo);
        StoreNextCostsWide(c + k * stride + lo + 8, least.hi, xv, v + k * stride + lo + 8);
      }
    }
  }
}

// Stride 4, as StepQuads: four quadruples a vector, their rows' 64-bit quarters transposed.
__attribute__((target("avx2,f16c"))) void StepQuadsWide(const StepParams p) {
  const __m256 xv = _mm256_set1_ps(p.xh);
  for (size_t pos = 0; pos < kStateCount; pos += 64) {
    uint16_t* c = p.cost + pos;
    const __m256i q0 = LoadCostsWide(c), q1 = LoadCostsWide(c + 16);  // rows 0-3 of quadruple 0, 1
    const __m256i q2 = LoadCostsWide(c + 32), q3 = LoadCostsWide(c + 48);
    const __m256i t0 = _mm256_unpacklo_epi64(q0, q1), t1 = _mm256_unpackhi_epi64(q0, q1);  // rows 0 | 2, 1 | 3
    const __m256i t2 = _mm256_unpacklo_epi64(q2, q3), t3 = _mm256_unpackhi_epi64(q2, q3);
    const LeastOfFourWide m =
        LeastWide(_mm256_permute2x128_si256(t0, t2, 0x20), _mm256_permute2x128_si256(t1, t3, 0x20),
                  _mm256_permute2x128_si256(t0, t2, 0x31), _mm256_permute2x128_si256(t1, t3, 0x31));
    StoreIndicesWide(m.index, p.bp + (pos >> kSymbolBits));
    const LeastFloatsWide least = WidenWide(m.least, p);  // lo: quadruples 0, 1; hi: 2, 3
    const float* v = p.values + pos;
    for (size_t q = 0; q < 4; ++q) {
      const __m256 pair = q < 2 ? least.lo : least.hi;
      // The quadruple's four leasts in both halves, for its rows 0, 1 and then 2, 3.
      const __m256 l = q % 2 == 0 ? _mm256_permute2f128_ps(pair, pair, 0x00) : _mm256_permute2f128_ps(pair, pair, 0x11);
      StoreNextCostsWide(c + 16 * q, l, xv, v + 16 * q);
      StoreNextCostsWide(c + 16 * q + 8, l, xv, v + 16 * q + 8);
    }
  }
}

// Sixteen groups in the order 0 1 4 5 8 9 12 13 | 2 3 6 7 10 11 14 15 (32-bit pairs) to 0-15.
__attribute__((target("avx2,f16c"))) inline __m256i InGroupOrder(__m256i a) {
  return _mm256_permutevar8x32_epi32(a, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// Stride 1, as StepAdjacent: sixteen groups' 64 costs, transposed within 128-bit halves as
// StepAdjacent transposes, which leaves the groups in InGroupOrder's order.
__attribute__((target("avx2,f16c"))) void StepAdjacentWide(const StepParams p) {
  const __m256 xv = _mm256_set1_ps(p.xh);
  for (size_t pos = 0; pos < kStateCount; pos += 64) {
    uint16_t* c = p.cost + pos;
    const __m256i r0 = LoadCostsWide(c), r1 = LoadCostsWide(c + 16);  // groups 0-3, 4-7
    const __m256i r2 = LoadCostsWide(c + 32), r3 = LoadCostsWide(c + 48);
    const __m256i u0 = _mm256_unpacklo_epi16(r0, r1), u1 = _mm256_unpackhi_epi16(r0, r1);
    const __m256i u2 = _mm256_unpacklo_epi16(r2, r3), u3 = _mm256_unpackhi_epi16(r2, r3);
    const __m256i w0 = _mm256_unpacklo_epi16(u0, u1), w1 = _mm256_unpackhi_epi16(u0, u1);
    const __m256i w2 = _mm256_unpacklo_epi16(u2, u3), w3 = _mm256_unpackhi_epi16(u2, u3);
    const LeastOfFourWide m =
        LeastWide(InGroupOrder(_mm256_unpacklo_epi64(w0, w2)), InGroupOrder(_mm256_unpackhi_epi64(w0, w2)),
                  InGroupOrder(_mm256_unpacklo_epi64(w1, w3)), InGroupOrder(_mm256_unpackhi_epi64(w1, w3)));
    StoreIndicesWide(m.index, p.bp + (pos >> kSymbolBits));
    const LeastFloatsWide least = WidenWide(m.least, p);
    const float* v = p.values + pos;
    for (size_t r = 0; r < 8; ++r) {
      // Positions 8r .. 8r + 7: groups 2r and 2r + 1, each least four times.
      const int g = static_cast<int>(2 * r % 8);
      const __m256i spread = _mm256_setr_epi32(g, g, g, g, g + 1, g + 1, g + 1, g + 1);
      StoreNextCostsWide(c + 8 * r, _mm256_permutevar8x32_ps(r < 4 ? least.lo : least.hi, spread), xv, v + 8 * r);
    }
  }
}
#endif

}  // namespace

void TileSearcher::Step(int t, float xh, bool normalise, float floor, uint8_t* bp) {
  const uint32_t stride = 1u << PartnerBit(t);
  const StepParams p{xh, normalise, floor, layout_values_.data() + static_cast<size_t>(t % kLayouts) * kStateCount,
                     cost_.data(), bp};
#if defined(__x86_64__)
  if (isa_ == Isa::kBest && CpuHasAvx2F16c()) {
    if (stride >= 16) {
      StepRowsWide(p, stride);
    } else if (stride == 4) {
      StepQuadsWide(p);
    } else {
      StepAdjacentWide(p);
    }
    return;
  }
#endif
#if defined(__SSE2__)
  if (stride >= 16) {
    StepRows(p, stride);
  } else if (stride == 4) {
    StepQuads(p);
  } else {
    StepAdjacent(p);
  }
#else
  StepScalar(p, stride);
#endif
}

float TileSearcher::LeastCost() const {
  // Patterns order as costs do (above), so the least pattern is the least cost's.
  uint16_t least = kUnreachable;
#if defined(__SSE2__)
  // Four vectors of eight (GCC leaves the plain loop scalar); signed minima, as in Least.
  __m128i m[4] = {_mm_set1_epi16(kUnreachable), _mm_set1_epi16(kUnreachable), _mm_set1_epi16(kUnreachable),
                  _mm_set1_epi16(kUnreachable)};
  for (uint32_t p = 0; p < kStateCount; p += 32) {
    for (int k = 0; k < 4; ++k) m[k] = _mm_min_epi16(m[k], LoadCosts(cost_.data() + p + 8 * k));
  }
  uint16_t lanes[8];
  StoreCosts(lanes, _mm_min_epi16(_mm_min_epi16(m[0], m[1]), _mm_min_epi16(m[2], m[3])));
  least = *std::min_element(lanes, lanes + 8);
#else
  for (const uint16_t c : cost_) least = std::min(least, c);
#endif
  return kernels::ToFloat(kernels::F16{least});
}

void TileSearcher::Run(const float* x, int steps) {
  for (int t = 0; t < steps; ++t) {
    const bool normalise = t % kNormalisePeriod == kNormalisePhase;
    Step(t, RoundHalf(std::fmin(std::fmax(x[t], -kTargetLimit), kTargetLimit)), normalise,
         normalise ? LeastCost() : 0.0f, backpointers_.data() + static_cast<size_t>(t) * kGroups);
  }
}

void TileSearcher::Trace(uint32_t state, int steps, uint8_t* symbols) const {
  for (int t = steps - 1; t >= 0; --t) {
    symbols[t] = static_cast<uint8_t>(state & (kSymbols - 1));
    const uint32_t group = state >> kSymbolBits;
    const int b = PartnerBit(t);
    const uint32_t p0 = Rotr16(group, kSymbolBits * t);
    const uint32_t j = backpointers_[static_cast<size_t>(t) * kGroups + QuadIndex(p0, b)];
    state = group | (j << (kStateBits - kSymbolBits));
  }
}

double TileSearcher::Search(const float* x, uint8_t* symbols, float* decoded) {
  static_assert(kProbeSteps % kLayouts == 0 && kTileWeights % kLayouts == 0,
                "runs must end in the natural layout");
  // Probe: the kProbeSteps targets around the seam, in ring order, from a free start.
  float probe_x[kProbeSteps];
  for (int k = 0; k < kProbeSteps; ++k) {
    probe_x[k] = x[(kTileWeights - kProbeSteps / 2 + k) % kTileWeights];
  }
  std::fill(cost_.begin(), cost_.end(), kZeroCost);
  Run(probe_x, kProbeSteps);
  const uint32_t probe_end =
      static_cast<uint32_t>(std::min_element(cost_.begin(), cost_.end()) - cost_.begin());
  uint8_t probe_symbols[kProbeSteps];
  Trace(probe_end, kProbeSteps, probe_symbols);
  // The seven symbols before the seam (ring positions 249..255) are the low 14 bits of both
  // s^L_{-1} and s^L_255 (newest symbol lowest).
  uint32_t overlap = 0;
  for (int k = 0; k < kStateSpan - 1; ++k) {
    overlap = (overlap << kSymbolBits) | probe_symbols[kProbeSteps / 2 - (kStateSpan - 1) + k];
  }

  // Full ring: s_{-1} is any state carrying the overlap (its top symbol never reaches s_0),
  // and s_255 must carry it too.
  std::fill(cost_.begin(), cost_.end(), kUnreachable);
  for (uint32_t j = 0; j < static_cast<uint32_t>(kSymbols); ++j) cost_[overlap | (j << 14)] = kZeroCost;
  Run(x, kTileWeights);
  uint32_t end = overlap;
  for (uint32_t j = 1; j < static_cast<uint32_t>(kSymbols); ++j) {
    if (cost_[overlap | (j << 14)] < cost_[end]) end = overlap | (j << 14);
  }
  Trace(end, kTileWeights, symbols);

  return DecodeRing(values_, x, symbols, decoded);
}

const std::vector<float>& UnitValues() {
  static const std::vector<float>* values = [] {
    auto* v = new std::vector<float>(kStateCount);
    for (uint32_t s = 0; s < kStateCount; ++s) (*v)[s] = UnitValue(s);
    return v;
  }();
  return *values;
}

double DecodeRing(std::span<const float> values, const float* x, const uint8_t* symbols, float* decoded) {
  // Decode from the ring itself (trellis_decode.h's right-shift state) and measure.
  double err = 0.0;
  uint32_t state = 0;
  for (int k = 0; k < kStateSpan; ++k) {
    state = (state >> kSymbolBits) |
            (static_cast<uint32_t>(symbols[kTileWeights - kStateSpan + k]) << (kStateBits - kSymbolBits));
  }
  for (int t = 0; t < kTileWeights; ++t) {
    state = (state >> kSymbolBits) | (static_cast<uint32_t>(symbols[t]) << (kStateBits - kSymbolBits));
    decoded[t] = values[state];
    const double d = static_cast<double>(x[t]) - decoded[t];
    err += d * d;
  }
  return err;
}

}  // namespace nq::quant::trellis
