#include "services/quant/trellis_viterbi.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "services/common/cpu_features.h"

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
// contiguous floats per partner, which GCC vectorises; every eighth step the layout is back
// to natural order.
constexpr uint32_t kGroups = kStateCount >> kSymbolBits;  // 16384
constexpr uint32_t kGroupMask = kGroups - 1u;
constexpr int kSymbols = 1 << kSymbolBits;
constexpr int kLayouts = kStateBits / kSymbolBits;  // 8: the layout's period in steps
constexpr float kUnreachable = std::numeric_limits<float>::infinity();

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
  // Step t writes the successor s' = rotl16(p, 2t + 2) at position p.
  for (int t = 0; t < kLayouts; ++t) {
    float* v = layout_values_.data() + static_cast<size_t>(t) * kStateCount;
    for (uint32_t p = 0; p < kStateCount; ++p) v[p] = values_[LeftToRight(Rotl16(p, 2 * t + 2))];
  }
}

namespace {

// A step's quadruples starting at position hi: group g = hi / 4 + lo has its four positions at
// c0 + lo .. c3 + lo (each row `stride` after the last), its successors' values at the same offsets
// from v0, and its backpointer at bp[lo].
struct QuadrupleRows {
  float* c0;
  float* c1;
  float* c2;
  float* c3;
  const float* v0;
  uint8_t* bp;
};
inline QuadrupleRows RowsAt(float* cost, const float* values, uint8_t* bp, uint32_t hi, uint32_t stride) {
  float* c0 = cost + hi;
  return {c0, c0 + stride, c0 + 2 * stride, c0 + 3 * stride, values + hi, bp + (hi >> kSymbolBits)};
}

#if defined(__SSE2__)
// The least of four predecessor costs and its index, four groups at a time, with the scalar
// code's comparisons (minps(a, b) is a < b ? a : b, so ties keep the lower index).
struct LeastOfFour {
  __m128 least;
  __m128i index;
};
inline LeastOfFour Least(__m128 a0, __m128 a1, __m128 a2, __m128 a3) {
  const __m128i one = _mm_set1_epi32(1);
  const __m128i j01 = _mm_and_si128(_mm_castps_si128(_mm_cmplt_ps(a1, a0)), one);
  const __m128i j23 = _mm_add_epi32(_mm_set1_epi32(2), _mm_and_si128(_mm_castps_si128(_mm_cmplt_ps(a3, a2)), one));
  const __m128 m01 = _mm_min_ps(a1, a0);
  const __m128 m23 = _mm_min_ps(a3, a2);
  const __m128i high = _mm_castps_si128(_mm_cmplt_ps(m23, m01));
  return {_mm_min_ps(m23, m01), _mm_or_si128(_mm_and_si128(high, j23), _mm_andnot_si128(high, j01))};
}

// Four groups' indices as four bytes.
inline void StoreIndices(__m128i j, uint8_t* out) {
  const int packed = _mm_cvtsi128_si32(_mm_packus_epi16(_mm_packs_epi32(j, j), _mm_setzero_si128()));
  std::memcpy(out, &packed, 4);
}

// least + (x - value)^2, each operation rounded on its own, as the scalar code's.
inline __m128 NextCost(__m128 least, __m128 x, __m128 value) {
  const __m128 d = _mm_sub_ps(x, value);
  return _mm_add_ps(least, _mm_mul_ps(d, d));
}

// The step of partner bit 0, where a group's four positions are adjacent: four groups (16
// floats) are transposed into one vector per predecessor, stepped as the other steps step four
// groups, and transposed back. Without it this step ran scalar and took about half the search.
void StepAdjacentGroups(float x, const float* values, float* cost, uint8_t* bp) {
  const __m128 xv = _mm_set1_ps(x);
  for (uint32_t p = 0; p < kStateCount; p += 16) {
    float* c = cost + p;
    const float* v = values + p;
    __m128 a0 = _mm_loadu_ps(c), a1 = _mm_loadu_ps(c + 4), a2 = _mm_loadu_ps(c + 8), a3 = _mm_loadu_ps(c + 12);
    _MM_TRANSPOSE4_PS(a0, a1, a2, a3);  // a_k: predecessor k of groups p/4 .. p/4 + 3
    const LeastOfFour m = Least(a0, a1, a2, a3);
    StoreIndices(m.index, bp + (p >> kSymbolBits));
    __m128 v0 = _mm_loadu_ps(v), v1 = _mm_loadu_ps(v + 4), v2 = _mm_loadu_ps(v + 8), v3 = _mm_loadu_ps(v + 12);
    _MM_TRANSPOSE4_PS(v0, v1, v2, v3);  // v_k: successor k's value of each group
    __m128 n0 = NextCost(m.least, xv, v0), n1 = NextCost(m.least, xv, v1);
    __m128 n2 = NextCost(m.least, xv, v2), n3 = NextCost(m.least, xv, v3);
    _MM_TRANSPOSE4_PS(n0, n1, n2, n3);
    _mm_storeu_ps(c, n0);
    _mm_storeu_ps(c + 4, n1);
    _mm_storeu_ps(c + 8, n2);
    _mm_storeu_ps(c + 12, n3);
  }
}
#endif

#if defined(__x86_64__)
// Eight lanes from two runs of four floats kGap apart (kGap 4: eight adjacent floats).
template <uint32_t kGap>
__attribute__((target("avx2"))) inline __m256 LoadWide(const float* p) {
  if constexpr (kGap == 4) return _mm256_loadu_ps(p);
  return _mm256_set_m128(_mm_loadu_ps(p + kGap), _mm_loadu_ps(p));
}
template <uint32_t kGap>
__attribute__((target("avx2"))) inline void StoreWide(float* p, __m256 v) {
  if constexpr (kGap == 4) {
    _mm256_storeu_ps(p, v);
  } else {
    _mm_storeu_ps(p, _mm256_castps256_ps128(v));
    _mm_storeu_ps(p + kGap, _mm256_extractf128_ps(v, 1));
  }
}

// The step of partner bit 2 or more, eight groups a vector (AVX2, chosen at run time). No FMA:
// every element's comparisons, products and sums are the SSE2 loop's, rounded the same, so both
// give the same costs and indices; only the width differs. At partner bit 2 (stride 4) a group
// quadruple spans 16 floats, so the eight groups of a vector are two quadruples' four, 16 apart
// (kGap 16; kGap 4 elsewhere).
template <uint32_t kGap>
__attribute__((target("avx2"))) void StepWide(float x, const float* values, float* cost, uint8_t* bp,
                                              uint32_t stride) {
  const __m256 xv = _mm256_set1_ps(x);
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i two = _mm256_set1_epi32(2);
  const uint32_t span = kGap == 4 ? 4 * stride : 32;  // positions a pass of the outer loop covers
  const uint32_t lanes = kGap == 4 ? stride : 4;      // groups along one quadruple's row
  for (uint32_t hi = 0; hi < kStateCount; hi += span) {
    const QuadrupleRows r = RowsAt(cost, values, bp, hi, stride);
    for (uint32_t lo = 0; lo < lanes; lo += 8) {
      const __m256 a0 = LoadWide<kGap>(r.c0 + lo), a1 = LoadWide<kGap>(r.c1 + lo);
      const __m256 a2 = LoadWide<kGap>(r.c2 + lo), a3 = LoadWide<kGap>(r.c3 + lo);
      const __m256i j01 = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(a1, a0, _CMP_LT_OQ)), one);
      const __m256i j23 =
          _mm256_add_epi32(two, _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(a3, a2, _CMP_LT_OQ)), one));
      const __m256 m01 = _mm256_min_ps(a1, a0);
      const __m256 m23 = _mm256_min_ps(a3, a2);
      const __m256i high = _mm256_castps_si256(_mm256_cmp_ps(m23, m01, _CMP_LT_OQ));
      const __m256 m = _mm256_min_ps(m23, m01);
      const __m256i j = _mm256_or_si256(_mm256_and_si256(high, j23), _mm256_andnot_si256(high, j01));
      const __m128i j16 = _mm_packs_epi32(_mm256_castsi256_si128(j), _mm256_extracti128_si256(j, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(r.bp + lo), _mm_packus_epi16(j16, j16));
      for (uint32_t k = 0; k < 4; ++k) {
        const __m256 d = _mm256_sub_ps(xv, LoadWide<kGap>(r.v0 + lo + k * stride));
        StoreWide<kGap>(r.c0 + lo + k * stride, _mm256_add_ps(m, _mm256_mul_ps(d, d)));
      }
    }
  }
}
#endif

}  // namespace

