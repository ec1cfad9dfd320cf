#include "kernels/cuda/mla_decode.cuh"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/kv_fp8.cuh"
#include "kernels/cuda/launch_dependent.cuh"
#include "kernels/cuda/load.cuh"
#include "kernels/cuda/reduce.cuh"
#include "services/common/status_macros.h"

namespace nq::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kKeyTile = 32;        // keys per pipeline stage: 4 MMA column tiles of 8
// The split kernel runs one 16-warp block per SM (its tiles fill shared memory): the scores of a
// tile are 4 column tiles x 4 slices of the d dimensions, one warp each.
constexpr int kSplitThreads = 512;
constexpr int kSplitWarps = kSplitThreads / kWarpSize;
constexpr int kQkSlices = kSplitWarps / (kKeyTile / 8);
constexpr int kPvTilesPerWarp = kMlaMaxLatent / 8 / kSplitWarps;
// absorb: a block covers 64 columns of one head (16 heads x 9 blocks at DeepSeek-V3's 576); each
// thread 8 consecutive columns (one 16-byte load of bf16) of every 32nd row of w_uk, for up to
// kAbsorbMaxTokens queries per pass (instantiated for 1, 2 and 4, so one query does not pay for
// four: ncu showed these kernels bound by instruction issue, not by their bytes).
constexpr int kAbsorbCols = 64;
constexpr int kAbsorbRowGroups = kThreads / (kAbsorbCols / 8);
constexpr int kAbsorbMaxTokens = 4;
// combine: a block covers kCols columns of O (a float4 per thread; 128, or 64 where 128 would leave
// SMs without a block: a DeepSeek-V3 rank's 16 heads filled 64 SMs, and the kernel took 6-8 us
// for 4 MB under ncu on an H100), and kThreads / (kCols / 4) groups of threads read every so
// many splits each, 8 loads in flight.
constexpr int kCombineMaxCols = 128;
template <int kCols>
constexpr int kCombineSplitGroups = kThreads / (kCols / 4);
// output (w_uv): each warp holds kRows whole rows of w_uv in registers as loaded, the queries' O in
// shared memory up to kOutputMaxTokens at a time (instantiated for 1, 2, 4 and 8 queries). kRows
// (1, 2 or 4) is chosen per launch (OutputRowsPerWarp): the most rows a warp, up to
// kOutputMaxRowsPerWarp, that still give every SM a block (a DeepSeek-V3 rank's 16 heads of 128
// rows: 1 row a warp, 256 blocks, where 4 rows left 68 SMs without one). At most 2: GLM-5's 64
// heads ran 512 blocks of 4 rows a warp at 3 an SM (1.3 waves, and 80 registers that spilled
// with 4 or 8 queries); 1024 blocks of 2 rows at 4 an SM were 3-6 % faster over the whole MLA
// call (H100, bench/README.md). 8 rows a warp spill within 128 registers.
constexpr int kOutputMaxRowsPerWarp = 2;
// Blocks per SM for kRows rows a warp: their registers (kRows * kLoads uint4) plus about 40 more.
template <typename UvT, int kRows>
constexpr int kOutputBlocksPerSm = kRows * kMlaMaxLatent / kVec16<UvT> / kWarpSize * 4 >= 64   ? 2
                                   : kRows * kMlaMaxLatent / kVec16<UvT> / kWarpSize * 4 >= 32 ? 3
                                                                                                 : 4;
constexpr int kOutputMaxTokens = 8;

// The instantiation for `tokens` queries: the smallest of 1, 2, 4, 8 that holds them, capped at
// `most` (more queries run in passes of `most`).
inline int TokensPerPass(int tokens, int most) {
  int n = 1;
  while (n < tokens && n < most) n *= 2;
  return n;
}

__device__ __forceinline__ void PrefetchL2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// Shared-memory row strides, in elements. d + 8 keeps rows 16-byte aligned (cp.async) and moves
// consecutive rows 8 words apart (fp32) / 4 words apart (bf16), so the fragment loads of a
// warp's 8 row groups land on distinct banks.
__host__ __device__ constexpr int QStride(int d) { return d + 8; }
__host__ __device__ constexpr int KvStride(int d) { return d + 8; }
constexpr int kPStride = kKeyTile + 8;

struct SplitArgs {
  MlaAttentionParams p;
  int head_groups = 0;
  int splits = 0;
  std::uint16_t* q = nullptr;  // [tokens][head_groups][hi, lo][16][QStride] bf16 bits
  float* partial = nullptr;    // [tokens][head_groups][splits][16][c]
  float* row_max = nullptr;    // [tokens][head_groups][splits][16]
  float* row_sum = nullptr;    // same
  float* o = nullptr;          // [tokens][heads][c]: the merged, normalised latent output
};

// Key tiles in flight per block: as many as the same shared memory holds (an fp32 tile is 74 KB
// at DeepSeek-V3's d = 576, a bf16 one 37 KB, an FP8 one 21 KB beside the 37 KB bf16 tile it is
// unpacked into). One block per SM keeps only these in flight, so more stages is more bandwidth.
template <typename KvT>
constexpr int kStages = std::is_same_v<KvT, float> ? 2 : 4;

// FP8 rows (KvFp8) are copied as they are stored, the packed latent row then the BF16 rope key,
// and unpacked per tile into a bf16 tile: E4M3 codes are exact bf16 values, so the MMAs run as on
// a BF16 cache (two per product) and the scales (one per key per 128 latent values) are applied
// outside them: to each 128-wide slice of a score's sum, and to P before it meets V's slice. The
// result is the CPU's sum over float(code) * scale up to fp32 rounding.
template <typename KvT>
constexpr bool kFp8Rows = std::is_same_v<KvT, KvFp8>;
template <typename KvT>
using UnpackedT = std::conditional_t<kFp8Rows<KvT>, Bf16, KvT>;
constexpr int kMaxScaleTiles = kMlaMaxLatent / static_cast<int>(kKvFp8Tile);
__host__ __device__ constexpr int Fp8StageBytes(int c, int dr) {
  return static_cast<int>(KvFp8RowBytes(c)) + 2 * dr;  // both multiples of 16
}

// The key tiles' shared memory: the stages, and for FP8 rows the bf16 tile they unpack into,
// the keys' scales and P times each scale tile's scales as bf16 hi and lo.
template <typename KvT>
__host__ __device__ constexpr std::size_t TileRegionBytes(int c, int dr) {
  if constexpr (kFp8Rows<KvT>) {
    return std::size_t{kStages<KvT>} * kKeyTile * Fp8StageBytes(c, dr) + sizeof(Bf16) * kKeyTile * KvStride(c + dr) +
           sizeof(float) * kKeyTile * kMaxScaleTiles +
           sizeof(std::uint16_t) * 2 * kMaxScaleTiles * kMlaHeadGroup * kPStride;
  } else {
    return sizeof(KvT) * kStages<KvT> * kKeyTile * KvStride(c + dr);
  }
}

