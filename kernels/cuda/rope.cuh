// Rotary embedding in place on x[tokens, heads, dim] (contract in kernels/backend.h), for up to
// kMaxRopeLaunchTargets tensors at the same positions in one launch (the query's MLA rope part and
// the DSA indexer's queries, each in its own pair layout). One thread per rotated pair, grid-stride
// over each tensor in turn. The angle is HF's: the fp32 product inv_freq[i] * float(position)
// (__fmul_rn, so it is never fused into anything), then full-precision sincosf and the yarn
// attention_scaling in fp32, the same values as the CPU backend and HF's float32 rotary tables.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"

namespace nq::kernels::cuda {

inline constexpr int kMaxRopeLaunchTargets = 4;

struct RopeTargetParams {
  float* x = nullptr;  // [tokens, heads, dim], rotated in place
  int heads = 0;
  int dim = 0;  // the head stride
  // Pairs (x[2i], x[2i+1]); otherwise (x[i], x[i + rotary/2]).
  bool interleaved = false;
};

struct RopeParams {
  RopeTargetParams targets[kMaxRopeLaunchTargets];
  int target_count = 0;
  const float* inv_freq = nullptr;  // [rotary / 2], device
  std::int64_t tokens = 0;          // of every target
  int rotary = 0;  // even, <= every target's dim: the leading `rotary` elements of each head rotate
  std::int64_t start_pos = 0;
  // When set, the position of token 0 is read from here when the kernel runs (a captured step
  // graph; kernels/step_position.h) and start_pos is only its bound.
  const std::int32_t* position = nullptr;
  float attention_scaling = 1.0f;
};

// Contract: 1 to kMaxRopeLaunchTargets targets, no two sharing memory; every dim even and at least
// rotary, heads * dim / 2 < 2^31, start_pos + tokens fits int64.
absl::Status LaunchRope(const RopeParams& params, const LaunchContext& ctx);

}  // namespace nq::kernels::cuda