void TileSearcher::Step(int t, float x, uint8_t* bp) {
  const int b = PartnerBit(t);
  const uint32_t stride = 1u << b;
  float* cost = cost_.data();
  const float* v = layout_values_.data() + static_cast<size_t>(t % kLayouts) * kStateCount;
#if defined(__x86_64__)
  if (stride >= 4 && isa_ == Isa::kBest && CpuHasAvx2()) {
    if (stride >= 8) {
      StepWide<4>(x, v, cost, bp, stride);
    } else {
      StepWide<16>(x, v, cost, bp, stride);
    }
    return;
  }
#endif
#if defined(__SSE2__)
  if (b == 0) {
    StepAdjacentGroups(x, v, cost, bp);
    return;
  }
#endif
  for (uint32_t hi = 0; hi < kStateCount; hi += 4 * stride) {
    const auto [c0, c1, c2, c3, v0, bpo] = RowsAt(cost, v, bp, hi, stride);
    uint32_t lo = 0;
#if defined(__SSE2__)
    // Four groups per iteration; the same arithmetic as the scalar tail below.
    const __m128 xv = _mm_set1_ps(x);
    for (; lo + 4 <= stride; lo += 4) {
      const LeastOfFour m =
          Least(_mm_loadu_ps(c0 + lo), _mm_loadu_ps(c1 + lo), _mm_loadu_ps(c2 + lo), _mm_loadu_ps(c3 + lo));
      StoreIndices(m.index, bpo + lo);
      _mm_storeu_ps(c0 + lo, NextCost(m.least, xv, _mm_loadu_ps(v0 + lo)));
      _mm_storeu_ps(c1 + lo, NextCost(m.least, xv, _mm_loadu_ps(v0 + lo + stride)));
      _mm_storeu_ps(c2 + lo, NextCost(m.least, xv, _mm_loadu_ps(v0 + lo + 2 * stride)));
      _mm_storeu_ps(c3 + lo, NextCost(m.least, xv, _mm_loadu_ps(v0 + lo + 3 * stride)));
    }
#endif
    for (; lo < stride; ++lo) {
      const float a0 = c0[lo], a1 = c1[lo], a2 = c2[lo], a3 = c3[lo];
      const bool b01 = a1 < a0;
      const float m01 = b01 ? a1 : a0;
      const bool b23 = a3 < a2;
      const float m23 = b23 ? a3 : a2;
      const bool high = m23 < m01;
      const float m = high ? m23 : m01;
      bpo[lo] = static_cast<uint8_t>(high ? 2 + b23 : b01);
      const float d0 = x - v0[lo];
      const float d1 = x - v0[lo + stride];
      const float d2 = x - v0[lo + 2 * stride];
      const float d3 = x - v0[lo + 3 * stride];
      c0[lo] = m + d0 * d0;
      c1[lo] = m + d1 * d1;
      c2[lo] = m + d2 * d2;
      c3[lo] = m + d3 * d3;
    }
  }
}

void TileSearcher::Run(const float* x, int steps) {
  for (int t = 0; t < steps; ++t) Step(t, x[t], backpointers_.data() + static_cast<size_t>(t) * kGroups);
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
  std::fill(cost_.begin(), cost_.end(), 0.0f);
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
  for (uint32_t j = 0; j < static_cast<uint32_t>(kSymbols); ++j) cost_[overlap | (j << 14)] = 0.0f;
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