template <typename KvT>
std::size_t SplitSharedBytes(int c, int dr) {
  const int d = c + dr;
  return sizeof(std::uint16_t) * 2 * kMlaHeadGroup * QStride(d) +     // q hi, lo
         TileRegionBytes<KvT>(c, dr) +                                  // the key tiles
         sizeof(float) * (kQkSlices + 1) * kMlaHeadGroup * kPStride +  // score slices, P
         sizeof(float) * 3 * kMlaHeadGroup + sizeof(int) * kStages<KvT> * kKeyTile;  // row stats, validity
}

// bf16 hi + lo of two floats, packed as an MMA operand register (element 0 in the low half).
__device__ __forceinline__ void Split(float a, float b, std::uint32_t& hi, std::uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  const float2 hf = __bfloat1622float2(h);
  const __nv_bfloat162 l = __floats2bfloat162_rn(a - hf.x, b - hf.y);
  hi = *reinterpret_cast<const std::uint32_t*>(&h);
  lo = *reinterpret_cast<const std::uint32_t*>(&l);
}

__device__ __forceinline__ void Mma(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                    std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 b16 matrices from shared memory in one instruction: lanes 8m..8m+7 give the row
// addresses of matrix m (16-byte aligned), register m receives it as an MMA fragment register (lane
// 4g + qd: row g, elements 2qd and 2qd + 1). With `.trans` each matrix arrives transposed (lane
// 4g + qd: rows 2qd and 2qd + 1 of column g), which turns key-major V rows into B fragments.
__device__ __forceinline__ void LoadMatrices(std::uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(static_cast<std::uint32_t>(__cvta_generic_to_shared(row))));
}
__device__ __forceinline__ void LoadMatricesTransposed(std::uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(static_cast<std::uint32_t>(__cvta_generic_to_shared(row))));
}
// The A fragment (16 x 16, row-major, `stride` elements a row) at column k0 of `a`: lanes 0-15
// address rows 0-15 at k0, lanes 16-31 the same rows at k0 + 8 (a0..a3 as mma.m16n8k16 wants them).
__device__ __forceinline__ void LoadAFragment(std::uint32_t (&r)[4], const std::uint16_t* a, int stride, int k0,
                                              int lane) {
  LoadMatrices(r, a + (lane % 16) * stride + k0 + (lane / 16) * 8);
}

__device__ __forceinline__ void CopyAsync16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(
                   static_cast<std::uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void CommitCopies() { asm volatile("cp.async.commit_group;"); }
template <int kPending>
__device__ __forceinline__ void WaitCopies() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending));
}

// Programmatic dependent launch (Launch below, launch_dependent.cuh): each kernel lets the next
// one's blocks start at once, and the next one does its independent prologue (its first key tile,
// its w_uv rows) before waiting for this one's results.

// 8 weights of w_uk at `w` (16-byte aligned) as floats.
__device__ __forceinline__ void Load8(const float* w, float (&out)[8]) {
  Load16B(w, out);
  Load16B(w + 4, out + 4);
}
__device__ __forceinline__ void Load8(const Bf16* w, float (&out)[8]) { Load16B(w, out); }

