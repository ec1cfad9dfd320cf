#include "kernels/cuda/nq_moe_prefill.cuh"

#include <cuda_fp16.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/nq_moe_low_rank.cuh"
#include "kernels/cuda/nq_moe_vector.cuh"
#include "kernels/cuda/trellis_tile.cuh"
#include "kernels/nq_moe.h"
#include "services/common/status_macros.h"

namespace nq::kernels::cuda {
namespace {

// A block computes a 64-token x 64-row tile of one expert with 4 warps (2 x 2, 32 x 32 each) of
// m16n8k16 fp16 MMAs, stepping K by 32. Shared rows are padded to 40 fp16 (80 bytes) so the
// 32-bit fragment loads of a warp hit 32 distinct banks.
constexpr int kTileM = 64;
constexpr int kTileN = 64;
constexpr int kTileK = 32;
constexpr int kGemmThreads = 128;
constexpr int kSmemStride = kTileK + 8;
constexpr int kCodesPerWord = 16;
constexpr int kGroupThreads = 1024;

struct GroupParams {
  const std::int32_t* ids = nullptr;
  int assignments = 0;
  int num_experts = 0;
  int* counts = nullptr;   // [E]
  int* offsets = nullptr;  // [E]
  int* order = nullptr;    // [assignments]: assignment indices grouped by expert
};

// Counting sort of the chunk's assignments by expert (ids outside [0, E) are left out). The
// order inside a group is whatever the atomics give: each assignment's rows are computed and
// written independently, so results do not depend on it.
__global__ void __launch_bounds__(kGroupThreads) NqGroupKernel(const __grid_constant__ GroupParams g) {
  extern __shared__ int group_smem[];
  int* count = group_smem;
  int* cursor = group_smem + g.num_experts;
  for (int e = threadIdx.x; e < g.num_experts; e += blockDim.x) count[e] = 0;
  __syncthreads();
  for (int a = threadIdx.x; a < g.assignments; a += blockDim.x) {
    const int e = g.ids[a];
    if (e >= 0 && e < g.num_experts) atomicAdd(&count[e], 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int running = 0;
    for (int e = 0; e < g.num_experts; ++e) {
      g.offsets[e] = running;
      g.counts[e] = count[e];
      cursor[e] = running;
      running += count[e];
    }
  }
  __syncthreads();
  for (int a = threadIdx.x; a < g.assignments; a += blockDim.x) {
    const int e = g.ids[a];
    if (e >= 0 && e < g.num_experts) g.order[atomicAdd(&cursor[e], 1)] = a;
  }
}

struct GemmParams {
  NqMoeParams p;
  NqProjectionView proj[2];
  int num_proj = 1;
  int rows = 0;  // rows of each projection
  int cols = 0;
  int tiles_per_proj = 0;
  const float* in = nullptr;  // input rows, `cols` wide: in[a] or in[a / K]
  bool in_per_assignment = false;
  float* out = nullptr;  // out[a * out_stride + proj * rows + row]
  std::int64_t out_stride = 0;
  const int* counts = nullptr;
  const int* offsets = nullptr;
  const int* order = nullptr;
};

__device__ __forceinline__ std::uint32_t PackHalf(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const std::uint32_t*>(&v);
}

__device__ __forceinline__ std::uint32_t HalfBits(__half2 v) { return *reinterpret_cast<const std::uint32_t*>(&v); }

__device__ __forceinline__ void Mma(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

using SmemTile = __half[kTileM][kSmemStride];

// 16 consecutive inputs of one A row times the expert's column scales and `gain`, as fp16.
__device__ __forceinline__ void LoadInputs(const float* x, const float* cs, float gain, std::uint32_t* dst) {
#pragma unroll
  for (int i = 0; i < 16; i += 4) {
    const float4 v = *reinterpret_cast<const float4*>(x + i);
    const float4 c = *reinterpret_cast<const float4*>(cs + i);
    dst[i / 2] = PackHalf(v.x * c.x * gain, v.y * c.y * gain);
    dst[i / 2 + 1] = PackHalf(v.z * c.z * gain, v.w * c.w * gain);
  }
}

// acc += A (64 tokens x 32 k) * B^T (64 rows x 32 k) of one k step, the warp's 32 x 32 share.
__device__ __forceinline__ void MmaStep(const SmemTile& a_tile, const SmemTile& b_tile, int wm, int wn, int group,
                                        int quad, float (&acc)[2][4][4]) {
#pragma unroll
  for (int ks = 0; ks < kTileK; ks += 16) {
    std::uint32_t a[2][4];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
      const int r = wm * 32 + mi * 16 + group;
      a[mi][0] = *reinterpret_cast<const std::uint32_t*>(&a_tile[r][ks + quad * 2]);
      a[mi][1] = *reinterpret_cast<const std::uint32_t*>(&a_tile[r + 8][ks + quad * 2]);
      a[mi][2] = *reinterpret_cast<const std::uint32_t*>(&a_tile[r][ks + quad * 2 + 8]);
      a[mi][3] = *reinterpret_cast<const std::uint32_t*>(&a_tile[r + 8][ks + quad * 2 + 8]);
    }
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
      const int c = wn * 32 + ni * 8 + group;
      const std::uint32_t b0 = *reinterpret_cast<const std::uint32_t*>(&b_tile[c][ks + quad * 2]);
      const std::uint32_t b1 = *reinterpret_cast<const std::uint32_t*>(&b_tile[c][ks + quad * 2 + 8]);
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) Mma(acc[mi][ni], a[mi], b0, b1);
    }
  }
}

// The codecs as policies of one GEMM (FlashInfer-style variants, not copied kernels). Each
// dequantises B (64 weight rows x 32 k, without row and column scales: columns go into A, rows
// into the epilogue) into one or two planes of products:
//   nested_scalar_v1  one plane: B = level of (base, residual) code, fp16 (the levels are fp16
//                     values, nested_codebook.h), A = x * cs.
//   trellis_v1        B = S - 510 of the base (plane 0) and, at 4 bits, residual (plane 1) tile
//                     rows, exact in fp16 (trellis_tile.cuh); A = x * cs * gain of the plane's
//                     column block; 1/147.8005 in the epilogue. Weights stay exact, so a 4-bit
//                     tile costs two MMAs rather than a rounded fp16 sum of two gained terms.
struct ScalarCodes {
  static constexpr int kPlanes = 1;
  static constexpr float kEpilogueScale = 1.0f;
};
struct TrellisCodes {
  static constexpr int kPlanes = 2;
  static constexpr float kEpilogueScale = trellis::kInvByteSumSd;
};

template <class Codes>
__global__ void __launch_bounds__(kGemmThreads) NqGroupGemmKernel(const __grid_constant__ GemmParams g) {
  constexpr bool kTrellis = Codes::kPlanes == 2;
  __shared__ __align__(16) SmemTile a_tile[Codes::kPlanes];
  __shared__ __align__(16) SmemTile b_tile[Codes::kPlanes];
  __shared__ float levels[kNqLevelTable];
  __shared__ int tile_assignment[kTileM];
  const int e = blockIdx.x;
  const int n_e = g.counts[e];
  const int m0 = blockIdx.z * kTileM;
  if (m0 >= n_e) return;
  const int proj = blockIdx.y / g.tiles_per_proj;
  const int n0 = (blockIdx.y % g.tiles_per_proj) * kTileN;
  const NqProjectionView& P = g.proj[proj];
  const int slot = g.p.slot_of_expert[e];
  const bool four_bit = g.p.arena != nullptr && slot >= 0 && slot < g.p.num_slots;
  const int planes = kTrellis && four_bit ? 2 : 1;
  const int tid = threadIdx.x;
  if (!kTrellis && tid < kNqLevelTable) levels[tid] = P.levels[static_cast<std::int64_t>(e) * kNqLevelTable + tid];
  if (tid < kTileM) tile_assignment[tid] = m0 + tid < n_e ? g.order[g.offsets[e] + m0 + tid] : -1;
  __syncthreads();

  const int words_per_row = g.cols / kCodesPerWord;
  const std::int64_t plane_words = static_cast<std::int64_t>(g.rows) * words_per_row;
  const std::uint32_t* base = reinterpret_cast<const std::uint32_t*>(P.base) + e * plane_words;
  const std::uint32_t* residual =
      four_bit ? reinterpret_cast<const std::uint32_t*>(NqSlotRecord(g.p, slot) + P.residual_offset)
               : nullptr;
  const float* cs = P.col_scales + static_cast<std::int64_t>(e) * g.cols;
  const int K = static_cast<int>(g.p.top_k);

  // Loader roles: a thread fills 16 consecutive k of one A row and of one B row (16 codes: one
  // word of a row-major scalar plane, one tile row of one column block of a trellis plane).
  const int load_row = tid >> 1, load_k = (tid & 1) * 16;
  const int a_row = tile_assignment[load_row];
  const float* a_src = a_row < 0 ? nullptr
                                 : g.in + static_cast<std::int64_t>(g.in_per_assignment ? a_row : a_row / K) * g.cols;
  const int b_row = n0 + load_row;
  const std::int64_t b_word0 = static_cast<std::int64_t>(b_row) * words_per_row + (load_k / kCodesPerWord);
  // Trellis: word of tile (b_row / 16, 0) holding row b_row % 16's states (and the one before).
  const int blocks = g.cols / trellis::kTileDim;
  const std::int64_t tile_row_word0 = static_cast<std::int64_t>(b_row / trellis::kTileDim) * blocks * trellis::kTileWords;
  const int tile_r = b_row % trellis::kTileDim;
  const float* gains = kTrellis ? P.gains + static_cast<std::int64_t>(e) * blocks * kNqGainsPerBlock : nullptr;

  const int warp = tid / 32, lane = tid % 32;
  const int wm = warp / 2, wn = warp % 2;
  const int group = lane >> 2, quad = lane & 3;
  float acc[2][4][4] = {};

  for (int k0 = 0; k0 < g.cols; k0 += kTileK) {
    const int k = k0 + load_k;
    for (int plane = 0; plane < planes; ++plane) {
      // A: the tokens' inputs with the expert's column scales (and a trellis plane's gain).
      std::uint32_t* a_dst = reinterpret_cast<std::uint32_t*>(&a_tile[plane][load_row][load_k]);
      const float gain = kTrellis ? gains[(k / trellis::kTileDim) * kNqGainsPerBlock + plane] : 1.0f;
      if (a_src != nullptr) {
        LoadInputs(a_src + k, cs + k, gain, a_dst);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) a_dst[i] = 0;
      }
      std::uint32_t* b_dst = reinterpret_cast<std::uint32_t*>(&b_tile[plane][load_row][load_k]);
      if constexpr (kTrellis) {
        // B: tile row tile_r of the column block at k, S - 510 exact (trellis_tile.cuh).
        const std::uint32_t* tile = (plane == 0 ? base : residual) + tile_row_word0 +
                                    static_cast<std::int64_t>(k / trellis::kTileDim) * trellis::kTileWords;
        __half2 row[8];
        trellis::TileRow(tile[(tile_r + trellis::kTileWords - 1) % trellis::kTileWords], tile[tile_r], row);
#pragma unroll
        for (int i = 0; i < 8; ++i) b_dst[i] = HalfBits(row[i]);
      } else {
        // B: 16 codes of one weight row, dequantised to fp16 levels.
        const std::uint32_t wb = base[b_word0 + k0 / kCodesPerWord];
        const std::uint32_t wr = four_bit ? residual[b_word0 + k0 / kCodesPerWord] : 0u;
#pragma unroll
        for (int i = 0; i < 16; i += 2) {
          const int b0 = (wb >> (2 * i)) & 3, b1 = (wb >> (2 * i + 2)) & 3;
          float v0, v1;
          if (four_bit) {
            v0 = levels[kNqBaseLevels + 4 * b0 + ((wr >> (2 * i)) & 3)];
            v1 = levels[kNqBaseLevels + 4 * b1 + ((wr >> (2 * i + 2)) & 3)];
          } else {
            v0 = levels[b0];
            v1 = levels[b1];
          }
          b_dst[i / 2] = PackHalf(v0, v1);
        }
      }
    }
    __syncthreads();
    for (int plane = 0; plane < planes; ++plane) MmaStep(a_tile[plane], b_tile[plane], wm, wn, group, quad, acc);
    __syncthreads();
  }

