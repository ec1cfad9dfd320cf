#include "kernels/cuda/nvfp4_gemv.cuh"

#include "absl/strings/str_cat.h"
#include "kernels/cuda/launch_dependent.cuh"
#include "kernels/cuda/load.cuh"
#include "kernels/cuda/nvfp4_fragment.h"
#include "kernels/cuda/reduce.cuh"
#include "kernels/nvfp4_codes.h"
#include "services/common/status_macros.h"

namespace nq::kernels::cuda {
namespace {

constexpr int kMmaRows = 16;
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * kWarpSize;
constexpr int kBlocksPerSm = 2;
// Steps of code loads in flight per warp: the kernel keeps two batches of kDepth steps in
// registers and loads the next batch while it decodes the current one. (Loading a batch and then
// decoding it left the loads idle for the whole decode: 0.51 of copy bandwidth, first device
// run.) Three, not four: with the block scales in registers of their own, four steps spilled at
// the 128 registers of two blocks per SM and ran at the speed of the old kernel (84.8 us for the
// DeepSeek-V3 1-token GEMVs against 72.0 for three, same call; bench/README.md).
constexpr int kDepth = 3;

// The chunk's distinct experts (units), worked out once per block in shared memory.
struct Unit {
  int expert;
  int n_tok;                             // columns used: tokens routing to the expert
  int vec[kNvfp4MaxDecodeTokens];        // input vector of each column
  int out[kNvfp4MaxDecodeTokens];        // output row (assignment) of each column
};

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
      unit.vec[n] = g.x_per_token ? b / g.top_k : b;
      unit.out[n] = b;
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

// A lane's part of one tile segment: steps [s0, s1) of one 16-row tile of one unit.
struct Segment {
  const std::uint8_t* codes[2];   // rows g and g + 8
  const std::uint8_t* scales[2];
  int s0 = 0, s1 = 0;
  int row0 = 0;
  int unit = 0;
};

__device__ __forceinline__ Segment SegmentAt(const Nvfp4GemvParams& g, const Plan& plan, int idx, int end, int steps,
                                             int tiles_per_unit, int grp) {
  Segment seg;
  const int tile = idx / steps;
  seg.s0 = idx % steps;
  seg.s1 = min(steps, seg.s0 + (end - idx));
  seg.unit = tile / tiles_per_unit;
  seg.row0 = (tile % tiles_per_unit) * kMmaRows;
  const std::int64_t e = plan.unit[seg.unit].expert;
  const std::int64_t row_bytes = g.cols / 2, row_scales = g.cols / kNvfp4BlockSize;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    // Rows g and g + 8; tail rows re-read the last row (their results are not stored).
    const std::int64_t row = e * g.rows + min(seg.row0 + grp + 8 * h, g.rows - 1);
    seg.codes[h] = g.w.packed + row * row_bytes;
    seg.scales[h] = g.w.scales + row * row_scales;
  }
  return seg;
}

// Issues the loads of steps [s, s + kSteps) of the segment. kFull (cols a multiple of a step):
// steps past the segment's end are not loaded (ComputeBatch stops before them); otherwise a lane
// past the row's end gets zeros.
template <bool kFull, int kSteps>
__device__ __forceinline__ void LoadBatch(const Nvfp4GemvParams& g, const Segment& seg, int s, int quad_lane,
                                          StepData (&d)[kSteps]) {
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    const int c0 = nvfp4::LaneColumn(s + k, quad_lane);
    if constexpr (kFull) {
      if (s + k < seg.s1) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          d[k].codes[h] = LoadStreaming(seg.codes[h] + c0 / 2);
          d[k].scales[h] = __ldg(reinterpret_cast<const unsigned short*>(seg.scales[h] + c0 / kNvfp4BlockSize));
        }
      }
    } else {
      const bool valid = s + k < seg.s1 && c0 < g.cols;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        d[k].codes[h] = valid ? LoadStreaming(seg.codes[h] + c0 / 2) : make_uint4(0, 0, 0, 0);
        d[k].scales[h] =
            valid ? __ldg(reinterpret_cast<const unsigned short*>(seg.scales[h] + c0 / kNvfp4BlockSize)) : 0u;
      }
    }
  }
}