// grid: (head_groups * 16, ceil((c + dr) / kAbsorbCols)). Column `col` of head h's query row:
// scale * (q_nope · w_uk[h])[col] for col < c, scale * q_pe[col - c] after; heads past `heads`
// (the last group's padding) are zero. Thread (row group rg, column group cg) sums rows
// rg, rg + kAbsorbRowGroups, ... of columns 8 cg..8 cg + 7; the row groups meet in shared memory.
// kTokens: queries per pass. Launched as a programmatic dependent: the thread's rows of w_uk (a
// constant) are pulled into L2 while the kernel before it finishes.
template <typename UkT, int kTokens>
__global__ void __launch_bounds__(kThreads) MlaAbsorbKernel(const __grid_constant__ SplitArgs a) {
  const MlaAttentionParams& p = a.p;
  __shared__ float partial[kAbsorbRowGroups][kTokens][kAbsorbCols];
  extern __shared__ float q_nope[];  // [kTokens][dn] of this head
  LetDependentsLaunch();
  const int d = p.c + p.dr, qs = QStride(d);
  const int h = blockIdx.x;
  const int cg = threadIdx.x % (kAbsorbCols / 8), rg = threadIdx.x / (kAbsorbCols / 8);
  const int col0 = static_cast<int>(blockIdx.y) * kAbsorbCols;
  const int my_col = col0 + 8 * cg;  // c % 16 == 0: a group is wholly inside [0, c) or past it
  const bool real_head = h < p.heads;
  const bool reads = real_head && my_col < p.c;
  const bool any_reads = real_head && col0 < p.c;  // uniform over the block
  const UkT* w = static_cast<const UkT*>(p.w_uk) + std::int64_t{h} * p.dn * p.c + my_col;
  if (reads) {
    for (int j = rg; j < p.dn; j += kAbsorbRowGroups) PrefetchL2(w + std::int64_t{j} * p.c);
  }
  WaitForPrerequisiteGrid();
  for (int t0 = 0; t0 < p.tokens; t0 += kTokens) {
    const int n = min(kTokens, p.tokens - t0);
    if (any_reads) {
      for (int i = threadIdx.x; i < kTokens * p.dn; i += kThreads) {
        const int k = i / p.dn;
        q_nope[i] = k < n ? __ldg(p.q_nope + (std::int64_t{t0 + k} * p.heads + h) * p.dn + i % p.dn) : 0.0f;
      }
      __syncthreads();
    }
    float acc[kTokens][8] = {};
    if (reads) {
#pragma unroll 4
      for (int j = rg; j < p.dn; j += kAbsorbRowGroups) {
        float wv[8];
        Load8(w + std::int64_t{j} * p.c, wv);
#pragma unroll
        for (int k = 0; k < kTokens; ++k) {
          const float q = q_nope[k * p.dn + j];
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[k][e] = fmaf(q, wv[e], acc[k][e]);
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kTokens; ++k) {
#pragma unroll
      for (int e = 0; e < 8; ++e) partial[rg][k][8 * cg + e] = acc[k][e];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n * kAbsorbCols; i += kThreads) {
      const int k = i / kAbsorbCols, col = col0 + i % kAbsorbCols;
      if (col >= d) continue;
      const int t = t0 + k;
      float v = 0.0f;
      if (real_head && col < p.c) {
        for (int r = 0; r < kAbsorbRowGroups; ++r) v += partial[r][k][i % kAbsorbCols];
        v *= p.scale;
      } else if (real_head) {
        v = __ldg(p.q_pe + (std::int64_t{t} * p.heads + h) * p.dr + (col - p.c)) * p.scale;
      }
      const __nv_bfloat16 hi = __float2bfloat16_rn(v);
      const __nv_bfloat16 lo = __float2bfloat16_rn(v - __bfloat162float(hi));
      std::uint16_t* row = a.q + ((std::int64_t{t} * a.head_groups + h / kMlaHeadGroup) * 2 * kMlaHeadGroup +
                                  h % kMlaHeadGroup) * qs + col;
      row[0] = __bfloat16_as_ushort(hi);
      row[kMlaHeadGroup * qs] = __bfloat16_as_ushort(lo);
    }
    __syncthreads();  // `partial` and `q_nope` are rewritten by the next batch of queries
  }
}

// grid: (splits, head_groups, tokens). See the header; the fragment layouts are those of
// mma.m16n8k16 (PTX ISA): lane = 4 * g + qd holds A rows g and g + 8, columns 2qd.. and
// 2qd + 8..; B column g, rows 2qd.. and 2qd + 8..; C rows g and g + 8, columns 2qd, 2qd + 1.
//
// KvT float: the cache's values are split into bf16 hi + lo like the queries' (three MMAs per
// product). KvT Bf16: the cache values are exact bf16 operands (two MMAs: q hi and q lo). KvT
// KvFp8: packed rows, unpacked per tile into bf16 codes and scales (kFp8Rows).
template <typename KvT>
__global__ void __launch_bounds__(kSplitThreads, 1) MlaSplitKernel(const __grid_constant__ SplitArgs a) {
  using TileT = UnpackedT<KvT>;
  constexpr bool kFp8 = kFp8Rows<KvT>;
  constexpr bool kF32 = std::is_same_v<TileT, float>;
  constexpr int kChunk = 16 / static_cast<int>(sizeof(TileT));  // cache elements per cp.async (not FP8)
  const MlaAttentionParams& p = a.p;
  extern __shared__ __align__(16) unsigned char smem[];
  const int d = p.c + p.dr, qs = QStride(d), ks = KvStride(d);
  std::uint16_t* q_hi = reinterpret_cast<std::uint16_t*>(smem);  // [16][qs]
  std::uint16_t* q_lo = q_hi + kMlaHeadGroup * qs;                 // [16][qs]
  unsigned char* tile_region = reinterpret_cast<unsigned char*>(q_lo + kMlaHeadGroup * qs);
  // Not FP8: kv holds the stages, [kStages][kKeyTile][ks]. FP8: `stage` holds them,
  // [kStages][kKeyTile][stage_bytes], kv is the one bf16 tile they are unpacked into, key_scale
  // [kKeyTile][kMaxScaleTiles] their scales, p_hi and p_lo [kMaxScaleTiles][16][kPStride] P
  // times each scale tile's scales.
  const int stage_bytes = Fp8StageBytes(p.c, p.dr);
  const int scale_tiles = static_cast<int>(KvFp8Tiles(p.c));  // c % 16 == 0: a 16-wide step is in one
  std::uint8_t* stage = kFp8 ? reinterpret_cast<std::uint8_t*>(tile_region) : nullptr;
  TileT* kv = reinterpret_cast<TileT*>(kFp8 ? tile_region + std::size_t{kStages<KvT>} * kKeyTile * stage_bytes
                                            : tile_region);
  float* key_scale = reinterpret_cast<float*>(kv + kKeyTile * ks);
  std::uint16_t* p_hi = reinterpret_cast<std::uint16_t*>(key_scale + kKeyTile * kMaxScaleTiles);
  std::uint16_t* p_lo = p_hi + kMaxScaleTiles * kMlaHeadGroup * kPStride;
  float* s_part = reinterpret_cast<float*>(tile_region + TileRegionBytes<KvT>(p.c, p.dr));  // [kQkSlices][16][kPStride]
  float* prob = s_part + kQkSlices * kMlaHeadGroup * kPStride;      // [16][kPStride] floats' room
  // Not FP8: P as the PV product's A operand, bf16 hi and lo [16][kPStride] each, split once by
  // the softmax (FP8 keeps P times each scale tile's scales in p_hi and p_lo instead).
  std::uint16_t* pa_hi = reinterpret_cast<std::uint16_t*>(prob);
  std::uint16_t* pa_lo = pa_hi + kMlaHeadGroup * kPStride;
  float* row_max = prob + kMlaHeadGroup * kPStride;                 // [16]
  float* row_sum = row_max + kMlaHeadGroup;                         // [16]
  float* row_corr = row_sum + kMlaHeadGroup;                        // [16]
  int* tile_valid = reinterpret_cast<int*>(row_corr + kMlaHeadGroup);  // [kStages][kKeyTile]

  const int tid = threadIdx.x, warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int g = lane / 4, qd = lane % 4;
  const int split = blockIdx.x, hg = blockIdx.y, t = blockIdx.z;
  const int pos = (p.position != nullptr ? *p.position : p.start_pos) + t;  // the bound sized the grid
  const std::int32_t* selected = p.selected != nullptr ? p.selected + std::int64_t{t} * p.top_k : nullptr;
  const std::int64_t candidates = selected != nullptr ? p.top_k : pos + 1;
  const std::int64_t tiles = (candidates + kKeyTile - 1) / kKeyTile;
  const std::int64_t tile_begin = split * tiles / a.splits;
  const std::int64_t tile_end = (split + 1) * tiles / a.splits;
  const std::int64_t stats = ((std::int64_t{t} * a.head_groups + hg) * a.splits + split) * kMlaHeadGroup;
  LetDependentsLaunch();
  if (tile_begin == tile_end) {
    WaitForPrerequisiteGrid();  // no keys here: no weight in the merge, and zeros (not garbage) to add
    if (tid < kMlaHeadGroup) {
      a.row_max[stats + tid] = -INFINITY;
      a.row_sum[stats + tid] = 0.0f;
    }
    for (int i = tid; i < kMlaHeadGroup * p.c; i += kSplitThreads) a.partial[stats * p.c + i] = 0.0f;
    return;
  }

  if (tid < kMlaHeadGroup) {
    row_max[tid] = -INFINITY;
    row_sum[tid] = 0.0f;
  }

  // Warp w copies rows w, w + 8, ... of a tile; a row past the candidates, a -1 or a key past
  // the query's position is zero-filled (its probability is zero: no garbage times zero).
  // One commit group per call, empty past the split's last tile, so the wait counts below hold.
  auto issue = [&](std::int64_t tile, int buffer) {
    for (int r = warp; r < kKeyTile && tile < tile_end; r += kSplitWarps) {
      const std::int64_t candidate = tile * kKeyTile + r;
      int key = -1;
      if (candidate < candidates) {
        key = selected != nullptr ? __ldg(selected + candidate) : static_cast<int>(candidate);
        if (key > pos) key = -1;
      }
      if constexpr (kFp8) {
        // The packed row (KvFp8RowBytes, a multiple of 16) and then the BF16 rope key.
        const int row_bytes = static_cast<int>(KvFp8RowBytes(p.c));
        std::uint8_t* dst = stage + (buffer * kKeyTile + r) * stage_bytes;
        const auto* latent = static_cast<const std::uint8_t*>(p.kv_latent) + std::int64_t{max(key, 0)} * row_bytes;
        const auto* rope = static_cast<const std::uint8_t*>(p.k_pe) + std::int64_t{max(key, 0)} * p.dr * 2;
        for (int j = lane; j < stage_bytes / 16; j += kWarpSize) {
          const int e = 16 * j;
          CopyAsync16(dst + e, e < row_bytes ? latent + e : rope + (e - row_bytes), key >= 0);
        }
      } else {
        KvT* dst = kv + (buffer * kKeyTile + r) * ks;
        const KvT* latent = static_cast<const KvT*>(p.kv_latent) + std::int64_t{max(key, 0)} * p.c;
        const KvT* rope = static_cast<const KvT*>(p.k_pe) + std::int64_t{max(key, 0)} * p.dr;
        for (int j = lane; j < d / kChunk; j += kWarpSize) {
          const int e = kChunk * j;  // c and dr are multiples of 16: a chunk never straddles them
          CopyAsync16(dst + e, e < p.c ? latent + e : rope + (e - p.c), key >= 0);
        }
      }
      if (lane == 0) tile_valid[buffer * kKeyTile + r] = key >= 0;
    }
    CommitCopies();
  };

  const int pv_tiles = p.c / 8;  // O's 8-column MMA tiles; warp w owns w, w + 16, ...
  float o[kPvTilesPerWarp][4] = {};
  // The first key tile does not depend on the absorb kernel: in flight while it finishes. Then
  // the query block (hi and lo halves contiguous in scratch), which does.
  // Groups: tile 0, the query block, tiles 1 .. kStages - 2, then one per iteration.
  constexpr int kAhead = kStages<KvT> - 1;
  issue(tile_begin, 0);
  WaitForPrerequisiteGrid();
  const std::uint16_t* q_src = a.q + (std::int64_t{t} * a.head_groups + hg) * 2 * kMlaHeadGroup * qs;
  // Each row's last 16 bytes are padding (QStride) the absorb kernel never writes: zero-filled
  // here rather than copied (nothing reads them; compute-sanitizer's initcheck did).
  for (int i = tid; i < 2 * kMlaHeadGroup * qs / 8; i += kSplitThreads) {
    CopyAsync16(q_hi + 8 * i, q_src + 8 * i, i % (qs / 8) < d / 8);
  }
  CommitCopies();
  for (int s = 1; s < kAhead; ++s) issue(tile_begin + s, s);
  for (std::int64_t tile = tile_begin; tile < tile_end; ++tile) {
    const int buffer = static_cast<int>((tile - tile_begin) % kStages<KvT>);
    // Its buffer held tile - 1, consumed before the previous iteration's last barrier.
    issue(tile + kAhead, static_cast<int>((tile + kAhead - tile_begin) % kStages<KvT>));
    WaitCopies<kAhead>();  // everything but the newest kAhead groups: this tile and the queries
    __syncthreads();
    if constexpr (kFp8) {
      // Unpack the stage: 16 threads a key row, 4 codes (one word) at a time into exact bf16
      // values, the rope key's words as they are, the scales beside. A zero-filled row (no key)
      // unpacks to zeros.
      static_assert(kKeyTile * 16 == kSplitThreads);
      const int r = tid / 16, cg = tid % 16;
      const std::uint8_t* row = stage + (buffer * kKeyTile + r) * stage_bytes;
      TileT* out = kv + r * ks;
      for (int e = 4 * cg; e < p.c; e += 64) {
        const std::uint32_t w = *reinterpret_cast<const std::uint32_t*>(row + e);
        const float2 f01 = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(
            static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3)));
        const float2 f23 = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(
            static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3)));
        const __nv_bfloat162 lo = __float22bfloat162_rn(f01), hi = __float22bfloat162_rn(f23);
        *reinterpret_cast<uint2*>(out + e) =
            make_uint2(*reinterpret_cast<const std::uint32_t*>(&lo), *reinterpret_cast<const std::uint32_t*>(&hi));
      }
      const std::uint8_t* rope = row + KvFp8RowBytes(p.c);
      for (int e = 2 * cg; e < p.dr; e += 32) {
        *reinterpret_cast<std::uint32_t*>(out + p.c + e) = *reinterpret_cast<const std::uint32_t*>(rope + 2 * e);
      }
      if (cg < scale_tiles) key_scale[r * kMaxScaleTiles + cg] = *reinterpret_cast<const float*>(row + p.c + 4 * cg);
      __syncthreads();
    }
    const TileT* keys = kFp8 ? kv : kv + buffer * kKeyTile * ks;

    // Scores: warp w takes key columns 8 (w % 4).. and slice w / 4 of the d dimensions.
    {
      const int steps = d / 16, slice = warp / 4;
      const int k_begin = slice * steps / kQkSlices, k_end = (slice + 1) * steps / kQkSlices;
      const TileT* krow = keys + ((warp % 4) * 8 + g) * ks;
      float hh[4] = {}, hl[4] = {}, lh[4] = {};
      // FP8: hh and lh sum one scale tile (or the rope key, unscaled: -1) of the step range;
      // `scaled` gathers each tile's sum times its keys' scales (this lane's keys 2qd, 2qd + 1).
      float scaled[4] = {};
      auto scale_tile_of = [&](int kk) { return kk * 16 < p.c ? kk * 16 / static_cast<int>(kKvFp8Tile) : -1; };
      int scale_tile = scale_tile_of(k_begin);
      auto flush_scale_tile = [&]() {
        const int key = (warp % 4) * 8 + 2 * qd;
        const float s0 = scale_tile < 0 ? 1.0f : key_scale[key * kMaxScaleTiles + scale_tile];
        const float s1 = scale_tile < 0 ? 1.0f : key_scale[(key + 1) * kMaxScaleTiles + scale_tile];
        scaled[0] = fmaf(lh[0] + hh[0], s0, scaled[0]);
        scaled[1] = fmaf(lh[1] + hh[1], s1, scaled[1]);
        scaled[2] = fmaf(lh[2] + hh[2], s0, scaled[2]);
        scaled[3] = fmaf(lh[3] + hh[3], s1, scaled[3]);
#pragma unroll
        for (int e = 0; e < 4; ++e) hh[e] = lh[e] = 0.0f;
      };
#pragma unroll 3
      for (int kk = k_begin; kk < k_end; ++kk) {
        if constexpr (kFp8) {
          if (const int st = scale_tile_of(kk); st != scale_tile) {
            flush_scale_tile();
            scale_tile = st;
          }
        }
        const int col = kk * 16 + 2 * qd;
        std::uint32_t ah[4], al[4];
        LoadAFragment(ah, q_hi, qs, kk * 16, lane);
        LoadAFragment(al, q_lo, qs, kk * 16, lane);
        if constexpr (kF32) {
          const float2 f0 = *reinterpret_cast<const float2*>(krow + col);
          const float2 f1 = *reinterpret_cast<const float2*>(krow + col + 8);
          std::uint32_t bh0, bl0, bh1, bl1;
          Split(f0.x, f0.y, bh0, bl0);
          Split(f1.x, f1.y, bh1, bl1);
          Mma(hh, ah, bh0, bh1);
          Mma(hl, ah, bl0, bl1);
          Mma(lh, al, bh0, bh1);
        } else {
          const std::uint32_t b0 = *reinterpret_cast<const std::uint32_t*>(krow + col);
          const std::uint32_t b1 = *reinterpret_cast<const std::uint32_t*>(krow + col + 8);
          Mma(hh, ah, b0, b1);
          Mma(lh, al, b0, b1);
        }
      }
      if constexpr (kFp8) {
        flush_scale_tile();
#pragma unroll
        for (int e = 0; e < 4; ++e) hh[e] = scaled[e];  // hl and lh are zero
      }
      float* sp = s_part + slice * kMlaHeadGroup * kPStride;
      const int key = (warp % 4) * 8 + 2 * qd;
      sp[g * kPStride + key] = (hl[0] + lh[0]) + hh[0];
      sp[g * kPStride + key + 1] = (hl[1] + lh[1]) + hh[1];
      sp[(g + 8) * kPStride + key] = (hl[2] + lh[2]) + hh[2];
      sp[(g + 8) * kPStride + key + 1] = (hl[3] + lh[3]) + hh[3];
    }
    __syncthreads();

    // Online softmax: one warp per head row, one key per lane.
    {
      const int r = warp;
      const bool valid = tile_valid[buffer * kKeyTile + lane] != 0;
      float score = 0.0f;
#pragma unroll
      for (int sl = 0; sl < kQkSlices; ++sl) score += s_part[(sl * kMlaHeadGroup + r) * kPStride + lane];
      if (!valid) score = -INFINITY;
      float mx = score;
#pragma unroll
      for (int off = kWarpSize / 2; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(kFullWarpMask, mx, off));
      const float m_old = row_max[r];
      const float m_new = fmaxf(m_old, mx);
      float corr = 1.0f, pr = 0.0f;
      if (m_new != -INFINITY) {
        corr = expf(m_old - m_new);  // 0 while nothing was visible
        pr = valid ? expf(score - m_new) : 0.0f;
      }
      const float sum = WarpSum(pr);
      if constexpr (!kFp8) {
        const __nv_bfloat16 hi = __float2bfloat16_rn(pr);
        const __nv_bfloat16 lo = __float2bfloat16_rn(pr - __bfloat162float(hi));
        pa_hi[r * kPStride + lane] = __bfloat16_as_ushort(hi);
        pa_lo[r * kPStride + lane] = __bfloat16_as_ushort(lo);
      }
      if constexpr (kFp8) {  // P times each scale tile's scales, as the bf16 hi + lo A operand
        for (int s = 0; s < scale_tiles; ++s) {
          const float v = pr * key_scale[lane * kMaxScaleTiles + s];
          const __nv_bfloat16 hi = __float2bfloat16_rn(v);
          const __nv_bfloat16 lo = __float2bfloat16_rn(v - __bfloat162float(hi));
          p_hi[(s * kMlaHeadGroup + r) * kPStride + lane] = __bfloat16_as_ushort(hi);
          p_lo[(s * kMlaHeadGroup + r) * kPStride + lane] = __bfloat16_as_ushort(lo);
        }
      }
      __syncwarp();  // every lane read row_max before lane 0 replaces it
      if (lane == 0) {
        row_sum[r] = row_sum[r] * corr + sum;
        row_max[r] = m_new;
        row_corr[r] = corr;
      }
    }
    __syncthreads();

    // O = O * corr + P · V (V: the first c columns of the key rows).
    {
      const float corr_lo = row_corr[g], corr_hi = row_corr[g + 8];
#pragma unroll
      for (int i = 0; i < kPvTilesPerWarp; ++i) {
        o[i][0] *= corr_lo;
        o[i][1] *= corr_lo;
        o[i][2] *= corr_hi;
        o[i][3] *= corr_hi;
      }
#pragma unroll
      for (int kk = 0; kk < kKeyTile / 16; ++kk) {
        if constexpr (kF32) {
          const int k0 = kk * 16 + 2 * qd;
          std::uint32_t ah[4], al[4];
          LoadAFragment(ah, pa_hi, kPStride, kk * 16, lane);
          LoadAFragment(al, pa_lo, kPStride, kk * 16, lane);
          const TileT* v = keys + k0 * ks;  // rows k0, k0 + 1, k0 + 8, k0 + 9
#pragma unroll
          for (int i = 0; i < kPvTilesPerWarp; ++i) {
            const int n_tile = warp + kSplitWarps * i;
            if (n_tile < pv_tiles) {
              const int n = n_tile * 8 + g;
              std::uint32_t bh0, bl0, bh1, bl1;
              Split(v[n], v[ks + n], bh0, bl0);
              Split(v[8 * ks + n], v[9 * ks + n], bh1, bl1);
              Mma(o[i], ah, bh0, bh1);
              Mma(o[i], ah, bl0, bl1);
              Mma(o[i], al, bh0, bh1);
            }
          }
        } else {
          // bf16 V (a BF16 cache, or FP8 rows unpacked): one ldmatrix.trans gives the B fragments of
          // two of the warp's 8-column tiles of V (lanes 0-15 the first's 16 key rows, 16-31 the
          // second's; a missing second tile reads the first again and is not used).
          std::uint32_t ah[4], al[4];
          if constexpr (!kFp8) {
            LoadAFragment(ah, pa_hi, kPStride, kk * 16, lane);
            LoadAFragment(al, pa_lo, kPStride, kk * 16, lane);
          }
          const int v_row = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
          for (int i = 0; i < kPvTilesPerWarp; i += 2) {
            const int first = warp + kSplitWarps * i, second = first + kSplitWarps;
            if (first >= pv_tiles) continue;  // uniform over the warp
            const bool both = second < pv_tiles;
            std::uint32_t b[4];
            LoadMatricesTransposed(b, keys + v_row * ks + (lane >= 16 && both ? second : first) * 8);
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              if (j == 1 && !both) break;
              const int n_tile = j == 0 ? first : second;
              if constexpr (kFp8) {
                // V's scale tile for these columns: P times its scales (written by the softmax).
                const int st = n_tile * 8 / static_cast<int>(kKvFp8Tile);
                std::uint32_t sh[4], sl[4];
                LoadAFragment(sh, p_hi + st * kMlaHeadGroup * kPStride, kPStride, kk * 16, lane);
                LoadAFragment(sl, p_lo + st * kMlaHeadGroup * kPStride, kPStride, kk * 16, lane);
                Mma(o[i + j], sh, b[2 * j], b[2 * j + 1]);
                Mma(o[i + j], sl, b[2 * j], b[2 * j + 1]);
              } else {
                Mma(o[i + j], ah, b[2 * j], b[2 * j + 1]);
                Mma(o[i + j], al, b[2 * j], b[2 * j + 1]);
              }
            }
          }
        }
      }
    }
    __syncthreads();  // the tile, P and the scores are free for the next tile
  }

  float* out = a.partial + stats * p.c;
