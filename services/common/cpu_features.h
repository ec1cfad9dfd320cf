// What the host CPU can run, asked once per process: the code paths that have an AVX2 build beside
// their portable one (the jF predictor's forward, the trellis search's steps) choose by it.
// Header-only, so libraries that link nothing of services/common can use it.
#pragma once

namespace nq {

inline bool CpuHasAvx2() {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  return avx2;
#else
  return false;
#endif
}

// AVX2 and F16C's binary16 conversions (the trellis search's fp16 steps). Every AVX2 CPU made so
// far has F16C, but nothing promises it, and a missing one would be an illegal instruction.
inline bool CpuHasAvx2F16c() {
#if defined(__x86_64__)
  static const bool avx2_f16c = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return avx2_f16c;
#else
  return false;
#endif
}

}  // namespace nq
