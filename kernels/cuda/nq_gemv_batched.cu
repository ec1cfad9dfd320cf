#include "kernels/cuda/nq_gemv_batched.cuh"

#include "kernels/cuda/launch_dependent.cuh"
#include "kernels/cuda/load.cuh"
#include "kernels/cuda/nq_gemv_plan.cuh"
#include "kernels/cuda/reduce.cuh"
#include "services/common/status_macros.h"

namespace nq::kernels::cuda {
namespace {

using nq_gemv::kAccumulators;
using nq_gemv::kBlocksPerSm;
using nq_gemv::kMmaRows;
using nq_gemv::kRows;
using nq_gemv::kThreads;
using nq_gemv::kWarps;
using nq_gemv::kWordsPerLane;
using nq_gemv::MmaWord;
using nq_gemv::Plan;
using nq_gemv::Unit;
using nq_gemv::Word;


// One step's code words of a lane: [plane][row], plane 0 the base, 1 the residual (4 bits).
template <int kPlanes>
struct StepCodes {
  uint4 w[kPlanes][kRows];
};

// Where a warp is in its share: the flat (tile, step) index space of one width, tiles ordered
// (unit, projection, 16-row tile) from the width's first unit, 256-input steps within a tile.
struct Shape {
  int steps;           // per tile
  int tiles_per_proj;  // 16-row tiles per projection
  int unit0;           // the width's first unit
  int last_tile;       // of the warp's share
};

struct TileIndex {
  int unit, proj, row0;
};

__device__ __forceinline__ TileIndex TileOf(const NqGemvParams& g, const Shape& sh, int tile) {
  const int rest = tile % (g.num_proj * sh.tiles_per_proj);
  return {sh.unit0 + tile / (g.num_proj * sh.tiles_per_proj), rest / sh.tiles_per_proj,
          (rest % sh.tiles_per_proj) * kMmaRows};
}

// The load side: the lane's next code words, one step at a time, across tile boundaries.
struct Loader {
  const std::uint32_t* base[kRows];  // the lane's 16 bytes of rows g and g + 8 at the current step
  std::int64_t residual_minus_base;  // words from a base word to its residual word (4 bits)
  int tile, step;
};

__device__ __forceinline__ void LoaderEnterTile(const NqGemvParams& g, const Plan& plan, const Shape& sh, int tile,
                                                int step, Loader& ld) {
  const int lane = threadIdx.x % kWarpSize, grp = lane / 4, quad_lane = lane % 4;
  const TileIndex ti = TileOf(g, sh, tile);
  const Unit& u = plan.unit[ti.unit];
  const NqProjectionView& P = g.proj[ti.proj];
  const int words = g.cols / kCodesPerWord;
  const std::uint32_t* base =
      reinterpret_cast<const std::uint32_t*>(P.base) + u.expert * (static_cast<std::int64_t>(g.rows) * words);
  if (u.slot >= 0) {
    const std::uint32_t* residual =
        reinterpret_cast<const std::uint32_t*>(NqSlotRecord(g.p, u.slot) + P.residual_offset);
    ld.residual_minus_base = residual - base;
  }
#pragma unroll
  for (int h = 0; h < kRows; ++h) {
    // Rows g and g + 8; tail rows re-read the last row (their results are not stored).
    const int row = min(ti.row0 + grp + 8 * h, g.rows - 1);
    ld.base[h] = base + row * static_cast<std::int64_t>(words) + kWordsPerLane * quad_lane + step * kNqStepWords;
  }
  ld.tile = tile;
  ld.step = step;
}

template <int kPlanes>
__device__ __forceinline__ void LoadStep(const NqGemvParams& g, const Plan& plan, const Shape& sh, Loader& ld,
                                         StepCodes<kPlanes>& d) {
#pragma unroll
  for (int h = 0; h < kRows; ++h) {
    d.w[0][h] = LoadStreaming(ld.base[h]);
    if constexpr (kPlanes == 2) d.w[1][h] = LoadStreaming(ld.base[h] + ld.residual_minus_base);
  }
  if (++ld.step < sh.steps) {
#pragma unroll
    for (int h = 0; h < kRows; ++h) ld.base[h] += kNqStepWords;
  } else if (ld.tile < sh.last_tile) {
    LoaderEnterTile(g, plan, sh, ld.tile + 1, 0, ld);
  }
}

struct LevelTables {
  LevelBytes2 t2;
  LevelBytes4 t4;
};

// The compute side: the tile whose steps the lane is decoding.
struct ComputeTile {
  TileIndex at;
  // The inputs of the lane's token at the current step (the even-grid plane for even-grid tiles).
  // A lane whose MMA column has no token reads the unit's first token: column n of an MMA's
  // result depends on column n of its B fragment alone, and those columns are never stored.
  const __half* x;
  float row_scale[kRows];  // times the even grid's step / 2^-24 where it applies
  bool even_grid;          // 2 bits: an even base grid; 4 bits: uniform nested levels
  float grid_offset;       // the code's offset on the grid: 1.5 (b - 1.5), 7.5 / 4 ((4 b + r - 7.5) / 4)
  bool from_step0;  // this warp runs the tile's first step (and adds the even grid's offset)
  LevelTables t;
};

template <bool kFour>
__device__ __forceinline__ void EnterTile(const NqGemvParams& g, const Plan& plan, const Shape& sh, int tile, int step,
                                          ComputeTile& c) {
  const int lane = threadIdx.x % kWarpSize, grp = lane / 4, quad_lane = lane % 4;
  c.at = TileOf(g, sh, tile);
  const Unit& u = plan.unit[c.at.unit];
  c.from_step0 = step == 0;
  const float grid_step = kFour ? u.uniform4_step[c.at.proj] : u.even_step[c.at.proj];
  c.even_grid = grid_step != 0.0f;
  c.grid_offset = kFour ? 7.5f / 4.0f : 1.5f;
  if constexpr (kFour) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      c.t.t4.lo[i] = u.lut[c.at.proj][i];
      c.t.t4.hi[i] = u.lut[c.at.proj][4 + i];
    }
  } else {
    c.t.t2.lo = u.lut[c.at.proj][0];
    c.t.t2.hi = u.lut[c.at.proj][1];
  }
  // Row scales now, used at the tile's end: their latency hides behind its steps. The even
  // grid's step and the 2^24 of its subnormal codes ride on them.
  const float grid = c.even_grid ? grid_step / kEvenGridUnit : 1.0f;
  const float* scales = g.proj[c.at.proj].row_scales + static_cast<std::int64_t>(u.expert) * g.rows;
#pragma unroll
  for (int h = 0; h < kRows; ++h) c.row_scale[h] = __ldg(scales + min(c.at.row0 + grp + 8 * h, g.rows - 1)) * grid;
  const int a = u.tok_a[grp < u.n_tok ? grp : 0];
  c.x = g.xh +
        ((static_cast<std::int64_t>(a) * g.num_proj + c.at.proj) * NqGemvInputPlanes(g.p.codec) + (c.even_grid ? 1 : 0)) *
            NqGemvPaddedCols(g.cols) +
        (step * kNqStepWords + quad_lane) * kCodesPerWord;
}