#pragma unroll
  for (int i = 0; i < kPvTilesPerWarp; ++i) {
    const int n_tile = warp + kSplitWarps * i;
    if (n_tile < pv_tiles) {
      const int n = n_tile * 8 + 2 * qd;
      *reinterpret_cast<float2*>(out + g * p.c + n) = make_float2(o[i][0], o[i][1]);
      *reinterpret_cast<float2*>(out + (g + 8) * p.c + n) = make_float2(o[i][2], o[i][3]);
    }
  }
  if (tid < kMlaHeadGroup) {
    a.row_max[stats + tid] = row_max[tid];
    a.row_sum[stats + tid] = row_sum[tid];
  }
}

__device__ __forceinline__ float BlockMax(float v, float* scratch) {
  v = WarpMax(v);
  if (threadIdx.x % kWarpSize == 0) scratch[threadIdx.x / kWarpSize] = v;
  __syncthreads();
  v = WarpMax(threadIdx.x % kWarpSize < kWarps ? scratch[threadIdx.x % kWarpSize] : -INFINITY);
  __syncthreads();
  return v;
}

// grid: (ceil(c / kCols), heads, tokens). O[t, h, :] = the splits' partials rescaled to their
// common max and divided by the common sum (zeros when the query saw no key). Thread (split group
// sg, column quad cq) adds splits sg, sg + kCombineSplitGroups, ... (independent loads; empty
// splits hold zeros), and the groups meet in shared memory.
template <int kCols>
__global__ void __launch_bounds__(kThreads) MlaCombineKernel(const __grid_constant__ SplitArgs a) {
  constexpr int kGroups = kCombineSplitGroups<kCols>;
  const MlaAttentionParams& p = a.p;
  __shared__ float weight[kMlaMaxSplits];
  __shared__ float4 partial[kGroups][kCols / 4];
  __shared__ float scratch[kWarps];
  LetDependentsLaunch();
  WaitForPrerequisiteGrid();
  const int tid = threadIdx.x;
  const int h = blockIdx.y, t = blockIdx.z;
  const std::int64_t first = (std::int64_t{t} * a.head_groups + h / kMlaHeadGroup) * a.splits * kMlaHeadGroup +
                             h % kMlaHeadGroup;  // split s: row first + s * 16
  const float m = tid < a.splits ? a.row_max[first + tid * kMlaHeadGroup] : -INFINITY;
  const float top = BlockMax(m, scratch);
  const float w = top != -INFINITY && m != -INFINITY ? expf(m - top) : 0.0f;
  const float sum = BlockSum<kThreads>(tid < a.splits ? w * a.row_sum[first + tid * kMlaHeadGroup] : 0.0f, scratch);
  if (tid < a.splits) weight[tid] = sum > 0.0f ? w / sum : 0.0f;
  __syncthreads();
  const int cq = tid % (kCols / 4), sg = tid / (kCols / 4);
  const int col = static_cast<int>(blockIdx.x) * kCols + 4 * cq;
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (col < p.c) {
    const float* base = a.partial + first * p.c + col;
#pragma unroll 8
    for (int s = sg; s < a.splits; s += kGroups) {
      const float ws = weight[s];
      const float4 v = __ldg(reinterpret_cast<const float4*>(base + std::int64_t{s} * kMlaHeadGroup * p.c));
      acc.x = fmaf(ws, v.x, acc.x);
      acc.y = fmaf(ws, v.y, acc.y);
      acc.z = fmaf(ws, v.z, acc.z);
      acc.w = fmaf(ws, v.w, acc.w);
    }
  }
  partial[sg][cq] = acc;
  __syncthreads();
  if (sg == 0 && col < p.c) {
    for (int g = 1; g < kGroups; ++g) {
      const float4 v = partial[g][cq];
      acc.x += v.x;
      acc.y += v.y;
      acc.z += v.z;
      acc.w += v.w;
    }
    *reinterpret_cast<float4*>(a.o + (std::int64_t{t} * p.heads + h) * p.c + col) = acc;
  }
}

