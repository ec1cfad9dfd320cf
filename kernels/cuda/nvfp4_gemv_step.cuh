// What the NVFP4 expert GEMV's kernels share (nvfp4_gemv.cu: codes streamed into registers;
// nvfp4_gemv_tma.cu: codes copied into shared memory by the tensor memory accelerator): the
// chunk's plan of distinct experts and one warp step's decode and MMAs. Layout and exactness:
// nvfp4_gemv.cuh and nvfp4_fragment.h.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/cuda/nvfp4_fragment.h"
#include "kernels/cuda/nvfp4_gemv.cuh"
#include "kernels/cuda/reduce.cuh"

namespace nq::kernels::cuda::nvfp4_gemv {

constexpr int kMmaRows = 16;

// The chunk's distinct experts (units), worked out once per block in shared memory.
struct Unit {
  int expert;
  int n_tok;                                   // columns used: tokens routing to the expert
  std::uint8_t vec[kNvfp4MaxDecodeTokens];     // input vector of each column
  std::uint8_t out[kNvfp4MaxDecodeTokens];     // output row (assignment) of each column
};
// Bytes, not ints: the plan's shared memory comes out of the L1 that holds the chunk's inputs
// (3 KB instead of 9 KB a block).
static_assert(kNvfp4MaxAssignments <= 256, "vec and out hold assignment indices in a byte");

struct Plan {
  int units;
  int warp_units[kNvfp4MaxAssignments / kWarpSize];
  Unit unit[kNvfp4MaxAssignments];
};

// Two E4M3 codes (low byte: the first block) -> half2, exactly (every E4M3 value, NaN included,
// is an fp16 value). cvt puts the low byte's value in the low half.
__device__ __forceinline__ __half2 DecodeE4M3Pair(std::uint16_t codes) {
  std::uint32_t r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(codes));
  return *reinterpret_cast<const __half2*>(&r);
}


__device__ __forceinline__ void Mma16816(float (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ std::uint32_t Word(const uint4& v, int q) {
  return q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w;
}

__device__ __forceinline__ std::uint32_t HalfBits(__half2 h) { return *reinterpret_cast<const std::uint32_t*>(&h); }
__device__ __forceinline__ __half2 AsHalf2(std::uint32_t u) { return *reinterpret_cast<const __half2*>(&u); }

// Unit u is the u-th assignment (in order) whose expert no earlier assignment names; its columns
// are the assignments of that expert from there on. Every thread of the block calls this (it
// ends on a barrier); one thread per assignment (assignments <= kThreads).
__device__ __forceinline__ void BuildPlan(const Nvfp4GemvParams& g, Plan& plan, int* ids) {
  const int A = g.assignments, a = threadIdx.x, lane = a % kWarpSize, warp = a / kWarpSize;
  if (a < A) ids[a] = g.expert_ids[a];
  __syncthreads();
  const int e = a < A ? ids[a] : -1;
  bool first = e >= 0 && e < g.num_experts;
  for (int b = 0; b < a && first; ++b) first = ids[b] != e;
  const unsigned mask = warp < kNvfp4MaxAssignments / kWarpSize ? __ballot_sync(0xffffffffu, first) : 0u;
  if (lane == 0 && warp < kNvfp4MaxAssignments / kWarpSize) plan.warp_units[warp] = __popc(mask);
  __syncthreads();
  if (first) {
    int u = __popc(mask & ((1u << lane) - 1u));
    for (int w = 0; w < warp; ++w) u += plan.warp_units[w];
    Unit& unit = plan.unit[u];
    unit.expert = e;
    int n = 0;
    for (int b = a; b < A && n < kNvfp4MaxDecodeTokens; ++b) {
      if (ids[b] != e) continue;
      unit.vec[n] = static_cast<std::uint8_t>(g.x_per_token ? b / g.top_k : b);
      unit.out[n] = static_cast<std::uint8_t>(b);
      ++n;
    }
    unit.n_tok = n;
  }
  if (threadIdx.x == 0) {
    int units = 0;
    for (int w = 0; w < kNvfp4MaxAssignments / kWarpSize; ++w) units += plan.warp_units[w];
    plan.units = units;
  }
  __syncthreads();
}

// One warp step's loads: 16 code bytes of rows g and g + 8, and their two E4M3 block scales
// each (the low 16 bits of scales[h]). Kept apart until the step is decoded: merging the two
// rows' scales as they arrive made the loading code wait for them (ncu: the top stall).
struct StepData {
  uint4 codes[2];
  std::uint32_t scales[2];
};

// Decodes one warp step (d) and runs its MMAs into acc (sums times 2^-kScaleBias:
// nvfp4_fragment.h). xv: the lane's 32 inputs of the step, or nullptr for a lane past the row's
// end, which decodes zeros and must not read inputs (a zero weight times a NaN beyond the vector
// would poison its column).
__device__ __forceinline__ void DecodeStep(const StepData& d, const uint4* xv, float (&acc)[2][4]) {
  const __half2 scale_bias = __float2half2_rn(static_cast<float>(1 << nvfp4::kScaleBias));
  __half2 sc[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) sc[h] = __hmul2(DecodeE4M3Pair(static_cast<std::uint16_t>(d.scales[h])), scale_bias);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    std::uint32_t pairs[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      nvfp4::DecodeE2M1Word(Word(d.codes[h], q), pairs[h]);
      // Exact (nvfp4_fragment.h, kScaleBias).
      const __half2 scale = nvfp4::WordBlock(q) == 0 ? __low2half2(sc[h]) : __high2half2(sc[h]);
#pragma unroll
      for (int i = 0; i < 4; ++i) pairs[h][i] = HalfBits(__hmul2(AsHalf2(pairs[h][i]), scale));
    }
    const uint4 xq = xv != nullptr ? __ldg(xv + q) : make_uint4(0, 0, 0, 0);
    const std::uint32_t xs[4] = {xq.x, xq.y, xq.z, xq.w};
    std::uint32_t a[2][4], b[2][2];
    nvfp4::WordFragments(pairs[0], pairs[1], xs, a, b);
    Mma16816(acc[0], a[0], b[0]);
    Mma16816(acc[1], a[1], b[1]);
  }
}

}  // namespace nq::kernels::cuda::nvfp4_gemv
