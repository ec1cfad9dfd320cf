#include "kernels/cuda/nq_moe.cuh"

#include <cuda_fp16.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/nq_moe_vector.cuh"
#include "kernels/cuda/reduce.cuh"
#include "kernels/nq_moe.h"
#include "services/common/status_macros.h"

namespace nq::kernels::cuda {
namespace {

constexpr int kGemvWarps = 8;
constexpr int kRowsPerWarp = 4;
constexpr int kRowGroups = 2;                          // row groups of 4 a warp takes in turn
constexpr int kGemvRows = kGemvWarps * kRowsPerWarp * kRowGroups;  // rows per GEMV block
constexpr int kCodesPerWord = 16;                      // 2-bit codes in a 32-bit word
constexpr int kPairsPerWord = kCodesPerWord / 2;       // half2 weight pairs per word
constexpr int kMaxAssignments = 64;                    // T * K of one chunk (4 tokens x 16)

// ---- Byte-permute lookups -------------------------------------------------------------------

// PTX prmt in its default mode: byte n of the result is byte (s.nibble[n] & 7) of {b:a}, or that
// byte's sign replicated when the nibble's bit 3 is set (the 4-bit lookup uses both).
__device__ __forceinline__ std::uint32_t Prmt(std::uint32_t a, std::uint32_t b, std::uint32_t s) {
  std::uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s));
  return r;
}

// Low and high bytes of fp16 level values, byte i = entry i.
struct LevelBytes2 {
  std::uint32_t lo, hi;  // the 4 base levels
};
struct LevelBytes4 {
  std::uint32_t lo[4], hi[4];  // the 16 4-bit levels, 4 per register
};

__device__ __forceinline__ std::uint16_t HalfBits(float v) { return __half_as_ushort(__float2half_rn(v)); }

__device__ __forceinline__ void PackBytes(const float* levels, int n, std::uint32_t* lo, std::uint32_t* hi) {
  for (int r = 0; r < n / 4; ++r) {
    lo[r] = 0;
    hi[r] = 0;
    for (int i = 0; i < 4; ++i) {
      const std::uint16_t bits = HalfBits(levels[4 * r + i]);
      lo[r] |= static_cast<std::uint32_t>(bits & 0xff) << (8 * i);
      hi[r] |= static_cast<std::uint32_t>(bits >> 8) << (8 * i);
    }
  }
}

// Two half2 weight pairs from a selector of four table indices (low 16 bits of s).
__device__ __forceinline__ void Interleave(std::uint32_t lo, std::uint32_t hi, __half2& p0, __half2& p1) {
  const std::uint32_t a = Prmt(lo, hi, 0x5140), b = Prmt(lo, hi, 0x7362);
  p0 = *reinterpret_cast<const __half2*>(&a);
  p1 = *reinterpret_cast<const __half2*>(&b);
}

__device__ __forceinline__ void Lookup2(const LevelBytes2& t, std::uint32_t s, __half2& p0, __half2& p1) {
  Interleave(Prmt(t.lo, 0, s), Prmt(t.hi, 0, s), p0, p1);
}

// s holds four 4-bit indices (0..15): bits 0-2 pick among 8 entries, bit 3 picks the half.
__device__ __forceinline__ void Lookup4(const LevelBytes4& t, std::uint32_t s, __half2& p0, __half2& p1) {
  const std::uint32_t s7 = s & 0x7777u;
  const std::uint32_t high = s & 0x8888u;
  // 0xFF bytes where the index is >= 8: nibble 0xC replicates the sign of byte 4 (0x80).
  const std::uint32_t mask = Prmt(0u, 0x80u, high | (high >> 1));
  const std::uint32_t lo = (Prmt(t.lo[2], t.lo[3], s7) & mask) | (Prmt(t.lo[0], t.lo[1], s7) & ~mask);
  const std::uint32_t hi = (Prmt(t.hi[2], t.hi[3], s7) & mask) | (Prmt(t.hi[0], t.hi[1], s7) & ~mask);
  Interleave(lo, hi, p0, p1);
}