// grid: (ceil(dv / (kRows * kWarps)), heads). out[t, h*dv + v] = w_uv[h, v, :] · O[t, h, :] for
// every query; each warp holds kRows rows of w_uv in registers as loaded (16-byte loads, all
// issued before the wait for the combine kernel), lane l covering elements [kVec l, kVec (l + 1))
// of each 32-lane step. kTokens: queries per pass.
template <typename UvT, int kTokens, int kRows>
__global__ void __launch_bounds__(kThreads, kOutputBlocksPerSm<UvT, kRows>)
    MlaOutputKernel(const __grid_constant__ SplitArgs a) {
  const MlaAttentionParams& p = a.p;
  __shared__ __align__(16) float o[kTokens][kMlaMaxLatent];
  constexpr int kVec = kVec16<UvT>;
  constexpr int kLoads = kMlaMaxLatent / (kVec * kWarpSize);  // per lane and row, at most
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int h = blockIdx.y;
  const int v0 = static_cast<int>(blockIdx.x) * kRows * kWarps + kRows * warp;
  const UvT* w_uv = static_cast<const UvT*>(p.w_uv) + std::int64_t{h} * p.dv * p.c;
  uint4 raw[kRows][kLoads];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int i = kVec * (lane + kWarpSize * l);
      raw[r][l] = v0 + r < p.dv && i < p.c
                      ? __ldg(reinterpret_cast<const uint4*>(w_uv + std::int64_t{v0 + r} * p.c + i))
                      : make_uint4(0, 0, 0, 0);
    }
  }
  WaitForPrerequisiteGrid();
  for (int t0 = 0; t0 < p.tokens; t0 += kTokens) {
    const int n = min(kTokens, p.tokens - t0);
    for (int i = threadIdx.x; i < n * p.c / 4; i += kThreads) {
      const int k = i / (p.c / 4), q = i % (p.c / 4);
      reinterpret_cast<float4*>(o[k])[q] =
          reinterpret_cast<const float4*>(a.o + (std::int64_t{t0 + k} * p.heads + h) * p.c)[q];
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float acc[kTokens] = {};
#pragma unroll
      for (int l = 0; l < kLoads; ++l) {
        const int i = kVec * (lane + kWarpSize * l);
        if (i >= p.c) break;
        float w[kVec];
        if constexpr (sizeof(UvT) == 4) {
          w[0] = __uint_as_float(raw[r][l].x);
          w[1] = __uint_as_float(raw[r][l].y);
          w[2] = __uint_as_float(raw[r][l].z);
          w[3] = __uint_as_float(raw[r][l].w);
        } else {
          Widen2(raw[r][l].x, UvT{}, w + 0);
          Widen2(raw[r][l].y, UvT{}, w + 2);
          Widen2(raw[r][l].z, UvT{}, w + 4);
          Widen2(raw[r][l].w, UvT{}, w + 6);
        }
#pragma unroll
        for (int k = 0; k < kTokens; ++k) {
          if (k < n) {
#pragma unroll
            for (int e = 0; e < kVec; e += 4) {
              const float4 x = *reinterpret_cast<const float4*>(&o[k][i + e]);
              acc[k] = fmaf(w[e], x.x, acc[k]);
              acc[k] = fmaf(w[e + 1], x.y, acc[k]);
              acc[k] = fmaf(w[e + 2], x.z, acc[k]);
              acc[k] = fmaf(w[e + 3], x.w, acc[k]);
            }
          }
        }
      }
#pragma unroll
      for (int k = 0; k < kTokens; ++k) {
        if (k < n) {
          const float total = WarpSum(acc[k]);
          if (lane == 0 && v0 + r < p.dv) p.out[(std::int64_t{t0 + k} * p.heads + h) * p.dv + v0 + r] = total;
        }
      }
    }
    __syncthreads();  // `o` is rewritten by the next batch of queries
  }
}

