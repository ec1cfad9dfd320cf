// Branch-free float exp and softplus for jF's forward (jf_model.cc), written so that a loop
// over a float array calling them vectorizes at -O2 (no libm call, no data-dependent branch):
// glibc's expf and log1pf are scalar calls, and softplus alone was a third of a refresh at
// GLM-5 scale. tests/streamer/jf_math_test.cc holds them to the bounds below against libm.
//
// ExpClamped(x) = e^x for x in [kJfExpMin, 0], relative error below 3e-7; below kJfExpMin
// it returns e^kJfExpMin (about 1.2e-38, the smallest normal float's neighbourhood) instead of
// a denormal or 0. Only for x <= 0 (both callers: logits minus their maximum, and -|x|): one
// clamp. The loops calling these vectorize only with -fno-trapping-math (services/streamer/
// CMakeLists.txt sets it for jf_model.cc). Cephes' expf: x = k ln2 + r, |r| <= ln2 / 2, e^r by its degree-6
// polynomial, 2^k by writing the exponent bits.
//
// Softplus(x) = log(1 + e^x) = max(x, 0) + log1p(e^-|x|), relative error below 1e-6 for every
// finite x (for x far below 0 it is e^x, never a rounded 0 while e^x is a normal float).
// log1p(t) for t in (0, 1] is 2 atanh(s), s = t / (2 + t) in (0, 1/3], by atanh's series to
// s^13 (the next term is below 2e-8 of the sum).
#pragma once

#include <bit>
#include <cstdint>

namespace nq::streamer {

inline constexpr float kJfExpMin = -87.33654f;  // ln(2^-126), the smallest normal float

inline float ExpClamped(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  // Cephes' split of ln 2: kLn2Hi has few mantissa bits, so k * kLn2Hi is exact.
  constexpr float kLn2Hi = 0.693359375f;
  constexpr float kLn2Lo = -2.12194440e-4f;
  // 1.5 * 2^23: adding it rounds a float of magnitude below 2^22 to an integer (round to
  // nearest even), which its low mantissa bits then hold.
  constexpr float kRound = 12582912.0f;
  // A value select, not std::max (a reference: control flow the vectorizer refuses).
  x = x > kJfExpMin ? x : kJfExpMin;
  const float shifted = x * kLog2e + kRound;
  const float k = shifted - kRound;
  float r = x - k * kLn2Hi;
  r = r - k * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  // k in [-126, 0]: 2^k is a normal float with biased exponent k + 127.
  const int32_t exponent = std::bit_cast<int32_t>(shifted) - std::bit_cast<int32_t>(kRound) + 127;
  return p * std::bit_cast<float>(exponent << 23);
}

inline float Softplus(float x) {
  // |x| and -|x| by the sign bit, max(x, 0) = x / 2 + |x| / 2 (exact): no selects.
  const float abs_x = std::bit_cast<float>(std::bit_cast<uint32_t>(x) & 0x7fffffffu);
  const float t = ExpClamped(-abs_x);  // e^-|x| in (0, 1]
  const float s = t / (2.0f + t);
  const float s2 = s * s;
  float series = 1.0f / 13.0f;
  series = series * s2 + 1.0f / 11.0f;
  series = series * s2 + 1.0f / 9.0f;
  series = series * s2 + 1.0f / 7.0f;
  series = series * s2 + 1.0f / 5.0f;
  series = series * s2 + 1.0f / 3.0f;
  series = series * s2 + 1.0f;
  return (0.5f * x + 0.5f * abs_x) + 2.0f * s * series;
}

}  // namespace nq::streamer