// The 8 weight pairs of one code word, in the pair order of the shared-memory input:
// (0,2) (4,6) (8,10) (12,14) (1,3) (5,7) (9,11) (13,15).
__device__ __forceinline__ void DecodeWord2(const LevelBytes2& t, std::uint32_t base, __half2 (&w)[kPairsPerWord]) {
  const std::uint32_t even = base & 0x33333333u, odd = (base >> 2) & 0x33333333u;
  Lookup2(t, even, w[0], w[1]);
  Lookup2(t, even >> 16, w[2], w[3]);
  Lookup2(t, odd, w[4], w[5]);
  Lookup2(t, odd >> 16, w[6], w[7]);
}

__device__ __forceinline__ void DecodeWord4(const LevelBytes4& t, std::uint32_t base, std::uint32_t residual,
                                            __half2 (&w)[kPairsPerWord]) {
  // Nibble n of `even` is 4 * b[2n] + r[2n]; of `odd`, 4 * b[2n+1] + r[2n+1].
  const std::uint32_t even = ((base << 2) & 0xccccccccu) | (residual & 0x33333333u);
  const std::uint32_t odd = (base & 0xccccccccu) | ((residual >> 2) & 0x33333333u);
  Lookup4(t, even, w[0], w[1]);
  Lookup4(t, even >> 16, w[2], w[3]);
  Lookup4(t, odd, w[4], w[5]);
  Lookup4(t, odd >> 16, w[6], w[7]);
}

// Position of code i (0..15) of a word in the pair order above: pair and half.
__device__ __forceinline__ int PairSlot(int i) {
  const int group = i & 1;     // even codes fill pairs 0-3, odd codes pairs 4-7
  const int k = i >> 1;        // 0..7 within its parity
  return (group * 4 + (k >> 1)) * 2 + (k & 1);
}


// ---- The GEMV ---------------------------------------------------------------------------------

struct GemvParams {
  NqMoeParams p;
  NqProjectionView proj[2];  // gate, up (num_proj 2) or down (num_proj 1)
  int num_proj = 1;
  int rows = 0;              // rows of each projection
  int cols = 0;
  int tiles_per_proj = 0;    // ceil(rows / kGemvRows)
  // Inputs prepared by NqRotatePrepKernel / NqSwigluPrepKernel: for assignment a and projection
  // j, the input times the expert's column scales as half2 in decode pair order, times xscale.
  const __half2* xh = nullptr;     // [A][num_proj][cols / 2]
  const float* xscale = nullptr;   // [A][num_proj]
  float* out = nullptr;       // out[a * out_stride + proj * rows + row]
  std::int64_t out_stride = 0;
};

// kWords consecutive code words of one row per lane and load: 4 (16-byte loads, the wide path
// when cols % 64 == 0) or 1.
template <int kWords>
__device__ __forceinline__ void LoadWords(const std::uint32_t* p, std::uint32_t (&w)[kWords]) {
  if constexpr (kWords == 4) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    w[0] = v.x;
    w[1] = v.y;
    w[2] = v.z;
    w[3] = v.w;
  } else if constexpr (kWords == 2) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    w[0] = v.x;
    w[1] = v.y;
  } else {
    w[0] = __ldg(p);
  }
}

// sum_q w[q] . x[q] over a word's eight pairs: two half2 chains of four products each, then
// fp32 (bounds fp16 rounding to short sums).
__device__ __forceinline__ float DotPairs(const __half2 (&w)[kPairsPerWord], const uint4& xa, const uint4& xb) {
  __half2 s0 = __hmul2(w[0], *reinterpret_cast<const __half2*>(&xa.x));
  __half2 s1 = __hmul2(w[1], *reinterpret_cast<const __half2*>(&xa.y));
  s0 = __hfma2(w[2], *reinterpret_cast<const __half2*>(&xa.z), s0);
  s1 = __hfma2(w[3], *reinterpret_cast<const __half2*>(&xa.w), s1);
  s0 = __hfma2(w[4], *reinterpret_cast<const __half2*>(&xb.x), s0);
  s1 = __hfma2(w[5], *reinterpret_cast<const __half2*>(&xb.y), s1);
  s0 = __hfma2(w[6], *reinterpret_cast<const __half2*>(&xb.z), s0);
  s1 = __hfma2(w[7], *reinterpret_cast<const __half2*>(&xb.w), s1);
  const float2 f0 = __half22float2(s0), f1 = __half22float2(s1);
  return (f0.x + f0.y) + (f1.x + f1.y);
}

