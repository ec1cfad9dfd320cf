// Rotary embedding in place on x[tokens, heads, dim] (contract in kernels/backend.h). One thread
// per rotated pair, grid-stride. The angle is HF's: the fp32 product inv_freq[i] * float(position)
// (__fmul_rn, so it is never fused into anything), then full-precision sincosf and the yarn
// attention_scaling in fp32, the same values as the CPU backend and HF's float32 rotary tables.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/launch_dependent.cuh"

namespace nq::kernels::cuda {

struct RopeParams {
  float* x = nullptr;               // [tokens, heads, dim], rotated in place
  const float* inv_freq = nullptr;  // [dim / 2], device
  std::int64_t tokens = 0;
  int heads = 0;
  int dim = 0;     // the head stride
  int rotary = 0;  // even, <= dim: the leading `rotary` elements of each head rotate
  std::int64_t start_pos = 0;
  // When set, the position of token 0 is read from here when the kernel runs (a captured step
  // graph; kernels/step_position.h) and start_pos is only its bound.
  const std::int32_t* position = nullptr;
  float attention_scaling = 1.0f;
};

// Contract: dim even, heads * dim / 2 < 2^31, start_pos + tokens fits int64.
// interleaved: pairs (x[2i], x[2i+1]); otherwise (x[i], x[i + rotary/2]).
absl::Status LaunchRope(const RopeParams& params, bool interleaved, const LaunchContext& ctx);

inline constexpr int kRopeThreads = 256;

template <bool kInterleaved>
__global__ void __launch_bounds__(kRopeThreads) RopeKernel(const __grid_constant__ RopeParams p) {
  StartAsProgrammaticDependent();
  const int half = p.rotary / 2;
  const std::int64_t pairs_per_token = std::int64_t{p.heads} * half;
  const std::int64_t total = p.tokens * pairs_per_token;
  const std::int64_t start = p.position != nullptr ? std::int64_t{*p.position} : p.start_pos;
  for (std::int64_t pair = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; pair < total;
       pair += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t t = pair / pairs_per_token;
    const std::int64_t in_token = pair - t * pairs_per_token;
    const std::int64_t head = in_token / half;
    const int i = static_cast<int>(in_token - head * half);
    const float position = static_cast<float>(start + t);
    const float angle = __fmul_rn(__ldg(p.inv_freq + i), position);
    float sine;
    float cosine;
    sincosf(angle, &sine, &cosine);
    cosine = __fmul_rn(cosine, p.attention_scaling);
    sine = __fmul_rn(sine, p.attention_scaling);
    float* x = p.x + (t * p.heads + head) * p.dim;
    float* re = kInterleaved ? x + 2 * i : x + i;
    float* im = kInterleaved ? x + 2 * i + 1 : x + i + half;
    const float a = *re;
    const float b = *im;
    *re = a * cosine - b * sine;
    *im = b * cosine + a * sine;
  }
}

}  // namespace nq::kernels::cuda
