#include "kernels/cuda/nq_moe_gemv.cuh"

#include "kernels/cuda/launch_dependent.cuh"
#include "kernels/cuda/nq_gemv_batched.cuh"
#include "kernels/cuda/nq_gemv_plan.cuh"
#include "kernels/cuda/nq_moe.cuh"
#include "kernels/cuda/reduce.cuh"
#include "kernels/cuda/trellis_tile.cuh"
#include "kernels/nq_moe.h"
#include "services/common/status_macros.h"

namespace nq::kernels::cuda {
namespace {

// The plan, the MMAs and the grid shape, shared with nq_gemv_batched.cu.
using nq_gemv::kAccumulators;
using nq_gemv::kBlocksPerSm;
using nq_gemv::kMmaRows;
using nq_gemv::kRows;
using nq_gemv::kThreads;
using nq_gemv::kWarps;
using nq_gemv::kWordsPerLane;
using nq_gemv::BuildPlan;
using nq_gemv::MmaWord;
using nq_gemv::Mma16816;
using nq_gemv::Plan;
using nq_gemv::Unit;
using nq_gemv::Word;

// Steps of code bytes each warp keeps in its own shared-memory ring (cp.async): kStages - 1 in
// flight while one is decoded. A scalar lane reads back only what it copied (no barrier); trellis
// lanes read the whole step's tiles, so that path adds warp barriers around each step.
constexpr int kStages = 4;
// Both widths run in one launch: a warp's step decodes its tile at the width of the tile's
// expert. 2 planes of ring per stage (the residual's unused at 2 bits), two blocks of 8 warps
// per SM (the 4-bit lookup's registers).
constexpr int kPlanes = 2;  // base, residual
constexpr int kRingUint4PerWarp = kStages * kPlanes * kRows * kWarpSize;

__device__ __forceinline__ std::uint32_t SharedAddress(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes (4 words) of a row into shared memory; `valid` words are read, the rest zero-filled.
// kWide: the row is 16-byte aligned (cols % 64 == 0) and valid is 0 or 4.
// A warp's step reads 64 bytes of each of 16 rows, and the next step the next 64 bytes: asking L2
// for the whole 256-byte line (.L2::256B) turns four 64-byte DRAM reads of a row into one burst,
// and the row's next three steps hit L2.
template <bool kWide>
__device__ __forceinline__ void CopyWords(uint4* dst, const std::uint32_t* src, int valid) {
  if constexpr (kWide) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(SharedAddress(dst)), "l"(src),
                 "r"(valid > 0 ? 16 : 0));
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(
                       SharedAddress(reinterpret_cast<std::uint32_t*>(dst) + i)),
                   "l"(src + (i < valid ? i : 0)), "r"(i < valid ? 4 : 0));
    }
  }
}

__device__ __forceinline__ void CommitCopies() { asm volatile("cp.async.commit_group;"); }

template <int kPending>
__device__ __forceinline__ void WaitCopies() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending));
}

// A 16-row tile of one projection of one unit as a lane sees it: where its rows' code words
// start (its quad lane's 16 bytes of each step included) and its token's inputs.
struct Tile {
  int unit = 0;
  int proj = 0;
  int row0 = 0;
  bool four_bit = false;
  bool even_grid = false;  // 2-bit codes on an even base grid (the subnormal decode)
  const std::uint32_t* codes[kPlanes][kRows] = {};  // [plane][row]; the residual's null at 2 bits
  // The inputs of the lane's token. A lane whose MMA column has no token reads the unit's first
  // token: column n of an MMA's result depends on column n of its B fragment alone, and those
  // columns are never stored, so every lane loads without a branch.
  const __half* x = nullptr;
  std::int64_t x_plane_stride = 0;  // halves between a trellis vector's planes
};