// Launches `kernel` as a programmatic dependent of the kernel before it on the stream.
template <typename... Args>
absl::Status LaunchDependent(void (*kernel)(Args...), dim3 grid, int threads, std::size_t smem,
                             const LaunchContext& ctx, const char* name, const SplitArgs& a) {
  RETURN_IF_ERROR(LaunchProgrammaticDependent(kernel, grid, dim3(static_cast<unsigned>(threads)), smem, ctx, a));
  return CheckLaunch(name);
}

int WeightIndex(DType dtype) {
  switch (dtype) {
    case DType::kF32: return 0;
    case DType::kBF16: return 1;
    default: return -1;
  }
}

std::size_t SplitSharedBytesFor(const MlaAttentionParams& p) {
  switch (p.kv_dtype) {
    case DType::kF32: return SplitSharedBytes<float>(p.c, p.dr);
    case DType::kU8: return SplitSharedBytes<KvFp8>(p.c, p.dr);
    default: return SplitSharedBytes<Bf16>(p.c, p.dr);
  }
}

// The opt-in shared memory of one block on the GPUs the kernels are built for (sm_90: 227 KB).
constexpr std::size_t kMaxSplitSharedBytes = 227 * 1024;

template <typename UkT, int kTokens>
absl::Status LaunchAbsorbFor(const SplitArgs& a, const LaunchContext& ctx) {
  const dim3 grid(static_cast<unsigned>(a.head_groups * kMlaHeadGroup),
                  static_cast<unsigned>(CeilDiv(a.p.c + a.p.dr, kAbsorbCols)));
  return LaunchDependent(MlaAbsorbKernel<UkT, kTokens>, grid, kThreads, sizeof(float) * kTokens * a.p.dn, ctx,
                         "MlaAbsorbKernel", a);
}

