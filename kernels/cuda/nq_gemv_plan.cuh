// What both NestQuant decode GEMVs share (nq_moe_gemv.cu: the cp.async ring that runs trellis_v1
// and rows of partial steps; nq_gemv_batched.cu: register batches for nested_scalar_v1 at whole
// steps): the block's plan of the chunk's distinct experts, the warp's MMA of one code word, and
// the grid's shape.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/cuda/nq_code_lookup.cuh"
#include "kernels/cuda/nq_moe.cuh"
#include "kernels/cuda/nq_moe_gemv.cuh"
#include "kernels/cuda/reduce.cuh"
#include "kernels/nq_moe.h"

namespace nq::kernels::cuda::nq_gemv {

inline constexpr int kMmaRows = 16;
inline constexpr int kWarps = 8;
inline constexpr int kThreads = kWarps * kWarpSize;
inline constexpr int kWordsPerLane = 4;  // a lane's words of a row per step (16 bytes)
inline constexpr int kRows = 2;          // a lane's rows: g and g + 8 of its 16-row tile
// Two blocks of 8 warps per SM: 128 registers a thread (the 4-bit lookup's tables, the batches).
inline constexpr int kBlocksPerSm = 2;

// The chunk's distinct experts, worked out once per block (shared memory: no initialisers).
struct Unit {
  int expert;
  int slot;  // >= 0: runs at 4 bits, its residual in this slot
  int n_tok;
  int tok_a[kNqMaxDecodeTokens];  // the assignment of each of its tokens
  std::uint32_t lut[2][8];        // per projection: the level table's bytes (nq_code_lookup.cuh)
  // Per projection at 2 bits: the base levels' even-grid step (decoded without lookups and
  // applied with the row scale), or 0 (lut holds the 4 base levels).
  float even_step[2];
  // Per projection at 4 bits: the step of uniform nested levels (UniformNestedStep), which the
  // register-slot GEMV decodes without lookups, or 0. lut holds the 16 levels either way (the
  // cp.async ring kernel always looks them up).
  float uniform4_step[2];
};

// Units [0, units2) run at 2 bits, [units2, units) at 4: a warp of the batched GEMV streams one
// width only, so its register batches have one size.
struct Plan {
  int units;
  int units2;
  Unit unit[kNqMaxDecodeAssignments];
};

__device__ __forceinline__ void Mma16816(float (&d)[4], const __half2& a0, const __half2& a1, const __half2& a2,
                                         const __half2& a3, std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(*reinterpret_cast<const std::uint32_t*>(&a0)), "r"(*reinterpret_cast<const std::uint32_t*>(&a1)),
        "r"(*reinterpret_cast<const std::uint32_t*>(&a2)), "r"(*reinterpret_cast<const std::uint32_t*>(&a3)),
        "r"(b0), "r"(b1));
}

__device__ __forceinline__ std::uint32_t Word(const uint4& v, int q) {
  return q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w;
}

// Independent accumulators: two alternate, so consecutive MMAs do not wait on each other (four
// measured no faster: the GEMV is not bound by the MMAs' latency).
inline constexpr int kAccumulators = 2;

// The four MMAs of one word position: pairs p and p + 4 of rows g (lo) and g + 8 (hi) are the A
// fragment, the word's input pairs p and p + 4 the B fragment (adjacent in the lane's two 16-byte
// input loads, NqGemvInputIndex).
__device__ __forceinline__ void MmaWord(float (&acc)[kAccumulators][4], const __half2 (&lo)[kPairsPerWord],
                                        const __half2 (&hi)[kPairsPerWord], const uint4& x0, const uint4& x1) {
  Mma16816(acc[0], lo[0], hi[0], lo[4], hi[4], x0.x, x0.y);
  Mma16816(acc[1], lo[1], hi[1], lo[5], hi[5], x0.z, x0.w);
  Mma16816(acc[0], lo[2], hi[2], lo[6], hi[6], x1.x, x1.y);
  Mma16816(acc[1], lo[3], hi[3], lo[7], hi[7], x1.z, x1.w);
}

// The plan: the chunk's distinct experts in order of their first assignment, those at 2 bits
// first. Warp 0 builds it; every thread of the block calls this (it ends on a barrier).
__device__ __forceinline__ void BuildPlan(const NqGemvParams& g, Plan& plan, int* ids) {
  const int A = static_cast<int>(g.p.tokens * g.p.top_k);
  const int lane = threadIdx.x % kWarpSize;
  if (threadIdx.x < A) ids[threadIdx.x] = g.p.expert_ids[threadIdx.x];
  __syncthreads();
  if (threadIdx.x < kWarpSize) {
    static_assert(kNqMaxDecodeAssignments <= 2 * kWarpSize, "two assignments a lane");
    bool mine[2];
    int slot[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int a = lane + kWarpSize * h;
      const int e = a < A ? ids[a] : -1;
      mine[h] = e >= 0 && e < g.p.num_experts;
      for (int b = 0; b < a && mine[h]; ++b) mine[h] = ids[b] != e;
      slot[h] = mine[h] ? g.p.slot_of_expert[e] : -1;
      if (g.p.arena == nullptr || slot[h] >= g.p.num_slots) slot[h] = -1;  // 2 bits
    }
    // Ballots per width and half: a unit's index is its rank among its width's units.
    const unsigned two_lo = __ballot_sync(0xffffffffu, mine[0] && slot[0] < 0);
    const unsigned two_hi = __ballot_sync(0xffffffffu, mine[1] && slot[1] < 0);
    const unsigned four_lo = __ballot_sync(0xffffffffu, mine[0] && slot[0] >= 0);
    const unsigned four_hi = __ballot_sync(0xffffffffu, mine[1] && slot[1] >= 0);
    const int units2 = __popc(two_lo) + __popc(two_hi);
    const unsigned below = (1u << lane) - 1u;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (!mine[h]) continue;
      const int a = lane + kWarpSize * h;
      const bool four = slot[h] >= 0;
      const unsigned lo = four ? four_lo : two_lo, hi = four ? four_hi : two_hi;
      const int u = (four ? units2 : 0) + (h == 0 ? __popc(lo & below) : __popc(lo) + __popc(hi & below));
      Unit& unit = plan.unit[u];
      unit.expert = ids[a];
      unit.slot = slot[h];
      int n = 0;
      for (int b = a; b < A && n < kNqMaxDecodeTokens; ++b) {
        if (ids[b] == unit.expert) unit.tok_a[n++] = b;
      }
      unit.n_tok = n;
      for (int j = 0; j < g.num_proj && g.p.codec == NqCodec::kNestedScalar; ++j) {
        const float* levels = g.proj[j].levels + static_cast<std::int64_t>(unit.expert) * kNqLevelTable;
        unit.even_step[j] = 0.0f;
        unit.uniform4_step[j] = 0.0f;
        if (unit.slot >= 0) {
          PackLevelBytes(levels + kNqBaseLevels, kNqLevels4, unit.lut[j], unit.lut[j] + 4);
          unit.uniform4_step[j] = UniformNestedStep(levels, levels + kNqBaseLevels);
        } else {
          unit.even_step[j] = EvenGridStep(levels);
          if (unit.even_step[j] == 0.0f) PackLevelBytes(levels, kNqBaseLevels, unit.lut[j], unit.lut[j] + 1);
        }
      }
    }
    if (lane == 0) {
      plan.units = units2 + __popc(four_lo) + __popc(four_hi);
      plan.units2 = units2;
    }
  }
  __syncthreads();
}

}  // namespace nq::kernels::cuda::nq_gemv