  const float* rs = P.row_scales + static_cast<std::int64_t>(e) * g.rows;
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int a = tile_assignment[wm * 32 + mi * 16 + group + half * 8];
      if (a < 0) continue;
      float* out = g.out + static_cast<std::int64_t>(a) * g.out_stride + static_cast<std::int64_t>(proj) * g.rows;
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        const int n = n0 + wn * 32 + ni * 8 + quad * 2;
        out[n] = acc[mi][ni][half * 2] * (rs[n] * Codes::kEpilogueScale);
        out[n + 1] = acc[mi][ni][half * 2 + 1] * (rs[n + 1] * Codes::kEpilogueScale);
      }
    }
  }
}

struct Workspace {
  NqVectorParams v;
  int* counts = nullptr;
  int* offsets = nullptr;
  int* order = nullptr;
};

Workspace Carve(const NqMoeParams& p, void* workspace) {
  const std::int64_t C = kNqPrefillChunk, K = p.top_k, D = p.hidden, I = p.intermediate;
  Workspace w;
  w.v.p = p;
  w.v.xr = static_cast<float*>(workspace);
  w.v.hg = w.v.xr + C * D;
  w.v.hh = w.v.hg + C * K * 2 * I;
  w.v.yd = w.v.hh + C * K * I;
  w.counts = reinterpret_cast<int*>(w.v.yd + C * K * D);
  w.offsets = w.counts + p.num_experts;
  w.order = w.offsets + p.num_experts;
  return w;
}