template <bool kTrellis>
__device__ __forceinline__ Tile TileAt(const NqGemvParams& g, const Plan& plan, int tile, int tiles_per_proj,
                                       int words) {
  Tile t;
  t.unit = tile / (g.num_proj * tiles_per_proj);
  const int rest = tile % (g.num_proj * tiles_per_proj);
  t.proj = rest / tiles_per_proj;
  t.row0 = (rest % tiles_per_proj) * kMmaRows;
  const Unit& u = plan.unit[t.unit];
  t.four_bit = u.slot >= 0;
  if constexpr (!kTrellis) t.even_grid = !t.four_bit && u.even_step[t.proj] != 0.0f;
  const NqProjectionView& P = g.proj[t.proj];
  const int lane = threadIdx.x % kWarpSize, grp = lane / 4;
  const std::int64_t plane_words = static_cast<std::int64_t>(g.rows) * words;
  const std::uint32_t* base = reinterpret_cast<const std::uint32_t*>(P.base) + u.expert * plane_words;
  const std::uint32_t* residual =
      t.four_bit ? reinterpret_cast<const std::uint32_t*>(NqSlotRecord(g.p, u.slot) + P.residual_offset)
                 : nullptr;
#pragma unroll
  for (int h = 0; h < kRows; ++h) {
    std::int64_t offset;
    if constexpr (kTrellis) {
      // The tile row's tiles are consecutive 64-byte pieces: a step's 16 tiles are 1 KB, which the
      // warp copies as two 512-byte halves (h), lane l taking 16 bytes of each.
      offset = static_cast<std::int64_t>(t.row0 / kMmaRows) * words * kMmaRows + (h * kWarpSize + lane) * 4;
    } else {
      // Rows g and g + 8; tail rows re-read the last row (their results are not stored).
      offset = min(t.row0 + grp + 8 * h, g.rows - 1) * static_cast<std::int64_t>(words) + kWordsPerLane * (lane % 4);
    }
    t.codes[0][h] = base + offset;
    t.codes[1][h] = residual != nullptr ? residual + offset : nullptr;
  }
  const int planes = NqGemvInputPlanes(g.p.codec);
  t.x_plane_stride = NqGemvPaddedCols(g.cols);
  const int a = u.tok_a[grp < u.n_tok ? grp : 0];
  t.x = g.xh + ((static_cast<std::int64_t>(a) * g.num_proj + t.proj) * planes + (t.even_grid ? 1 : 0)) *
                   t.x_plane_stride;
  return t;
}

// One trellis_v1 step: the 16 tiles (16 x 16 each) of the step's 1 KB per plane in the ring,
// one MMA per tile and plane. A tile's A fragment needs four of its words per lane
// (trellis_tile.cuh); the B fragments of the lane's token come from the plane's input vector,
// two tiles per 16-byte load (nq_moe_gemv.cuh, NqGemvTrellisInputIndex).
__device__ __forceinline__ void TrellisStep(float (&acc)[kAccumulators][4], const std::uint32_t* stage_words, const Tile& ct,
                                            int step, int lane) {
  constexpr int kTiles = kNqStepWords;
  constexpr int kPlaneWords = kTiles * trellis::kTileWords;  // 256
  const int quad_lane = lane % 4;
  const std::int64_t padded_offset = static_cast<std::int64_t>(step * 4 + quad_lane) * kTiles * 4;  // halves
  const int planes = ct.four_bit ? 2 : 1;
  for (int plane = 0; plane < planes; ++plane) {
    const uint4* xv = reinterpret_cast<const uint4*>(ct.x + plane * ct.x_plane_stride + padded_offset);
#pragma unroll
    for (int k2 = 0; k2 < kTiles / 2; ++k2) {
      const uint4 b = __ldg(xv + k2);
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        const int k = 2 * k2 + t;
        __half2 a[4];
        trellis::TileAFragment(stage_words + plane * kPlaneWords + k * trellis::kTileWords, lane, a);
        Mma16816(acc[t], a[0], a[1], a[2], a[3], t == 0 ? b.x : b.z, t == 0 ? b.y : b.w);
      }
    }
  }
}

