// h(y) of the trellis search's fp16 arithmetic (trellis_viterbi.h): y rounded to the nearest
// IEEE binary16 value, ties to even, |y| >= 65520 to +-inf, the sign kept, NaN kept a NaN;
// returned as the float that holds that value exactly. One form per instruction set the search
// runs on (scalar, SSE2, F16C); they agree on every float (tests/quant/trellis_half_test.cc
// checks them against the compiler's _Float16 conversion; a one-off run over all 2^32 floats,
// NaNs compared as NaNs, found no difference). The SSE2 and scalar forms assume the default rounding
// mode (nearest even), which nothing in the encoder changes. Below them, narrower helpers for the
// search's hot loop, each with its domain: binary16 bit patterns to and from floats (SSE2; F16C
// converts in one instruction) and h of a difference (SSE2, AVX2), all tested in the same file.
#pragma once

#include "kernels/dtype.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace nq::quant::trellis {

// The scalar form: kernels/dtype.h's conversion there and back.
inline float RoundHalf(float y) { return kernels::ToFloat(kernels::ToF16(y)); }

#if defined(__SSE2__)
// Four lanes in SSE2 (x86-64's baseline has no conversion to binary16). For y in binade
// [2^e, 2^(e+1)) (in magnitude), c = 2^(e+13) has a float ulp of 2^(e-10), binary16's step in
// that binade, so with c given y's sign, (y + c) - c rounds y to binary16's grid, ties to even,
// and the subtraction is exact. e is clamped below at -14 (c = 2^-1, ulp 2^-24: the subnormal
// grid) and above at 15, so |y| >= 65520 rounds to 2^16 or more, which the scaling by 2^112
// (float overflows at 2^128) and back by 2^-112 (exact for everything smaller) sends to inf.
// NaN and inf pass through every step unchanged.
inline __m128 RoundHalfSse2(__m128 y) {
  const __m128 kSignBit = _mm_castsi128_ps(_mm_set1_epi32(static_cast<int>(0x80000000u)));
  const __m128 kExponentBits = _mm_castsi128_ps(_mm_set1_epi32(0x7F800000));
  const __m128 kMinNormal = _mm_set1_ps(0x1p-14f);
  const __m128 kTopBinade = _mm_set1_ps(0x1p15f);
  const __m128 kBinadeToStepScale = _mm_set1_ps(0x1p13f);  // 2^e -> 2^(e+13), exact
  const __m128 kToFloatOverflow = _mm_set1_ps(0x1p112f);   // 2^16 -> 2^128, past float's range
  const __m128 kBack = _mm_set1_ps(0x1p-112f);

  const __m128 sign = _mm_and_ps(y, kSignBit);
  const __m128 binade = _mm_min_ps(_mm_max_ps(_mm_and_ps(y, kExponentBits), kMinNormal), kTopBinade);
  const __m128 c = _mm_or_ps(_mm_mul_ps(binade, kBinadeToStepScale), sign);
  const __m128 rounded = _mm_sub_ps(_mm_add_ps(y, c), c);
  // x - x is +0: a negative y that rounds to zero gets its sign back.
  return _mm_or_ps(_mm_mul_ps(_mm_mul_ps(rounded, kToFloatOverflow), kBack), sign);
}

// Binary16 bit patterns to and from floats in SSE2, for values never negative and never NaN (the
// search's costs; trellis_viterbi.cc keeps them as patterns). F16C does both in one instruction.

// The floats that four patterns (one in the low 16 bits of each 32-bit lane, the rest 0) stand
// for, exactly. Normals and inf: the pattern shifted into float's exponent and mantissa fields,
// the exponent rebiased from 15 to 127 (inf's all-ones exponent twice, to float's all-ones);
// subnormals and 0: the mantissa times binary16's least step, 2^-24.
inline __m128 HalfBitsToFloatSse2(__m128i bits) {
  const __m128i kRebias = _mm_set1_epi32((127 - 15) << 23);
  const __m128i kInfBits = _mm_set1_epi32(0x7C00);
  const __m128i kMinNormalBits = _mm_set1_epi32(0x0400);
  const __m128 kSubnormalStep = _mm_set1_ps(0x1p-24f);

  const __m128i rebias = _mm_add_epi32(kRebias, _mm_and_si128(_mm_cmpeq_epi32(bits, kInfBits), kRebias));
  const __m128 normal = _mm_castsi128_ps(_mm_add_epi32(_mm_slli_epi32(bits, 13), rebias));
  const __m128 subnormal = _mm_mul_ps(_mm_cvtepi32_ps(bits), kSubnormalStep);
  const __m128 is_subnormal = _mm_castsi128_ps(_mm_cmplt_epi32(bits, kMinNormalBits));
  return _mm_or_ps(_mm_and_ps(is_subnormal, subnormal), _mm_andnot_ps(is_subnormal, normal));
}