enum class Decode { kEvenGrid, kLookup2, kLookup4, kUniformNested4 };

// Decodes one step and runs its 16 MMAs into acc.
template <Decode kDecode, int kPlanes>
__device__ __forceinline__ void ComputeStep(const ComputeTile& c, const StepCodes<kPlanes>& d,
                                            float (&acc)[kAccumulators][4]) {
  const uint4* xv = reinterpret_cast<const uint4*>(c.x);
#pragma unroll
  for (int q = 0; q < kWordsPerLane; ++q) {
    const uint4 x0 = __ldg(xv + 8 * q), x1 = __ldg(xv + 8 * q + 1);
    __half2 lo[kPairsPerWord], hi[kPairsPerWord];
    if constexpr (kDecode == Decode::kUniformNested4) {
      DecodeWord4UniformNested(Word(d.w[0][0], q), Word(d.w[kPlanes - 1][0], q), lo);
      DecodeWord4UniformNested(Word(d.w[0][1], q), Word(d.w[kPlanes - 1][1], q), hi);
    } else if constexpr (kDecode == Decode::kLookup4) {
      DecodeWord4(c.t.t4, Word(d.w[0][0], q), Word(d.w[kPlanes - 1][0], q), lo);
      DecodeWord4(c.t.t4, Word(d.w[0][1], q), Word(d.w[kPlanes - 1][1], q), hi);
    } else if constexpr (kDecode == Decode::kEvenGrid) {
      DecodeWord2EvenGrid(Word(d.w[0][0], q), lo);
      DecodeWord2EvenGrid(Word(d.w[0][1], q), hi);
    } else {
      DecodeWord2(c.t.t2, Word(d.w[0][0], q), lo);
      DecodeWord2(c.t.t2, Word(d.w[0][1], q), hi);
    }
    MmaWord(acc, lo, hi, x0, x1);
  }
}