// Every warp of the grid streams an equal, contiguous share of the (tile, step) space: tiles
// ordered (unit, projection, 16-row tile), 256-input steps within a tile. A share is at least one
// tile long, so a tile is split between at most two warps and each output gets at most two
// atomic additions onto zero (a + b == b + a in fp32: the result does not depend on timing).
// kFull: rows are whole steps (cols % 256 == 0, as at every real model's shapes), so every copy
// reads 16 bytes and needs no bounds arithmetic.
template <bool kWide, bool kTrellis, bool kFull>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) NqGemvKernel(const __grid_constant__ NqGemvParams g) {
  extern __shared__ __align__(16) uint4 ring[];  // [kWarps][kStages][kPlanes][kRows][kWarpSize]
  __shared__ Plan plan;
  __shared__ int ids[kNqMaxDecodeAssignments];
  BuildPlan(g, plan, ids);

  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int words = g.cols / kCodesPerWord;
  const int steps = NqGemvPaddedCols(g.cols) / kNqStepCodes;
  const int tiles_per_proj = (g.rows + kMmaRows - 1) / kMmaRows;
  const int total = plan.units * g.num_proj * tiles_per_proj * steps;
  const int warps = static_cast<int>(gridDim.x) * kWarps;
  const int share = max((total + warps - 1) / warps, steps);
  const int begin = (static_cast<int>(blockIdx.x) * kWarps + warp) * share;
  const int end = min(begin + share, total);
  if (begin >= end) return;  // no barrier follows

  const int grp = lane / 4, quad_lane = lane % 4;
  uint4* warp_ring = ring + warp * kRingUint4PerWarp;
  uint4* my_ring = warp_ring + lane;
  constexpr int kStageStride = kPlanes * kRows * kWarpSize;  // uint4 per stage

  // Issue side: the tile and step the next copy is for.
  int issue_tile = begin / steps, issue_step = begin % steps, issued = begin;
  Tile it = TileAt<kTrellis>(g, plan, issue_tile, tiles_per_proj, words);
  auto issue = [&](int stage) {
    if (issued < end) {
      int w0, valid;
      if constexpr (kFull && !kTrellis) {
        w0 = issue_step * kNqStepWords;
        valid = kWordsPerLane;
      } else if constexpr (kTrellis) {
        w0 = issue_step * kNqStepWords * kMmaRows;  // 16 tiles of 16 words
        valid = 0;                                  // (per half below)
      } else {
        w0 = issue_step * kNqStepWords;
        valid = max(0, min(kWordsPerLane, words - w0 - kWordsPerLane * quad_lane));
      }
      uint4* dst = my_ring + stage * kStageStride;
#pragma unroll
      for (int h = 0; h < kRows; ++h) {
        // Trellis: this lane's 16 bytes are inside the step's tiles (a row's last step may hold
        // fewer than 16).
        if constexpr (kTrellis) valid = (h * kWarpSize + lane) * 4 < words * kMmaRows - w0 ? 4 : 0;
        CopyWords<kWide || kTrellis>(dst + h * kWarpSize, it.codes[0][h] + (valid > 0 ? w0 : 0), valid);
        if (it.four_bit) {
          CopyWords<kWide || kTrellis>(dst + (kRows + h) * kWarpSize, it.codes[1][h] + (valid > 0 ? w0 : 0), valid);
        }
      }
      ++issued;
      if (++issue_step == steps && issued < end) {
        issue_step = 0;
        it = TileAt<kTrellis>(g, plan, ++issue_tile, tiles_per_proj, words);
      }
    }
    CommitCopies();  // one group per call, empty or not, so the wait count below holds
  };
#pragma unroll
  for (int s = 0; s + 1 < kStages; ++s) issue(s);

  // Compute side.
  int tile = begin / steps, step = begin % steps;
  Tile ct;
  const Unit* unit = nullptr;
  LevelBytes2 t2;
  LevelBytes4 t4;
  bool from_step0 = false;  // this warp runs the tile's first step (and adds the even grid's offset)
  float rs[kRows] = {};
  float acc[kAccumulators][4] = {};
  auto enter_tile = [&]() {
    ct = TileAt<kTrellis>(g, plan, tile, tiles_per_proj, words);
    unit = &plan.unit[ct.unit];
    if (ct.four_bit) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        t4.lo[i] = unit->lut[ct.proj][i];
        t4.hi[i] = unit->lut[ct.proj][4 + i];
      }
    } else {
      t2.lo = unit->lut[ct.proj][0];
      t2.hi = unit->lut[ct.proj][1];
    }
    from_step0 = step == 0;
    // Row scales now, used at the tile's end: their latency hides behind its steps. The even
    // grid's step and the 2^24 of its subnormal codes ride on them.
    const float grid = ct.even_grid ? unit->even_step[ct.proj] / kEvenGridUnit : 1.0f;
    const float* scales = g.proj[ct.proj].row_scales + static_cast<std::int64_t>(unit->expert) * g.rows;
