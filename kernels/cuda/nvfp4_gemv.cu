#include "kernels/cuda/nvfp4_gemv.cuh"

#include <cstdlib>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/launch_dependent.cuh"
#include "kernels/cuda/load.cuh"
#include "kernels/cuda/nvfp4_fragment.h"
#include "kernels/cuda/nvfp4_gemv_step.cuh"
#include "kernels/cuda/nvfp4_gemv_tma.cuh"
#include "kernels/nvfp4_codes.h"
#include "services/common/status_macros.h"

namespace nq::kernels::cuda {
namespace {

using namespace nvfp4_gemv;

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

// Decodes steps [s, s + kSteps) of the segment from d and runs their MMAs into acc.
template <bool kFull, int kSteps>
__device__ __forceinline__ void ComputeBatch(const Nvfp4GemvParams& g, const Segment& seg, int s, int quad_lane,
                                             const __half* x, const StepData (&d)[kSteps], float (&acc)[2][4]) {
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    if (s + k >= seg.s1) break;
    const int c0 = nvfp4::LaneColumn(s + k, quad_lane);
    DecodeStep(d[k], kFull || c0 < g.cols ? reinterpret_cast<const uint4*>(x + c0) : nullptr, acc);
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

// NQ_NVFP4_GEMV=regs keeps the register kernel for every shape, to measure it against the TMA
// kernel (scripts/device/run_nvfp4_gemv_ab.sh).
bool TmaKernelAllowed() {
  const char* v = std::getenv("NQ_NVFP4_GEMV");
  return v == nullptr || std::string_view(v) != "regs";
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
  static const bool tma_allowed = TmaKernelAllowed();
  if (tma_allowed && Nvfp4GemvTmaApplies(g)) return LaunchNvfp4GemvTma(g, ctx);
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