absl::Status LaunchGemm(const GemmParams& g, std::int64_t tokens, const LaunchContext& ctx) {
  const dim3 grid(static_cast<unsigned>(g.p.num_experts), static_cast<unsigned>(g.num_proj * g.tiles_per_proj),
                  static_cast<unsigned>((tokens + kTileM - 1) / kTileM));
  if (g.p.codec == NqCodec::kTrellis) {
    NqGroupGemmKernel<TrellisCodes><<<grid, kGemmThreads, 0, ctx.stream>>>(g);
    return CheckLaunch("NqGroupGemmKernel<TrellisCodes>");
  }
  NqGroupGemmKernel<ScalarCodes><<<grid, kGemmThreads, 0, ctx.stream>>>(g);
  return CheckLaunch("NqGroupGemmKernel<ScalarCodes>");
}

absl::Status LaunchChunk(const NqMoeParams& p, void* workspace, const LaunchContext& ctx) {
  Workspace w = Carve(p, workspace);
  const std::int64_t T = p.tokens, K = p.top_k, D = p.hidden, I = p.intermediate, E = p.num_experts;
  RETURN_IF_ERROR(LaunchNqRotateInput(w.v, ctx));
  RETURN_IF_ERROR(LaunchNqGroupByExpert(p.expert_ids, static_cast<int>(T * K), static_cast<int>(E), w.counts,
                                        w.offsets, w.order, ctx));
  GemmParams gate_up{.p = p,
                     .proj = {p.gate, p.up},
                     .num_proj = 2,
                     .rows = static_cast<int>(I),
                     .cols = static_cast<int>(D),
                     .tiles_per_proj = static_cast<int>(I / kTileN),
                     .in = w.v.xr,
                     .in_per_assignment = false,
                     .out = w.v.hg,
                     .out_stride = 2 * I,
                     .counts = w.counts,
                     .offsets = w.offsets,
                     .order = w.order};
  RETURN_IF_ERROR(LaunchGemm(gate_up, T, ctx));
  // Low-rank corrections (nq_moe_low_rank.cuh) on the GEMMs' fp32 outputs, from xr and hh.
  RETURN_IF_ERROR(LaunchNqLowRankGateUp(p, w.v.xr, w.v.hg, ctx));
  RETURN_IF_ERROR(LaunchNqSwiglu(w.v, ctx));
  GemmParams down = gate_up;
  down.proj[0] = down.proj[1] = p.down;
  down.num_proj = 1;
  down.rows = static_cast<int>(D);
  down.cols = static_cast<int>(I);
  down.tiles_per_proj = static_cast<int>(D / kTileN);
  down.in = w.v.hh;
  down.in_per_assignment = true;
  down.out = w.v.yd;
  down.out_stride = D;
  RETURN_IF_ERROR(LaunchGemm(down, T, ctx));
  RETURN_IF_ERROR(LaunchNqLowRankDown(p, w.v.hh, w.v.yd, ctx));
  return LaunchNqCombine(w.v, ctx);
}

}  // namespace

