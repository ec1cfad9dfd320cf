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
// warp keeps 5-9 KB in flight, and the decode reads its operands from shared memory with the
// same count of loads it issued to global memory before.
//
// The ring's shape is chosen per chunk from the plan each block builds (measured on an H100,
// bench/README.md, "A ring in shared memory filled by the TMA"): two stages of 4 steps stream best
// while a chunk has few distinct experts (one token, or tokens that share theirs), three stages of
// 2 steps once it has many. The wider ring takes a third more shared memory, out of the L1 cache
// that holds the chunk's input vectors; with the plan's token lists in bytes (3 KB a block) both
// fit for chunks of 8 tokens too, so one kernel serves every chunk.
#pragma once

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/nvfp4_gemv.cuh"

namespace nq::kernels::cuda {

// Whether the TMA kernel takes g: the device has TMA (compute capability 9 or later), every
// 16-row tile is whole 2-step stages (cols a multiple of 256), and the code and scale arrays are
// 16-byte aligned (the tensor maps' requirement).
bool Nvfp4GemvTmaApplies(const Nvfp4GemvParams& g);

// Same contract as LaunchNvfp4Gemv; InvalidArgument where Nvfp4GemvTmaApplies is false.
absl::Status LaunchNvfp4GemvTma(const Nvfp4GemvParams& g, const LaunchContext& ctx);

}  // namespace nq::kernels::cuda