// h(y) as a pattern, for y >= 0 (not NaN), in each 32-bit lane; patterns above 0x7C00 (y >= 65536)
// are left for PackHalfBitsSse2 to clamp to inf. F. Giesen's float_to_half_fast3_rtne (as
// kernels/dtype.h's ToF16): from 2^-14 up, rebias the exponent and round the mantissa to 10 bits
// (ties to even; a carry steps the exponent, as rounding up into the next binade should, and
// 65520 carries to 0x7C00); below, adding 2^-1 rounds y to binary16's subnormal step 2^-24 (float's
// step in [2^-1, 1)), leaving the pattern in the low bits.
inline __m128i FloatToHalfBitsSse2(__m128 y) {
  const __m128i kMinNormal = _mm_set1_epi32((127 - 14) << 23);  // 2^-14
  const __m128i kRebiasAndHalfUlp = _mm_set1_epi32(0xFFF - ((127 - 15) << 23));
  const __m128 kSubnormalMagic = _mm_set1_ps(0x1p-1f);
  const __m128i one = _mm_set1_epi32(1);

  const __m128i u = _mm_castps_si128(y);
  const __m128i odd = _mm_and_si128(_mm_srli_epi32(u, 13), one);
  const __m128i normal = _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(u, kRebiasAndHalfUlp), odd), 13);
  const __m128i subnormal = _mm_sub_epi32(_mm_castps_si128(_mm_add_ps(y, kSubnormalMagic)),
                                          _mm_castps_si128(kSubnormalMagic));
  const __m128i is_subnormal = _mm_cmplt_epi32(u, kMinNormal);
  return _mm_or_si128(_mm_and_si128(is_subnormal, subnormal), _mm_andnot_si128(is_subnormal, normal));
}

// h of eight floats >= 0 (not NaN) as eight patterns: FloatToHalfBitsSse2, packed to 16 bits with
// signed saturation and clamped at inf (both leave every pattern up to 0x7C00 as it is).
inline __m128i PackHalfBitsSse2(__m128 lo, __m128 hi) {
  const __m128i packed = _mm_packs_epi32(FloatToHalfBitsSse2(lo), FloatToHalfBitsSse2(hi));
  return _mm_min_epi16(packed, _mm_set1_epi16(0x7C00));
}
#endif

// h(y) for y the float difference of two binary16 values, not NaN (the search's d = xh - vh, xh
// finite), by rounding y's bits: add just under half of binary16's step (bit 13 of float's
// mantissa) and the lowest kept bit, so that ties go to even, then clear the 13 bits below it; a
// carry steps the exponent, as rounding up into the next binade should. That is h(y) for
// 2^-14 <= |y| < 65520. Below 2^-14 the difference is exact and a multiple of 2^-24 (as both values
// are), so binary16 holds it as it is, and so does this rounding (it keeps 11 significant bits; y
// has at most 10). From 65520 up, where h(y) is +-inf, this gives +-2^16 or more, or +-inf: each of
// which squares to inf in binary16, the only use the search makes of d. Five integer instructions
// where F16C takes two conversions, the search's bottleneck.
#if defined(__SSE2__)
inline __m128 RoundDifferenceSse2(__m128 y) {
  const __m128i u = _mm_castps_si128(y);
  const __m128i odd = _mm_and_si128(_mm_srli_epi32(u, 13), _mm_set1_epi32(1));
  const __m128i up = _mm_add_epi32(_mm_add_epi32(u, _mm_set1_epi32(0xFFF)), odd);
  return _mm_castsi128_ps(_mm_and_si128(up, _mm_set1_epi32(~0x1FFF)));
}
#endif

#if defined(__x86_64__)
// Eight lanes through F16C's conversions (callers check CpuHasAvx2F16c).
__attribute__((target("avx2,f16c"))) inline __m256 RoundHalfF16c(__m256 y) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// RoundDifferenceSse2 in eight lanes.
__attribute__((target("avx2,f16c"))) inline __m256 RoundDifferenceAvx2(__m256 y) {
  const __m256i u = _mm256_castps_si256(y);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 13), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0xFFF)), odd);
  return _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(~0x1FFF)));
}
#endif

}  // namespace nq::quant::trellis