#pragma unroll
    for (int h = 0; h < kRows; ++h) rs[h] = __ldg(scales + min(ct.row0 + grp + 8 * h, g.rows - 1)) * grid;
  };
  // The even grid's offset for the lane's two MMA columns (tokens 2 quad_lane + n): acc holds
  // 2^-24 sum code * y over the warp's steps, and the tile's sum of (code - 1.5) * y needs
  // - 1.5 * 2^-24 * sum y once, from the warp that ran its first step. Every lane of the warp
  // calls this (shuffles).
  auto even_grid_offsets = [&](float (&offset)[2]) {
    offset[0] = offset[1] = 0.0f;
    if (!ct.even_grid || !from_step0) return;
    for (int n = 0; n < unit->n_tok; ++n) {
      const float* parts = g.xsum + (static_cast<std::int64_t>(unit->tok_a[n]) * g.num_proj + ct.proj) * g.xsum_parts;
      float sum = 0.0f;
      for (int i = lane; i < g.xsum_parts; i += kWarpSize) sum += parts[i];
      sum = WarpSum(sum);
      if (n / 2 == quad_lane) offset[n % 2] = 1.5f * kEvenGridUnit * sum;
    }
  };
  // C holds (row g, tokens 2j, 2j+1) and (row g + 8, tokens 2j, 2j+1).
  auto flush = [&]() {
    float offset[2];
    even_grid_offsets(offset);
#pragma unroll
    for (int h = 0; h < kRows; ++h) {
      const int row = ct.row0 + grp + 8 * h;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const int t = 2 * quad_lane + n;
        if (row < g.rows && t < unit->n_tok) {
          atomicAdd(g.out + unit->tok_a[t] * g.out_stride + ct.proj * g.rows + row,
                    rs[h] * (acc[0][2 * h + n] + acc[1][2 * h + n] - offset[n]));
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kAccumulators; ++i) {
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][r] = 0.0f;
    }
  };
  enter_tile();
  // Launched as a programmatic dependent of the preparation kernel (Launch below): everything
  // above (the plan, the first code copies, the level tables) overlaps it; the inputs it writes
  // and the outputs it zeroes are touched only after this wait.
  WaitForPrerequisiteGrid();
  // The kernel after this one (SwiGLU preparation, or the combine) is a programmatic dependent
  // too: let it launch now, so its launch latency hides behind this GEMV; it waits for all of it.
  LetDependentsLaunch();

  int stage = 0;
  for (int idx = begin; idx < end; ++idx) {
    // Trellis lanes read each other's copies: every lane must be done with the stage about to
    // be refilled (read last step) before any lane refills it.
    if constexpr (kTrellis) __syncwarp();
    issue((stage + kStages - 1) % kStages);
    if constexpr (kTrellis) {
      WaitCopies<kStages - 1>();
      __syncwarp();  // and every lane's copies of this step have landed before any lane reads them
      TrellisStep(acc, reinterpret_cast<const std::uint32_t*>(warp_ring + stage * kStageStride), ct, step, lane);
    } else {
    // The step's inputs (B fragments) come straight from global memory (L1/L2: every tile of the
    // vector reads them), word by word: as fast as loading the whole step's first (measured), with
    // fewer registers live.
    const uint4* xv = reinterpret_cast<const uint4*>(ct.x + (step * kNqStepWords + quad_lane) * kCodesPerWord);
    WaitCopies<kStages - 1>();  // this step's codes have landed
    const uint4* src = my_ring + stage * kStageStride;
    const uint4 b_lo = src[0], b_hi = src[kWarpSize];
    if (ct.four_bit) {
      const uint4 r_lo = src[2 * kWarpSize], r_hi = src[3 * kWarpSize];
#pragma unroll
      for (int q = 0; q < kWordsPerLane; ++q) {
        const uint4 x0 = __ldg(xv + 8 * q), x1 = __ldg(xv + 8 * q + 1);
        __half2 lo[kPairsPerWord], hi[kPairsPerWord];
        DecodeWord4(t4, Word(b_lo, q), Word(r_lo, q), lo);
        DecodeWord4(t4, Word(b_hi, q), Word(r_hi, q), hi);
        MmaWord(acc, lo, hi, x0, x1);
      }
    } else if (ct.even_grid) {
#pragma unroll
      for (int q = 0; q < kWordsPerLane; ++q) {
        const uint4 x0 = __ldg(xv + 8 * q), x1 = __ldg(xv + 8 * q + 1);
        __half2 lo[kPairsPerWord], hi[kPairsPerWord];
        DecodeWord2EvenGrid(Word(b_lo, q), lo);
        DecodeWord2EvenGrid(Word(b_hi, q), hi);
        MmaWord(acc, lo, hi, x0, x1);
      }
    } else {
#pragma unroll
      for (int q = 0; q < kWordsPerLane; ++q) {
        const uint4 x0 = __ldg(xv + 8 * q), x1 = __ldg(xv + 8 * q + 1);
        __half2 lo[kPairsPerWord], hi[kPairsPerWord];
        DecodeWord2(t2, Word(b_lo, q), lo);
        DecodeWord2(t2, Word(b_hi, q), hi);
        MmaWord(acc, lo, hi, x0, x1);
      }
    }
    }
    stage = stage + 1 == kStages ? 0 : stage + 1;
    if (++step == steps || idx + 1 == end) {
      flush();
      if (idx + 1 < end) {
        step = 0;
        ++tile;
        enter_tile();
      }
    }
  }
}

