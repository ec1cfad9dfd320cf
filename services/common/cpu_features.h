// What the host CPU can run, asked once per process: the code paths that have an AVX2 build beside
// their portable one (the jF predictor's forward, the trellis search's steps) choose by it.
// Header-only, so libraries that link nothing of services/common can use it.
#pragma once

#if defined(__x86_64__)
#include <cpuid.h>
#endif

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
// F16C is asked of CPUID (leaf 1, ECX bit 29) directly: clang 14's __builtin_cpu_supports does not
// know "f16c" (the fuzzers build with it).
inline bool CpuHasAvx2F16c() {
#if defined(__x86_64__)
  static const bool avx2_f16c = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return __builtin_cpu_supports("avx2") && __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
  }();
  return avx2_f16c;
#else
  return false;
#endif
}

}  // namespace nq