template <typename UkT>
absl::Status LaunchAbsorb(const SplitArgs& a, const LaunchContext& ctx) {
  switch (TokensPerPass(a.p.tokens, kAbsorbMaxTokens)) {
    case 1: return LaunchAbsorbFor<UkT, 1>(a, ctx);
    case 2: return LaunchAbsorbFor<UkT, 2>(a, ctx);
    default: return LaunchAbsorbFor<UkT, 4>(a, ctx);
  }
}

template <typename UvT, int kTokens, int kRows>
absl::Status LaunchOutputFor(const SplitArgs& a, const LaunchContext& ctx) {
  const dim3 grid(static_cast<unsigned>(CeilDiv(a.p.dv, kRows * kWarps)), static_cast<unsigned>(a.p.heads));
  return LaunchDependent(MlaOutputKernel<UvT, kTokens, kRows>, grid, kThreads, 0, ctx, "MlaOutputKernel", a);
}

// The most rows a warp (up to `most`) that still give every SM a block of the output kernel.
int OutputRowsPerWarp(const MlaAttentionParams& p, int num_sms, int most) {
  int rows = most;
  while (rows > 1 && CeilDiv(p.dv, rows * kWarps) * p.heads < num_sms) rows /= 2;
  return rows;
}

template <typename UvT, int kTokens>
absl::Status LaunchOutputRows(const SplitArgs& a, const LaunchContext& ctx) {
  static_assert(kOutputMaxRowsPerWarp == 2, "instantiated for 1 and 2 rows a warp");
  return OutputRowsPerWarp(a.p, ctx.num_sms, kOutputMaxRowsPerWarp) == 1 ? LaunchOutputFor<UvT, kTokens, 1>(a, ctx)
                                                                         : LaunchOutputFor<UvT, kTokens, 2>(a, ctx);
}