template <bool kFourBit, int kWords, int kMaxTok>
__device__ __forceinline__ void GemvRows(const GemvParams& g, const NqProjectionView& P, int e, int slot, int proj,
                                         int first_row, int n_tok, const int* tok_a, const __half2* xs,
                                         const float* xscale) {
  const int lane = threadIdx.x % kWarpSize;
  const int words = g.cols / kCodesPerWord;
  const std::int64_t plane_words = static_cast<std::int64_t>(g.rows) * g.cols / kCodesPerWord;
  const std::uint32_t* base = reinterpret_cast<const std::uint32_t*>(P.base) + e * plane_words;
  const std::uint32_t* residual = nullptr;
  if constexpr (kFourBit) {
    residual = reinterpret_cast<const std::uint32_t*>(g.p.arena + slot * g.p.slot_bytes + P.residual_offset);
  }
  const float* levels = P.levels + static_cast<std::int64_t>(e) * kNqLevelTable;
  LevelBytes2 t2;
  LevelBytes4 t4;
  if constexpr (kFourBit) {
    PackBytes(levels + kNqBaseLevels, kNqLevels4, t4.lo, t4.hi);
  } else {
    PackBytes(levels, kNqBaseLevels, &t2.lo, &t2.hi);
  }
  std::int64_t row_offset[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    row_offset[r] = static_cast<std::int64_t>(min(first_row + r, g.rows - 1)) * words;  // tail rows: unused re-reads
  }
  float acc[kMaxTok][kRowsPerWarp] = {};
#pragma unroll 2
  for (int w0 = lane * kWords; w0 < words; w0 += kWarpSize * kWords) {
    std::uint32_t wb[kRowsPerWarp][kWords], wr[kRowsPerWarp][kWords];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      LoadWords<kWords>(base + row_offset[r] + w0, wb[r]);
      if constexpr (kFourBit) LoadWords<kWords>(residual + row_offset[r] + w0, wr[r]);
    }
#pragma unroll
    for (int q = 0; q < kWords; ++q) {
      if constexpr (kMaxTok == 1) {
        // One token: its input pairs stay in registers and each row is decoded and used at
        // once, so only one row's pairs are live (fewer registers, more resident warps).
        const uint4* xv = reinterpret_cast<const uint4*>(xs + static_cast<std::int64_t>(w0 + q) * kPairsPerWord);
        const uint4 xa = xv[0], xb = xv[1];
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) {
          __half2 wp[kPairsPerWord];
          if constexpr (kFourBit) {
            DecodeWord4(t4, wb[r][q], wr[r][q], wp);
          } else {
            DecodeWord2(t2, wb[r][q], wp);
          }
          acc[0][r] += DotPairs(wp, xa, xb);
        }
        continue;
      } else {
      // Decode the four rows' word once, then reuse it for every token.
      __half2 wp[kRowsPerWarp][kPairsPerWord];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        if constexpr (kFourBit) {
          DecodeWord4(t4, wb[r][q], wr[r][q], wp[r]);
        } else {
          DecodeWord2(t2, wb[r][q], wp[r]);
        }
      }
#pragma unroll
      for (int t = 0; t < kMaxTok; ++t) {
        if (t >= n_tok) break;
        const uint4* xv =
            reinterpret_cast<const uint4*>(xs + (static_cast<std::int64_t>(t) * words + w0 + q) * kPairsPerWord);
        const uint4 xa = xv[0], xb = xv[1];
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) acc[t][r] += DotPairs(wp[r], xa, xb);
      }
      }
    }
  }
  const float* rs = P.row_scales + static_cast<std::int64_t>(e) * g.rows;