// Adds the tile's sums (of this warp's steps) into the outputs and clears acc. acc holds (row g,
// tokens 2j, 2j+1) and (row g + 8, tokens 2j, 2j+1) of quad lane j. Even grid: acc holds 2^-24
// sum code * y over the warp's steps, and the tile's sum of (code - 1.5) * y needs - 1.5 * 2^-24 *
// sum y once, from the warp that ran its first step. Every lane of the warp calls this (shuffles).
__device__ __forceinline__ void Flush(const NqGemvParams& g, const Plan& plan, const ComputeTile& c,
                                      float (&acc)[kAccumulators][4]) {
  const int lane = threadIdx.x % kWarpSize, grp = lane / 4, quad_lane = lane % 4;
  const Unit& unit = plan.unit[c.at.unit];
  float offset[2] = {0.0f, 0.0f};
  if (c.even_grid && c.from_step0) {
    for (int n = 0; n < unit.n_tok; ++n) {
      const float* parts = g.xsum + (static_cast<std::int64_t>(unit.tok_a[n]) * g.num_proj + c.at.proj) * g.xsum_parts;
      float sum = 0.0f;
      for (int i = lane; i < g.xsum_parts; i += kWarpSize) sum += parts[i];
      sum = WarpSum(sum);
      if (n / 2 == quad_lane) offset[n % 2] = c.grid_offset * kEvenGridUnit * sum;
    }
  }
#pragma unroll
  for (int h = 0; h < kRows; ++h) {
    const int row = c.at.row0 + grp + 8 * h;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const int t = 2 * quad_lane + n;
      if (row < g.rows && t < unit.n_tok) {
        atomicAdd(g.out + unit.tok_a[t] * g.out_stride + c.at.proj * g.rows + row,
                  c.row_scale[h] * (acc[0][2 * h + n] + acc[1][2 * h + n] - offset[n]));
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kAccumulators; ++i) {
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[i][r] = 0.0f;
  }
}

// The steps [idx, seg_end) of the current tile: each decoded from its register slot, the slot
// then reloaded with the step kDepth further on (up to the share's end, across tile boundaries).
// Step idx sits in slot (idx - begin) % kDepth. The slot loop is unrolled (static register
// indices) and entered at the segment's first slot; its body is one step, so the code a warp runs
// stays small (a body with the tile's end in it, unrolled kDepth times, overflowed the
// instruction cache: ncu's "no instruction" stall at 5.9 cycles an instruction).
template <Decode kDecode, int kDepth, int kPlanes>
__device__ __forceinline__ void RunSegment(const NqGemvParams& g, const Plan& plan, const Shape& sh, Loader& ld,
                                           ComputeTile& c, StepCodes<kPlanes> (&d)[kDepth],
                                           float (&acc)[kAccumulators][4], int& idx, int seg_end, int begin,
                                           int end) {
  int first = (idx - begin) % kDepth;
  while (idx < seg_end) {
#pragma unroll
    for (int j = 0; j < kDepth; ++j) {
      if (j >= first && idx < seg_end) {
        ComputeStep<kDecode>(c, d[j], acc);
        if (idx + kDepth < end) LoadStep(g, plan, sh, ld, d[j]);
        ++idx;
        c.x += kNqStepCodes;
      }
    }
    first = 0;
  }
}

// One warp's share of one width's steps: share `index` of `group_warps` equal, contiguous shares
// of `total` steps. A share is at least one tile long, so a tile is split between at most two
// warps and each output gets at most two atomic additions onto zero (a + b == b + a in fp32: the
// result does not depend on timing). kDepth register slots of steps: kDepth - 1 loads stay in
// flight while one step decodes (none with one slot: the step after is loaded once this one is
// decoded, and the SM's other warps cover the wait, which beat two slots at 4 bits).
template <bool kFour, int kDepth>
__device__ __forceinline__ void RunShare(const NqGemvParams& g, const Plan& plan, int index, int group_warps, int total,
                                         int unit0) {
  constexpr int kPlanes = kFour ? 2 : 1;
  const int steps = g.cols / kNqStepCodes;
  const int share = max((total + group_warps - 1) / group_warps, steps);
  const int begin = index * share;
  const int end = min(begin + share, total);
  if (begin >= end) return;  // no barrier follows
  const Shape sh{steps, (g.rows + kMmaRows - 1) / kMmaRows, unit0, (end - 1) / steps};

  // The codes do not depend on the kernel before (it writes the inputs and zeroes the outputs):
  // the first kDepth steps are loaded before waiting for it, so the loads overlap its end.
  StepCodes<kPlanes> d[kDepth];
  Loader ld;
  LoaderEnterTile(g, plan, sh, begin / steps, begin % steps, ld);
#pragma unroll
  for (int k = 0; k < kDepth; ++k) {
    if (begin + k < end) LoadStep(g, plan, sh, ld, d[k]);
  }
  ComputeTile c;
  EnterTile<kFour>(g, plan, sh, begin / steps, begin % steps, c);
  WaitForPrerequisiteGrid();
  // The kernel after this one (SwiGLU preparation, or the combine) is a programmatic dependent
  // too: let it launch now, so its launch latency hides behind this GEMV; it waits for all of it.
  LetDependentsLaunch();

  float acc[kAccumulators][4] = {};
  int idx = begin;
  while (idx < end) {
    const int seg_end = min(end, (idx / steps + 1) * steps);
    if constexpr (kFour) {
      if (c.even_grid) {
        RunSegment<Decode::kUniformNested4>(g, plan, sh, ld, c, d, acc, idx, seg_end, begin, end);
      } else {
        RunSegment<Decode::kLookup4>(g, plan, sh, ld, c, d, acc, idx, seg_end, begin, end);
      }
    } else if (c.even_grid) {
      RunSegment<Decode::kEvenGrid>(g, plan, sh, ld, c, d, acc, idx, seg_end, begin, end);
    } else {
      RunSegment<Decode::kLookup2>(g, plan, sh, ld, c, d, acc, idx, seg_end, begin, end);
    }
    Flush(g, plan, c, acc);
    if (idx < end) EnterTile<kFour>(g, plan, sh, idx / steps, 0, c);
  }
}

// Warps for the 4-bit experts: in proportion to their bytes (a 4-bit step reads twice a 2-bit
// step's), at least one for each width that has work.
__device__ __forceinline__ int FourBitWarps(int warps, int total2, int total4) {
  if (total4 == 0) return 0;
  if (total2 == 0) return warps;
  const long long weighted4 = 2LL * total4;
  const int w = static_cast<int>((warps * weighted4 + (total2 + weighted4) / 2) / (total2 + weighted4));
  return max(1, min(warps - 1, w));
}

template <int kDepth2, int kDepth4>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) NqGemvBatchedKernel(const __grid_constant__ NqGemvParams g) {
  __shared__ Plan plan;
  __shared__ int ids[kNqMaxDecodeAssignments];
  nq_gemv::BuildPlan(g, plan, ids);

  const int steps = g.cols / kNqStepCodes;
  const int tiles_per_proj = (g.rows + kMmaRows - 1) / kMmaRows;
  const int per_unit = g.num_proj * tiles_per_proj * steps;
  const int total2 = plan.units2 * per_unit, total4 = (plan.units - plan.units2) * per_unit;
  const int warps = static_cast<int>(gridDim.x) * kWarps;
  const int warps4 = FourBitWarps(warps, total2, total4);
  // The 4-bit warps spread evenly over the grid (and so over the SMs): warp w is a 4-bit warp when
  // floor(w * warps4 / warps) steps up at w + 1.
  const int w = static_cast<int>(blockIdx.x) * kWarps + static_cast<int>(threadIdx.x) / kWarpSize;
  const int before4 = static_cast<int>(static_cast<long long>(w) * warps4 / warps);
  const bool four = static_cast<int>(static_cast<long long>(w + 1) * warps4 / warps) != before4;
  if (four) {
    RunShare<true, kDepth4>(g, plan, before4, warps4, total4, plan.units2);
  } else {
    RunShare<false, kDepth2>(g, plan, w - before4, warps - warps4, total2, 0);
  }
}

}  // namespace

