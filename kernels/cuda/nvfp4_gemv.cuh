// The NVFP4 expert GEMV of the decode path (kernels/nvfp4_moe.h, nvfp4_moe.cuh): every row of one
// projection of every distinct expert of a chunk of at most kNvfp4MaxDecodeTokens tokens, the
// packed E2M1 codes and E4M3 block scales decoded in registers straight into tensor-core
// fragments, each expert's codes read once however many of the chunk's tokens route to it.
//
// Two kernels behind one launch: where the width is a multiple of 256 and the arrays are 16-byte
// aligned (every real model), the codes reach shared memory through the TMA
// (nvfp4_gemv_tma.cuh); elsewhere each warp streams them into registers (nvfp4_gemv.cu). Both
// decode a warp step the same way (nvfp4_gemv_step.cuh).
//
// Why tensor cores for a GEMV: an m16n8k16 MMA takes 256 weights in one instruction and
// accumulates in fp32, so the per-weight work is the decode alone (shifts, masks, one prmt per
// pair and the block scale's multiply), and up to eight tokens (the MMA's n = 8 columns) cost
// what one does.
//
// Why the decode is exact: a code decodes to its value times 2^-14 (an fp16 bit pattern built
// with shifts and masks, nvfp4_fragment.h) and is multiplied by the block scale times 2^7; E2M1 x
// E4M3 has at most 6 significant bits, so the product (in [2^-17, 21]) is exact in fp16; the only
// roundings are the fp16 inputs (the activation vector, 2^-11 relative) and the fp32
// accumulation. The global scale times 2^7 is applied in fp32 to each row's sum.
//
// Layout (its lane-level pieces are the host/device functions of nvfp4_fragment.h, which a host
// emulation of the warp step tests): lane 4g + j of a warp reads, per step, 16 bytes (32
// elements, two 16-element blocks) of rows g and g + 8 of its 16-row tile at columns
// [128 s + 32 j, 128 s + 32 j + 32), and the two E4M3 scales of those blocks. Because the block
// scale multiplies each weight before the MMA, the MMA's k order is free: the decode pairs the
// elements of a word as (0, 2), (4, 6), (1, 3), (5, 7) (cheapest for shifts and masks), the
// activation vector is stored in that order within each group of 8, and a lane's B fragments
// are still one 16-byte load.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/nvfp4_moe.cuh"
#include "kernels/nvfp4_moe_params.h"

namespace nq::kernels::cuda {

struct Nvfp4GemvParams {
  const std::int32_t* expert_ids = nullptr;  // [assignments]: the chunk's [T, K] ids
  int assignments = 0;                       // T * K
  int top_k = 0;
  int num_experts = 0;
  Nvfp4ProjectionView w;  // rows x cols per expert
  int rows = 0;
  int cols = 0;  // multiple of kNvfp4LaneCols
  // Input vectors, fp16, `cols` each, every aligned group of 8 inputs stored in the decode's pair
  // order (element e at (c & ~7) + nvfp4::Nvfp4InputPosition(e)): assignment a reads vector
  // a / top_k (the token: gate/up) when x_per_token, else vector a (its own: down).
  const __half* x = nullptr;
  bool x_per_token = true;
  // out[a * out_stride + row] += the row's dot product; zeroed by the kernel before (at most two
  // additions onto zero per output, so the sum does not depend on timing).
  float* out = nullptr;
  std::int64_t out_stride = 0;
};

// One launch, every row of every distinct expert of the chunk. Launched as a programmatic
// dependent of the kernel before it (which writes x and zeroes out): it loads weights before it
// waits for that kernel, which therefore must not write them (the kernels before that one have
// completed: each waits for its own predecessor before it lets a dependent start). Stream-ordered,
// no allocation, capturable. InvalidArgument for a chunk or shape it does not take.
absl::Status LaunchNvfp4Gemv(const Nvfp4GemvParams& g, const LaunchContext& ctx);

}  // namespace nq::kernels::cuda