// Decodes steps [s, s + kSteps) of the segment from d and runs their MMAs into acc (sums times
// 2^-kScaleBias: nvfp4_fragment.h).
template <bool kFull, int kSteps>
__device__ __forceinline__ void ComputeBatch(const Nvfp4GemvParams& g, const Segment& seg, int s, int quad_lane,
                                             const __half* x, const StepData (&d)[kSteps], float (&acc)[2][4]) {
  const __half2 scale_bias = __float2half2_rn(static_cast<float>(1 << nvfp4::kScaleBias));
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    if (s + k >= seg.s1) break;
    const int c0 = nvfp4::LaneColumn(s + k, quad_lane);
    // A lane past the row's end decodes zeros and must not read inputs (a zero weight times
    // a NaN beyond the vector would poison its column).
    const bool valid = kFull || c0 < g.cols;
    const uint4* xv = reinterpret_cast<const uint4*>(x + c0);
    __half2 sc[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      sc[h] = __hmul2(DecodeE4M3Pair(static_cast<std::uint16_t>(d[k].scales[h])), scale_bias);
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      std::uint32_t pairs[2][4];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        nvfp4::DecodeE2M1Word(Word(d[k].codes[h], q), pairs[h]);
        // Exact (nvfp4_fragment.h, kScaleBias).
        const __half2 scale = nvfp4::WordBlock(q) == 0 ? __low2half2(sc[h]) : __high2half2(sc[h]);
#pragma unroll
        for (int i = 0; i < 4; ++i) pairs[h][i] = HalfBits(__hmul2(AsHalf2(pairs[h][i]), scale));
      }
      const uint4 xq = valid ? __ldg(xv + q) : make_uint4(0, 0, 0, 0);
      const std::uint32_t xs[4] = {xq.x, xq.y, xq.z, xq.w};
      std::uint32_t a[2][4], b[2][2];
      nvfp4::WordFragments(pairs[0], pairs[1], xs, a, b);
      Mma16816(acc[0], a[0], b[0]);
      Mma16816(acc[1], a[1], b[1]);
    }
  }
}