#pragma unroll
  for (int t = 0; t < kMaxTok; ++t) {
    if (t >= n_tok) break;
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const float sum = WarpSum(acc[t][r]);
      const int row = first_row + r;
      if (lane == 0 && row < g.rows) {
        g.out[tok_a[t] * g.out_stride + proj * g.rows + row] = rs[row] * sum * xscale[t];
      }
    }
  }
}

// Where the decode path's GEMV inputs go: for assignment a and projection j, xh[a][j] holds the
// input times expert e's column scales as half2 in the decode's pair order, xscale[a][j] its scale.
struct PrepParams {
  NqMoeParams p;
  NqProjectionView proj[2];
  int cols = 0;
  __half2* xh = nullptr;
  float* xscale = nullptr;
};



// kMaxTok: 1 for a one-token chunk (a plain decode step), else kNqMaxDecodeTokens.
template <int kMaxTok>
__global__ void __launch_bounds__(kGemvWarps * kWarpSize, kMaxTok == 1 ? 3 : 2)
    NqGemvKernel(const __grid_constant__ GemvParams g) {
  extern __shared__ __align__(16) unsigned char gemv_smem[];
  __shared__ float xscale[kNqMaxDecodeTokens];
  __shared__ int ids[kMaxAssignments];
  const int K = static_cast<int>(g.p.top_k), A = static_cast<int>(g.p.tokens) * K;
  const int a = blockIdx.x;
  // The chunk's ids, read once: which block serves an expert, and for which tokens.
  if (threadIdx.x < A) ids[threadIdx.x] = g.p.expert_ids[threadIdx.x];
  __syncthreads();
  const int e = ids[a];
  if (e < 0 || e >= g.p.num_experts) return;
  for (int b = 0; b < a; ++b) {
    if (ids[b] == e) return;  // an earlier block serves this expert's tokens
  }
  // The chunk's tokens that route to e, and their assignments (ids are distinct per token).
  int n_tok = 0, tok_a[kNqMaxDecodeTokens] = {};
  for (int b = a; b < A && n_tok < kNqMaxDecodeTokens; ++b) {
    if (ids[b] == e) tok_a[n_tok++] = b;
  }
  const int proj = blockIdx.y / g.tiles_per_proj;
  const int row0 = (blockIdx.y % g.tiles_per_proj) * kGemvRows;
  const NqProjectionView& P = g.proj[proj];

  // The tokens' prepared inputs into shared memory (16-byte copies).
  __half2* xs = reinterpret_cast<__half2*>(gemv_smem);
  const int vec_uint4 = g.cols / 8;  // 8 halves per 16 bytes
  for (int t = 0; t < n_tok; ++t) {
    const uint4* src = reinterpret_cast<const uint4*>(g.xh + (static_cast<std::int64_t>(tok_a[t]) * g.num_proj + proj) * (g.cols / 2));
    uint4* dst = reinterpret_cast<uint4*>(xs + static_cast<std::int64_t>(t) * (g.cols / 2));
    for (int i = threadIdx.x; i < vec_uint4; i += blockDim.x) dst[i] = src[i];
    if (threadIdx.x == 0) xscale[t] = g.xscale[static_cast<std::int64_t>(tok_a[t]) * g.num_proj + proj];
  }
  __syncthreads();
  const int slot = g.p.slot_of_expert[e];
  const bool four_bit = g.p.arena != nullptr && slot >= 0 && slot < g.p.num_slots;
  const int warp = threadIdx.x / kWarpSize;
  for (int group = 0; group < kRowGroups; ++group) {
    const int first_row = row0 + (group * kGemvWarps + warp) * kRowsPerWarp;
    if (first_row >= g.rows) break;
    // Wide loads when rows split into whole 16-byte pieces per lane: 4 words (2 bits) or 2
    // words of each plane (4 bits, two planes: the same bytes in flight, fewer registers).
    const bool wide = g.cols % (kCodesPerWord * 4) == 0;
    if (four_bit) {
      if (wide) {
        GemvRows<true, 2, kMaxTok>(g, P, e, slot, proj, first_row, n_tok, tok_a, xs, xscale);
      } else {
        GemvRows<true, 1, kMaxTok>(g, P, e, slot, proj, first_row, n_tok, tok_a, xs, xscale);
      }
    } else if (wide) {
      GemvRows<false, 4, kMaxTok>(g, P, e, slot, proj, first_row, n_tok, tok_a, xs, xscale);
    } else {
      GemvRows<false, 1, kMaxTok>(g, P, e, slot, proj, first_row, n_tok, tok_a, xs, xscale);
    }
  }
}