template <typename UvT>
absl::Status LaunchOutput(const SplitArgs& a, const LaunchContext& ctx) {
  switch (TokensPerPass(a.p.tokens, kOutputMaxTokens)) {
    case 1: return LaunchOutputRows<UvT, 1>(a, ctx);
    case 2: return LaunchOutputRows<UvT, 2>(a, ctx);
    case 4: return LaunchOutputRows<UvT, 4>(a, ctx);
    default: return LaunchOutputRows<UvT, 8>(a, ctx);
  }
}

}  // namespace

bool MlaDecodeApplies(const MlaAttentionParams& p) {
  return p.tokens >= 1 && p.tokens <= kMlaDecodeMaxTokens && p.heads >= 1 && p.dn >= 1 && p.dn <= 1024 && p.dv >= 1 &&
         p.c >= 16 && p.c <= kMlaMaxLatent && p.c % 16 == 0 && p.dr % 16 == 0 &&
         CeilDiv(p.heads, kMlaHeadGroup) <= kMaxGridY && p.heads <= kMaxGridY && WeightIndex(p.w_uk_dtype) >= 0 &&
         WeightIndex(p.w_uv_dtype) >= 0 && (WeightIndex(p.kv_dtype) >= 0 || p.kv_dtype == DType::kU8) &&
         IsAligned(p.kv_latent, 16) && IsAligned(p.k_pe, 16) && IsAligned(p.w_uk, 16) && IsAligned(p.w_uv, 16) &&
         SplitSharedBytesFor(p) <= kMaxSplitSharedBytes;
}

MlaDecodePlan PlanMlaDecode(const MlaAttentionParams& p, int num_sms, int splits) {
  MlaDecodePlan plan;
  plan.head_groups = static_cast<int>(CeilDiv(p.heads, kMlaHeadGroup));
  // Enough splits to give every SM a block (the split kernel runs one block per SM), no more than
  // the longest query has key tiles.
  const std::int64_t candidates = p.selected != nullptr ? p.top_k : std::int64_t{p.start_pos} + p.tokens;
  const std::int64_t tiles = CeilDiv(std::max<std::int64_t>(candidates, 1), kKeyTile);
  const std::int64_t by_sms = std::max<std::int64_t>(1, num_sms / (std::int64_t{p.tokens} * plan.head_groups));
  plan.splits = static_cast<int>(std::clamp<std::int64_t>(
      splits > 0 ? splits : std::min(by_sms, tiles), 1, kMlaMaxSplits));
  const std::int64_t groups = std::int64_t{p.tokens} * plan.head_groups;
  const std::int64_t rows = groups * plan.splits * kMlaHeadGroup;
  auto aligned = [](std::int64_t bytes) { return static_cast<std::size_t>(CeilDiv(bytes, 256) * 256); };
  plan.q_bytes = aligned(groups * 2 * kMlaHeadGroup * QStride(p.c + p.dr) * 2);
  plan.partial_bytes = aligned(rows * p.c * 4);
  plan.stats_bytes = aligned(rows * 4);
  plan.o_bytes = aligned(std::int64_t{p.tokens} * p.heads * p.c * 4);
  return plan;
}

absl::Status LaunchMlaDecode(const MlaAttentionParams& p, const MlaDecodePlan& plan, void* scratch,
                             std::size_t scratch_bytes, const LaunchContext& ctx) {
  if (!MlaDecodeApplies(p)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MlaDecode: shapes outside the split kernels (tokens=", p.tokens, " heads=", p.heads, " c=", p.c,
        " dr=", p.dr, "; want 1 <= tokens <= ", kMlaDecodeMaxTokens, ", c and dr multiples of 16, c <= ",
        kMlaMaxLatent, ", 16-byte aligned caches)"));
  }
  if (scratch == nullptr || !IsAligned(scratch, 16) || scratch_bytes < plan.ScratchBytes() ||
      plan.splits < 1 || plan.splits > kMlaMaxSplits || plan.head_groups != CeilDiv(p.heads, kMlaHeadGroup)) {
    return absl::InvalidArgumentError(absl::StrCat("MlaDecode: scratch of ", scratch_bytes, " bytes for a plan of ",
                                                   plan.ScratchBytes(), " (", plan.splits, " splits)"));
  }
  auto* bytes = static_cast<std::byte*>(scratch);
  SplitArgs a{.p = p,
              .head_groups = plan.head_groups,
              .splits = plan.splits,
              .q = reinterpret_cast<std::uint16_t*>(bytes),
              .partial = reinterpret_cast<float*>(bytes + plan.q_bytes),
              .row_max = reinterpret_cast<float*>(bytes + plan.q_bytes + plan.partial_bytes),
              .row_sum = reinterpret_cast<float*>(bytes + plan.q_bytes + plan.partial_bytes + plan.stats_bytes),
              .o = reinterpret_cast<float*>(bytes + plan.q_bytes + plan.partial_bytes + 2 * plan.stats_bytes)};
  RETURN_IF_ERROR(WeightIndex(p.w_uk_dtype) == 0 ? LaunchAbsorb<float>(a, ctx) : LaunchAbsorb<Bf16>(a, ctx));

  const std::size_t smem = SplitSharedBytesFor(p);
  auto* split_kernel = p.kv_dtype == DType::kF32   ? &MlaSplitKernel<float>
                       : p.kv_dtype == DType::kU8 ? &MlaSplitKernel<KvFp8>
                                                  : &MlaSplitKernel<Bf16>;
  NQ_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(split_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const dim3 grid(static_cast<unsigned>(plan.splits), static_cast<unsigned>(plan.head_groups),
                  static_cast<unsigned>(p.tokens));
  RETURN_IF_ERROR(LaunchDependent(split_kernel, grid, kSplitThreads, smem, ctx, "MlaSplitKernel", a));

  // 128 columns a block unless that leaves SMs without one.
  const bool narrow = CeilDiv(p.c, kCombineMaxCols) * p.heads * p.tokens < ctx.num_sms;
  const int combine_cols = narrow ? kCombineMaxCols / 2 : kCombineMaxCols;
  const dim3 combine_grid(static_cast<unsigned>(CeilDiv(p.c, combine_cols)), static_cast<unsigned>(p.heads),
                          static_cast<unsigned>(p.tokens));
  RETURN_IF_ERROR(narrow ? LaunchDependent(MlaCombineKernel<kCombineMaxCols / 2>, combine_grid, kThreads, 0, ctx,
                                           "MlaCombineKernel", a)
                         : LaunchDependent(MlaCombineKernel<kCombineMaxCols>, combine_grid, kThreads, 0, ctx,
                                           "MlaCombineKernel", a));
  return WeightIndex(p.w_uv_dtype) == 0 ? LaunchOutput<float>(a, ctx) : LaunchOutput<Bf16>(a, ctx);
}

}  // namespace nq::kernels::cuda