template <bool kWide, bool kTrellis, bool kFull = false>
absl::Status Launch(const NqGemvParams& g, const LaunchContext& ctx) {
  int device = 0, sms = 0;
  NQ_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  NQ_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const std::size_t smem = static_cast<std::size_t>(kWarps) * kRingUint4PerWarp * sizeof(uint4);
  NQ_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(NqGemvKernel<kWide, kTrellis, kFull>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  // Programmatic dependent launch: the kernel may start while the preparation kernel before it
  // runs (that kernel signals at its start), and waits for its results in-kernel.
  RETURN_IF_ERROR(LaunchProgrammaticDependent(NqGemvKernel<kWide, kTrellis, kFull>,
                                              dim3(static_cast<unsigned>(sms * kBlocksPerSm)), dim3(kThreads), smem,
                                              ctx, g));
  return CheckLaunch("NqGemvKernel");
}

}  // namespace

absl::Status LaunchNqGemv(const NqGemvParams& g, const LaunchContext& ctx) {
  if (g.p.tokens > kNqMaxDecodeTokens || g.p.tokens * g.p.top_k > kNqMaxDecodeAssignments) {
    return absl::InvalidArgumentError("NqGemv: chunk larger than the decode path takes");
  }
  if (g.p.codec == NqCodec::kTrellis) {
    if (g.rows % kMmaRows != 0 || g.cols % kMmaRows != 0) {
      return absl::InvalidArgumentError("NqGemv: trellis_v1 rows and columns must be whole 16 x 16 tiles");
    }
    return Launch<true, true>(g, ctx);
  }
  // nested_scalar_v1 at whole steps (every real model's shapes): register slots, not the ring
  // (6-23 % faster on the H200, bench/README.md).
  if (g.cols % kNqStepCodes == 0) return LaunchNqGemvBatched(g, ctx);
  if (g.cols % (kCodesPerWord * 4) == 0) return Launch<true, false>(g, ctx);
  return Launch<false, false>(g, ctx);
}

}  // namespace nq::kernels::cuda