absl::Status LaunchNqGemvBatched(const NqGemvParams& g, const LaunchContext& ctx) {
  if (g.p.codec != NqCodec::kNestedScalar || g.cols % kNqStepCodes != 0) {
    return absl::InvalidArgumentError("NqGemvBatched: nested_scalar_v1 rows of whole 256-input steps only");
  }
  if (g.p.tokens > kNqMaxDecodeTokens || g.p.tokens * g.p.top_k > kNqMaxDecodeAssignments) {
    return absl::InvalidArgumentError("NqGemvBatched: chunk larger than the decode path takes");
  }
  // Programmatic dependent launch: the plan is built and the first codes are loaded while the
  // preparation kernel before finishes.
  // One register slot of steps at either width: measured on an H100 against 2, 3 and 4 at 2 bits
  // and 2 and 3 at 4 (and on the H200 earlier, 4 against 6 and 8), the longer unrolled loops of
  // more slots cost more in instruction fetch than their deeper loads gained (bench/README.md).
  RETURN_IF_ERROR(LaunchProgrammaticDependent(NqGemvBatchedKernel<1, 1>,
                                              dim3(static_cast<unsigned>(ctx.num_sms * kBlocksPerSm)), dim3(kThreads),
                                              0, ctx, g));
  return CheckLaunch("NqGemvBatchedKernel");
}

}  // namespace nq::kernels::cuda
