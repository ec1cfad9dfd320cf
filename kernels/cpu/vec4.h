// Four-float vectors for the CPU backend's fp32 kernels (GCC/Clang vector extensions: SSE or
// NEON width on every target), so the hot loops vectorise at -O2 without -ffast-math. Float
// sums are never reassociated by the compiler: every order is written out here, so a kernel's
// result does not depend on the compiler's mood or on how many rows share a call.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/dtype.h"

namespace nq::kernels::cpu {

using Vec4 = float __attribute__((vector_size(16)));

inline Vec4 Load4(const float* p) {
  Vec4 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Four bf16 widened to fp32 (exact: bf16 is the top half of an fp32).
inline Vec4 Load4(const Bf16* p) {
  using Half4 = std::uint16_t __attribute__((vector_size(8)));
  using Bits4 = std::uint32_t __attribute__((vector_size(16)));
  Half4 h;
  std::memcpy(&h, p, sizeof(h));
  const Bits4 bits = __builtin_convertvector(h, Bits4) << 16;
  Vec4 v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

// Any other element type, widened one by one.
template <typename T>
inline Vec4 Load4(const T* p) {
  return Vec4{ToFloat(p[0]), ToFloat(p[1]), ToFloat(p[2]), ToFloat(p[3])};
}

inline void Store4(float* p, Vec4 v) { std::memcpy(p, &v, sizeof(v)); }

inline float Sum4(Vec4 v) { return (v[0] + v[1]) + (v[2] + v[3]); }

// sum_i a[i] * b[i]: two 4-float partial sums over blocks of 8, added together, then the tail
// in order. b may be any float dtype (widened while loading).
template <typename T>
inline float Dot(const float* a, const T* b, std::int64_t n) {
  Vec4 s0 = {}, s1 = {};
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    s0 += Load4(a + i) * Load4(b + i);
    s1 += Load4(a + i + 4) * Load4(b + i + 4);
  }
  float sum = Sum4(s0 + s1);
  for (; i < n; ++i) sum += a[i] * ToFloat(b[i]);
  return sum;
}

// y[i] += a * x[i]; x may be any float dtype. Elementwise, so no order to fix.
template <typename T>
inline void Axpy(float a, const T* x, float* y, std::int64_t n) {
  const Vec4 av = {a, a, a, a};
  std::int64_t i = 0;
  for (; i + 4 <= n; i += 4) Store4(y + i, Load4(y + i) + av * Load4(x + i));
  for (; i < n; ++i) y[i] += a * ToFloat(x[i]);
}

}  // namespace nq::kernels::cpu