absl::Status LaunchNqGroupByExpert(const std::int32_t* ids, int assignments, int num_experts, int* counts,
                                   int* offsets, int* order, const LaunchContext& ctx) {
  if (num_experts > kNqMaxGroupExperts) {
    return absl::InvalidArgumentError(
        absl::StrCat("NqMoe (CUDA): ", num_experts, " experts exceed the grouping kernel's ", kNqMaxGroupExperts));
  }
  const GroupParams group{.ids = ids,
                          .assignments = assignments,
                          .num_experts = num_experts,
                          .counts = counts,
                          .offsets = offsets,
                          .order = order};
  NqGroupKernel<<<1, kGroupThreads, 2 * num_experts * sizeof(int), ctx.stream>>>(group);
  return CheckLaunch("NqGroupKernel");
}

std::size_t NqMoePrefillWorkspaceBytes(std::int64_t top_k, std::int64_t hidden, std::int64_t intermediate,
                                       std::int64_t num_experts) {
  const std::int64_t C = kNqPrefillChunk;
  const std::int64_t floats = C * hidden + C * top_k * (3 * intermediate + hidden);
  const std::int64_t ints = 2 * num_experts + C * top_k;
  return static_cast<std::size_t>(floats) * sizeof(float) + static_cast<std::size_t>(ints) * sizeof(int);
}