// Every warp of the grid takes an equal, contiguous share of the (tile, step) space (tiles ordered
// unit, 16-row tile); a share is at least one tile long, so each tile is split between at most two
// warps and each output gets at most two atomic additions onto zero (commutative in fp32: the
// result does not depend on timing).
template <bool kFull, int kSteps>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) Nvfp4GemvKernel(const __grid_constant__ Nvfp4GemvParams g) {
  __shared__ Plan plan;
  __shared__ int ids[kNvfp4MaxAssignments];
  BuildPlan(g, plan, ids);

  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int grp = lane / 4, quad_lane = lane % 4;
  const int steps = (g.cols + nvfp4::kStepCols - 1) / nvfp4::kStepCols;
  const int tiles_per_unit = (g.rows + kMmaRows - 1) / kMmaRows;
  const int total = plan.units * tiles_per_unit * steps;
  const int warps = static_cast<int>(gridDim.x) * kWarps;
  const int share = max((total + warps - 1) / warps, steps);
  int idx = (static_cast<int>(blockIdx.x) * kWarps + warp) * share;
  const int end = min(idx + share, total);

  // The weights do not depend on the kernel before (it writes x and zeroes out): the first
  // batch's code loads are issued before waiting for it, so they overlap its end.
  StepData d0[kSteps], d1[kSteps];
  Segment seg;
  if (idx < end) {
    seg = SegmentAt(g, plan, idx, end, steps, tiles_per_unit, grp);
    LoadBatch<kFull, kSteps>(g, seg, seg.s0, quad_lane, d0);
  }
  // The inputs and the zeroed outputs come from the kernel before: wait for it, then let the
  // next kernel launch (it waits for all of this one before reading).
  WaitForPrerequisiteGrid();
  LetDependentsLaunch();

  while (idx < end) {
    idx += seg.s1 - seg.s0;
    const Unit& unit = plan.unit[seg.unit];
    // Column grp of the MMA is the unit's token grp; a column without a token reads the first
    // token's inputs (column n of the result depends on column n of B alone, and is not stored).
    const __half* x = g.x + static_cast<std::int64_t>(unit.vec[grp < unit.n_tok ? grp : 0]) * g.cols;
    float acc[2][4] = {};
    // Two register buffers in turn: the next batch's loads are in flight while this one decodes.
    for (int s = seg.s0; s < seg.s1; s += 2 * kSteps) {
      if (s + kSteps < seg.s1) LoadBatch<kFull, kSteps>(g, seg, s + kSteps, quad_lane, d1);
      ComputeBatch<kFull, kSteps>(g, seg, s, quad_lane, x, d0, acc);
      if (s + kSteps >= seg.s1) break;
      if (s + 2 * kSteps < seg.s1) LoadBatch<kFull, kSteps>(g, seg, s + 2 * kSteps, quad_lane, d0);
      ComputeBatch<kFull, kSteps>(g, seg, s + kSteps, quad_lane, x, d1, acc);
    }
    const Segment done = seg;
    // The next segment's first batch loads while this one's results are stored.
    if (idx < end) {
      seg = SegmentAt(g, plan, idx, end, steps, tiles_per_unit, grp);
      LoadBatch<kFull, kSteps>(g, seg, seg.s0, quad_lane, d0);
    }
    const float global =
        __ldg(g.w.global_scales + plan.unit[done.unit].expert) * static_cast<float>(1 << nvfp4::kScaleBias);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = done.row0 + nvfp4::AccRow(lane, r), t = nvfp4::AccToken(lane, r);
      if (row < g.rows && t < unit.n_tok) {
        atomicAdd(g.out + unit.out[t] * g.out_stride + row, global * (acc[0][r] + acc[1][r]));
      }
    }
  }
}

}  // namespace

absl::Status LaunchNvfp4Gemv(const Nvfp4GemvParams& g, const LaunchContext& ctx) {
  if (g.assignments <= 0 || g.assignments > kNvfp4MaxAssignments || g.top_k <= 0 ||
      g.assignments > kNvfp4MaxDecodeTokens * g.top_k) {
    return absl::InvalidArgumentError(absl::StrCat("Nvfp4Gemv: ", g.assignments, " assignments of top_k ", g.top_k,
                                                   "; a chunk takes at most ", kNvfp4MaxAssignments));
  }
  if (g.rows <= 0 || g.cols <= 0 || g.cols % kNvfp4LaneCols != 0) {
    return absl::InvalidArgumentError(absl::StrCat("Nvfp4Gemv: ", g.rows, " x ", g.cols, " rows x cols; cols must be a ",
                                                   "positive multiple of ", kNvfp4LaneCols));
  }
  static_assert(kNvfp4MaxAssignments <= kThreads, "BuildPlan takes one thread per assignment");
  // Programmatic dependent launch: the plan is built and the first codes are loaded while the
  // kernel before finishes.
  const dim3 grid(static_cast<unsigned>(ctx.num_sms * kBlocksPerSm));
  if (g.cols % nvfp4::kStepCols == 0) {  // every real model's shapes
    RETURN_IF_ERROR(LaunchProgrammaticDependent(Nvfp4GemvKernel<true, kDepth>, grid, dim3(kThreads), 0, ctx, g));
  } else {
    RETURN_IF_ERROR(LaunchProgrammaticDependent(Nvfp4GemvKernel<false, kDepth>, grid, dim3(kThreads), 0, ctx, g));
  }
  return CheckLaunch("Nvfp4GemvKernel");
}

}  // namespace nq::kernels::cuda
