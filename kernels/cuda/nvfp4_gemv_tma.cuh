// The NVFP4 expert GEMV with its codes copied into shared memory by the tensor memory
// accelerator (TMA), for the shapes every real model has (nvfp4_gemv.cuh states the contract,
// the layout and why the decode is exact; the register kernel in nvfp4_gemv.cu takes the rest).
//
// Why: the register kernel keeps three steps (3 KB) of codes in flight per warp and ncu puts its
// largest stall on the first use of each code word: the loads arrive late, so it is bound by the
// bytes a warp keeps in flight, not by its instructions (bench/README.md, "The NVFP4 expert
// GEMV"). A per-warp ring filled by per-lane cp.async copies added that depth but paid for it in
// copy instructions. Here one lane of each warp asks for a whole stage (16 rows x 2 or 4 steps of
// codes and their block scales) with two or three TMA instructions, a ring of such stages per
// warp keeps 4-10 KB in flight, and the decode reads its operands from shared memory with the
// same count of loads it issued to global memory before.
#pragma once

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/nvfp4_gemv.cuh"

namespace nq::kernels::cuda {

// Ring shapes built for measurement; kAdaptive is the default (bench/README.md).
enum class Nvfp4TmaRing {
  kTma23,       // stages of 2 steps, 3 stages a warp, 2 blocks of 8 warps an SM
  kTma23Three,  // the same, 3 blocks an SM
  kTma42,       // 4 steps, 2 stages
  kAdaptive,    // per chunk from its plan: 4-step stages for few distinct experts, else 2-step
};

// Whether the TMA kernel takes g with this ring: the device has TMA (compute capability 9 or
// later), every 16-row tile is whole stages (cols a multiple of the stage's columns), and the
// code and scale arrays are 16-byte aligned (the tensor maps' requirement).
bool Nvfp4GemvTmaApplies(const Nvfp4GemvParams& g, Nvfp4TmaRing ring);

// Same contract as LaunchNvfp4Gemv; InvalidArgument where Nvfp4GemvTmaApplies is false.
absl::Status LaunchNvfp4GemvTma(const Nvfp4GemvParams& g, Nvfp4TmaRing ring, const LaunchContext& ctx);

}  // namespace nq::kernels::cuda
