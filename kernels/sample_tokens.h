// Next-token sampling where the logits are (Backend::SampleTokens): greedy, temperature, top-k
// and top-p over one row of logits, so a GPU decode step hands the host one token id instead of
// a vocabulary of logits (issue #13). The worker's Sampler (services/worker/sampler.h) keeps the
// requests this does not cover: logit_bias, penalties, log-probabilities and speculative
// verification.
//
// The distribution is the Sampler's: weights exp((l - max) / T) over the finite logits, ids
// ordered by descending logit (ties: lower id first), top-k keeps the first k of that order,
// top-p the shortest prefix of it (within top-k) whose weight reaches top_p of the whole row's,
// and the draw walks the kept ids in that order to the uniform point u01 * (their weight).
// Two things differ, both so that the CUDA kernel and the host reference (SampleRowHost) give
// the same id bit for bit whatever the order they sum in:
//  - a weight is an integer, exp((l - max) / T) in units of 2^-40 (SampleWeight: one float
//    polynomial with explicit fused multiply-adds, which every IEEE host and the GPU round the
//    same way); an id 2^-40 less likely than the best one is never drawn;
//  - sums of weights are exact (64-bit integers), so every cut and the draw are exact.
// The Sampler's doubles pick the same id but where u lands within about 1e-6 of a boundary.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>

#include "kernels/dtype.h"

namespace nq::kernels {

// One row's sampling, in the layout the backends read it from memory (a captured decode step
// reads it from device memory that the host rewrites before each replay).
struct SampleParams {
  double u01 = 0;            // the draw's uniform point in [0, 1); unused when greedy
  float temperature = 0;     // 0: greedy (the largest finite logit, ties: the lower id)
  float top_p = 1;           // (0, 1]
  std::int32_t top_k = 0;    // 0: off
  std::int32_t reserved = 0;
};
static_assert(sizeof(SampleParams) == 24);

// The id written for a row without a finite logit.
inline constexpr std::int32_t kNoFiniteLogit = -1;

// Fixed point of the weights: 1.0 (the largest logit's weight) is 2^40.
inline constexpr int kSampleWeightBits = 40;

// The logit's place in the descending order as an unsigned key: a larger finite logit has a
// larger key (IEEE order), every non-finite logit has key 0, below all finite ones.
NQ_HOST_DEVICE std::uint32_t SampleKey(float logit) {
  const std::uint32_t bits = FloatToBits(logit);
  if ((bits & 0x7f800000u) == 0x7f800000u) return 0;  // inf, nan
  return (bits & 0x80000000u) != 0 ? ~bits : bits | 0x80000000u;
}

// Rounded products and fused multiply-adds that no compiler contracts further (nvcc fuses a
// product into a following add unless told not to), so host and GPU round every step alike.
NQ_HOST_DEVICE float SampleFma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
NQ_HOST_DEVICE float SampleMul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return std::fma(a, b, 0.0f);  // the rounded product (a call is never fused with what follows)
#endif
}

// exp((logit - max_logit) * inv_temperature) in units of 2^-40, for a finite logit <= max_logit
// (the largest logit weighs 2^40 exactly). 2^t with t = x log2(e) split into rint(t) + f,
// |f| <= 1/2, and 2^f by its Taylor polynomial (degree 7: relative error below 1e-8 on
// [-1/2, 1/2]) in explicit fused multiply-adds; the scaling by 2^(40 + rint(t)) and the
// truncation to an integer are exact in double.
NQ_HOST_DEVICE std::uint64_t SampleWeight(float logit, float max_logit, float inv_temperature) {
  if (logit >= max_logit) return std::uint64_t{1} << kSampleWeightBits;
  const float x = SampleMul(logit - max_logit, inv_temperature);
  const float t = SampleMul(x, 1.44269504088896341f);
  if (!(t > -64.0f)) return 0;  // below 2^-64 of the best: nothing in 2^-40 units
  const float n = rintf(t);
  const float f = t - n;  // exact
  // (ln 2)^k / k!, k = 7 .. 0.
  float p = 1.5252733804059840e-05f;
  p = SampleFma(p, f, 1.5403530393381609e-04f);
  p = SampleFma(p, f, 1.3333558146428443e-03f);
  p = SampleFma(p, f, 9.6181291076284772e-03f);
  p = SampleFma(p, f, 5.5504108664821580e-02f);
  p = SampleFma(p, f, 2.4022650695910071e-01f);
  p = SampleFma(p, f, 6.9314718055994531e-01f);
  p = SampleFma(p, f, 1.0f);
  const int exponent = kSampleWeightBits + static_cast<int>(n);
  if (exponent < -1) return 0;  // p < 2: below one unit
  return static_cast<std::uint64_t>(ldexp(static_cast<double>(p), exponent));
}

// The uniform point of a draw over `total` units of weight (total > 0): floor(u01 * total),
// at most total - 1.
NQ_HOST_DEVICE std::uint64_t SampleDrawPoint(double u01, std::uint64_t total) {
  const double scaled = floor(u01 * static_cast<double>(total));
  if (!(scaled > 0)) return 0;  // NaN too (a CUDA kernel cannot refuse it)
  if (scaled >= static_cast<double>(total)) return total - 1;
  const std::uint64_t point = static_cast<std::uint64_t>(scaled);
  return point < total ? point : total - 1;
}

// The top-p cut's point: the kept prefix is the shortest whose weight exceeds this
// (ceil(top_p * total) - 1, the last unit short of top_p of the row). top_p <= 1.
NQ_HOST_DEVICE std::uint64_t SampleTopPPoint(float top_p, std::uint64_t total) {
  const double target = ceil(static_cast<double>(top_p) * static_cast<double>(total));
  if (!(target > 1)) return 0;
  if (target >= static_cast<double>(total)) return total - 1;
  return static_cast<std::uint64_t>(target) - 1;
}

// InvalidArgument-style message for parameters outside their ranges, or empty when they are
// valid: temperature finite and >= 0, top_p in (0, 1], top_k >= 0, u01 in [0, 1).
const char* SampleParamsError(const SampleParams& p);

// The id SampleParams picks from one row of logits, or kNoFiniteLogit: the CPU backend's op and
// the CUDA kernel's twin (the same radix descent over the logit keys, kernels/cuda/sample_tokens.cu,
// pass for pass), O(vocabulary) per selection.
std::int32_t SampleRowHost(std::span<const float> logits, const SampleParams& p);
// The same id by the definition: the whole row sorted, then the cuts and the draw walked in order
// (O(V log V); the tests' reference for SampleRowHost).
std::int32_t SampleRowBySort(std::span<const float> logits, const SampleParams& p);

}  // namespace nq::kernels