// The decode path's inputs, straight from the rotations (no fp32 round trip and no max pass):
// each CUDA block takes one Hadamard block of a vector and writes, for every assignment that
// needs it, the half2 input of the GEMV (times the expert's column scales, pair order, xscale 1).
// Contract: the scaled inputs stay inside fp16's range (|v| < 65504; rotated, RMS-normed hidden
// states times column scales are orders of magnitude below it).
// One thread per element of a Hadamard block (up to 512 wide), so each phase of these latency-
// bound kernels pays one round trip to memory rather than a loop of them.
constexpr int kVectorMaxThreads = 512;
int ChunkThreads(std::int64_t n) { return static_cast<int>(std::min<std::int64_t>(n, kVectorMaxThreads)); }

__device__ __forceinline__ void WritePrepared(const float* v, int n, int c0, const float* cs, int cols, __half2* xh) {
  __half* out = reinterpret_cast<__half*>(xh);
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int c = c0 + i;
    out[(c / kCodesPerWord) * kCodesPerWord + PairSlot(c % kCodesPerWord)] = __float2half_rn(v[i] * cs[c]);
  }
}

// grid (T, D / input.block, K): xr chunk = H (signs * x chunk), then the gate and up inputs of
// assignment k of token t. Each (token, chunk) is rotated K times over: a few hundred flops
// against one serial chain of column-scale loads per block instead of 2K.
__global__ void __launch_bounds__(kVectorMaxThreads) NqRotatePrepKernel(const __grid_constant__ PrepParams g) {
  extern __shared__ float chunk[];
  const int D = g.cols, t = blockIdx.x, K = static_cast<int>(g.p.top_k), k = blockIdx.z;
  const int n = static_cast<int>(g.p.input.block), c0 = blockIdx.y * n;
  const int a = t * K + k, e = g.p.expert_ids[a];
  if (e < 0 || e >= g.p.num_experts) return;
  for (int i = threadIdx.x; i < n; i += blockDim.x) chunk[i] = g.p.x[t * D + c0 + i] * g.p.input.signs[c0 + i];
  __syncthreads();
  BlockFwht(chunk, n, n);
  const float scale = rsqrtf(static_cast<float>(n));
  for (int i = threadIdx.x; i < n; i += blockDim.x) chunk[i] *= scale;
  __syncthreads();
  for (int j = 0; j < 2; ++j) {
    const std::int64_t vec = static_cast<std::int64_t>(a) * 2 + j;
    WritePrepared(chunk, n, c0, g.proj[j].col_scales + static_cast<std::int64_t>(e) * D, D, g.xh + vec * (D / 2));
    if (blockIdx.y == 0 && threadIdx.x == 0) g.xscale[vec] = 1.0f;
  }
}