bool NqMoePrefillSupports(const NqMoeParams& p) {
  return p.hidden % kTileN == 0 && p.intermediate % kTileN == 0 && p.num_experts <= kNqMaxGroupExperts;
}

absl::Status LaunchNqMoePrefill(const NqMoeParams& p, void* workspace, std::size_t workspace_bytes,
                                const LaunchContext& ctx) {
  const std::int64_t D = p.hidden, I = p.intermediate;
  if (D % kTileN != 0 || I % kTileN != 0 || p.num_experts > kNqMaxGroupExperts) {
    return absl::InvalidArgumentError(absl::StrCat("NqMoe prefill (CUDA): hidden ", D, " and intermediate ", I,
                                                   " must be multiples of ", kTileN, ", experts at most ",
                                                   kNqMaxGroupExperts));
  }
  if (workspace_bytes < NqMoePrefillWorkspaceBytes(p.top_k, D, I, p.num_experts) ||
      reinterpret_cast<std::uintptr_t>(workspace) % 16 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("NqMoe prefill (CUDA): workspace of ", workspace_bytes,
                                                   " bytes, need ",
                                                   NqMoePrefillWorkspaceBytes(p.top_k, D, I, p.num_experts)));
  }
  for (std::int64_t t0 = 0; t0 < p.tokens; t0 += kNqPrefillChunk) {
    RETURN_IF_ERROR(LaunchChunk(NqMoeTokenChunk(p, t0, std::min(kNqPrefillChunk, p.tokens - t0)), workspace, ctx));
  }
  return absl::OkStatus();
}

}  // namespace nq::kernels::cuda