// grid (A, I / n), n = the larger of the two intermediate Hadamard blocks: g and u unrotated,
// silu(g) * u rotated for down_proj, the down input written.
__global__ void __launch_bounds__(kVectorMaxThreads) NqSwigluPrepKernel(const __grid_constant__ PrepParams g,
                                                                     const float* hg, int n) {
  extern __shared__ float chunk[];  // [2n]: gate then up
  const int I = g.cols, a = blockIdx.x, c0 = blockIdx.y * n;
  const int e = g.p.expert_ids[a];
  if (e < 0 || e >= g.p.num_experts) return;
  const float* in = hg + static_cast<std::int64_t>(a) * 2 * I;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    chunk[i] = in[c0 + i];
    chunk[n + i] = in[I + c0 + i];
  }
  __syncthreads();
  const int gb = static_cast<int>(g.p.gate_rows.block), db = static_cast<int>(g.p.down_cols.block);
  BlockFwht(chunk, 2 * n, gb);
  const float g_scale = rsqrtf(static_cast<float>(gb));
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float s = g.p.gate_rows.signs[c0 + i] * g_scale;
    const float gate = chunk[i] * s, up = chunk[n + i] * s;
    chunk[i] = gate / (1.0f + __expf(-gate)) * up * g.p.down_cols.signs[c0 + i];
  }
  __syncthreads();
  BlockFwht(chunk, n, db);
  const float d_scale = rsqrtf(static_cast<float>(db));
  for (int i = threadIdx.x; i < n; i += blockDim.x) chunk[i] *= d_scale;
  __syncthreads();
  WritePrepared(chunk, n, c0, g.proj[0].col_scales + static_cast<std::int64_t>(e) * I, I,
                g.xh + static_cast<std::int64_t>(a) * (I / 2));
  if (blockIdx.y == 0 && threadIdx.x == 0) g.xscale[a] = 1.0f;
}


absl::Status LaunchGemv(const GemvParams& g, const LaunchContext& ctx) {
  // Shared memory for the chunk's tokens only: a one-token step leaves room for more blocks.
  const std::size_t smem = static_cast<std::size_t>(g.p.tokens) * g.cols * sizeof(__half);
  const dim3 grid(static_cast<unsigned>(g.p.tokens * g.p.top_k), static_cast<unsigned>(g.num_proj * g.tiles_per_proj));
  if (g.p.tokens == 1) {
    NQ_CUDA_RETURN_IF_ERROR(
        cudaFuncSetAttribute(NqGemvKernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    NqGemvKernel<1><<<grid, kGemvWarps * kWarpSize, smem, ctx.stream>>>(g);
  } else {
    NQ_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(NqGemvKernel<kNqMaxDecodeTokens>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    NqGemvKernel<kNqMaxDecodeTokens><<<grid, kGemvWarps * kWarpSize, smem, ctx.stream>>>(g);
  }
  return CheckLaunch("NqGemvKernel");
}

absl::Status LaunchChunk(const NqMoeParams& p, float* ws, const LaunchContext& ctx) {
  const std::int64_t T = p.tokens, K = p.top_k, D = p.hidden, I = p.intermediate;
  NqVectorParams v{.p = p};
  v.xr = ws;
  v.hg = v.xr + kNqMaxDecodeTokens * D;
  v.hh = v.hg + kNqMaxDecodeTokens * K * 2 * I;
  v.yd = v.hh + kNqMaxDecodeTokens * K * I;
  float* xscale = v.yd + kNqMaxDecodeTokens * K * D;
  __half2* xh = reinterpret_cast<__half2*>(xscale + kNqMaxDecodeTokens * K * 2);
  {
    const PrepParams prep{.p = p, .proj = {p.gate, p.up}, .cols = static_cast<int>(D), .xh = xh, .xscale = xscale};
    const std::size_t smem = p.input.block * sizeof(float);
    NQ_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(NqRotatePrepKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(smem)));
    const dim3 grid(static_cast<unsigned>(T), static_cast<unsigned>(D / p.input.block), static_cast<unsigned>(K));
    NqRotatePrepKernel<<<grid, ChunkThreads(p.input.block), smem, ctx.stream>>>(prep);
    RETURN_IF_ERROR(CheckLaunch("NqRotatePrepKernel"));
  }

  const int gate_tiles = static_cast<int>((I + kGemvRows - 1) / kGemvRows);
  RETURN_IF_ERROR(LaunchGemv({.p = p,
                              .proj = {p.gate, p.up},
                              .num_proj = 2,
                              .rows = static_cast<int>(I),
                              .cols = static_cast<int>(D),
                              .tiles_per_proj = gate_tiles,
                              .xh = xh,
                              .xscale = xscale,
                              .out = v.hg,
                              .out_stride = 2 * I},
                             ctx));
  {
    const PrepParams prep{.p = p, .proj = {p.down, p.down}, .cols = static_cast<int>(I), .xh = xh, .xscale = xscale};
    const int n = static_cast<int>(std::max(p.gate_rows.block, p.down_cols.block));
    const std::size_t smem = 2 * n * sizeof(float);
    NQ_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(NqSwigluPrepKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(smem)));
    NqSwigluPrepKernel<<<dim3(static_cast<unsigned>(T * K), static_cast<unsigned>(I / n)), ChunkThreads(n), smem,
                         ctx.stream>>>(prep, v.hg, n);
    RETURN_IF_ERROR(CheckLaunch("NqSwigluPrepKernel"));
  }
  const int down_tiles = static_cast<int>((D + kGemvRows - 1) / kGemvRows);
  RETURN_IF_ERROR(LaunchGemv({.p = p,
                              .proj = {p.down, p.down},
                              .num_proj = 1,
                              .rows = static_cast<int>(D),
                              .cols = static_cast<int>(I),
                              .tiles_per_proj = down_tiles,
                              .xh = xh,
                              .xscale = xscale,
                              .out = v.yd,
                              .out_stride = D},
                             ctx));
  return LaunchNqCombine(v, ctx);
}

}  // namespace

std::size_t NqMoeWorkspaceBytes(std::int64_t top_k, std::int64_t hidden, std::int64_t intermediate) {
  const std::int64_t A = kNqMaxDecodeTokens * top_k;
  const std::int64_t floats = kNqMaxDecodeTokens * hidden + A * (2 * intermediate + intermediate + hidden) + A * 2;
  const std::int64_t halves = A * 2 * std::max(hidden, intermediate);
  return static_cast<std::size_t>(floats) * sizeof(float) + static_cast<std::size_t>(halves) * sizeof(__half);
}

absl::Status LaunchNqMoe(const NqMoeParams& p, void* workspace, std::size_t workspace_bytes, const LaunchContext& ctx) {
  const std::int64_t D = p.hidden, I = p.intermediate;
  if (D % kCodesPerWord != 0 || I % kCodesPerWord != 0 || 2 * I > kNqMaxVectorWidth || D > kNqMaxVectorWidth) {
    return absl::InvalidArgumentError(absl::StrCat("NqMoe (CUDA): hidden ", D, " and intermediate ", I,
                                                   " must be multiples of ", kCodesPerWord, " with hidden and 2 x "
                                                   "intermediate at most ", kNqMaxVectorWidth));
  }
  if (kNqMaxDecodeTokens * p.top_k > kMaxAssignments) {
    return absl::InvalidArgumentError(absl::StrCat("NqMoe (CUDA): top_k ", p.top_k, " exceeds ",
                                                   kMaxAssignments / kNqMaxDecodeTokens));
  }
  if (workspace_bytes < NqMoeWorkspaceBytes(p.top_k, D, I) || reinterpret_cast<std::uintptr_t>(workspace) % 16 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("NqMoe (CUDA): workspace of ", workspace_bytes, " bytes, need ",
                                                   NqMoeWorkspaceBytes(p.top_k, D, I), " 16-byte aligned"));
  }
  for (std::int64_t t0 = 0; t0 < p.tokens; t0 += kNqMaxDecodeTokens) {
    const NqMoeParams chunk = NqMoeTokenChunk(p, t0, std::min(kNqMaxDecodeTokens, p.tokens - t0));
    RETURN_IF_ERROR(LaunchChunk(chunk, static_cast<float*>(workspace), ctx));
  }
  return absl::OkStatus();
}

}  // namespace nq::kernels::cuda
