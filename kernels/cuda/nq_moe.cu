#include "kernels/cuda/nq_moe.cuh"

#include <cuda_fp16.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/launch_dependent.cuh"
#include "kernels/cuda/nq_moe_low_rank.cuh"
#include "kernels/cuda/nq_moe_gemv.cuh"
#include "kernels/cuda/nq_moe_vector.cuh"
#include "kernels/cuda/reduce.cuh"
#include "kernels/nq_moe.h"
#include "services/quant/trellis_decode.h"
#include "services/common/status_macros.h"

namespace nq::kernels::cuda {
namespace {

// Where the decode path's GEMV inputs go: for assignment a and projection j, xh holds the input
// times expert e's column scales as fp16 in the GEMV's layout (nq_moe_gemv.cuh).
struct PrepParams {
  NqMoeParams p;
  NqProjectionView proj[2];
  int cols = 0;
  __half* xh = nullptr;
  float* xsum = nullptr;  // nested_scalar_v1: the even-grid plane's partial sums (NqGemvParams)
  int xsum_parts = 0;     // per vector: gridDim.y * warps per block
  float* zero = nullptr;  // [A][zero_width]: the next GEMV's outputs, zeroed here
  int zero_width = 0;
  // Where the GEMV's rotated input is kept in fp32 for the low-rank corrections (one row per
  // token for gate/up, per assignment for down), or null when the layer has none.
  float* rotated = nullptr;
};

// Warps of a preparation block (its last may be partial).
__device__ __forceinline__ int PrepWarps() { return (blockDim.x + kWarpSize - 1) / kWarpSize; }

// The sum over the calling warp's active lanes (a block's last warp may be partial), in lane 0.
__device__ __forceinline__ float PartialWarpSum(float v) {
  const int lane = threadIdx.x % kWarpSize;
  const int active = min(kWarpSize, static_cast<int>(blockDim.x) - static_cast<int>(threadIdx.x) + lane);
  const unsigned mask = active == kWarpSize ? 0xffffffffu : (1u << active) - 1u;
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const float other = __shfl_down_sync(mask, v, offset);
    if (lane + offset < active) v += other;
  }
  return v;
}

// The decode path's inputs, straight from the rotations (no fp32 round trip and no max pass):
// each CUDA block takes one Hadamard block of a vector and writes, for every assignment that
// needs it, the fp16 input of the GEMV (times the expert's column scales, in the GEMV layout).
// Contract: the scaled inputs stay inside fp16's range (|v| < 65504; rotated, RMS-normed hidden
// states times column scales are orders of magnitude below it).
// One thread per element of a Hadamard block (up to 512 wide), so each phase of these latency-
// bound kernels pays one round trip to memory rather than a loop of them.
constexpr int kVectorMaxThreads = 512;
int ChunkThreads(std::int64_t n) { return static_cast<int>(std::min<std::int64_t>(n, kVectorMaxThreads)); }

// Elements [c0, c0 + n) of the GEMV input vectors of one (assignment, projection): v times the
// expert's column scales, and for trellis_v1 one vector per plane, also times the plane's gain of
// the column block and 1/147.8005 (nq_moe_gemv.cuh). nested_scalar_v1 writes the even-grid plane
// beside it (times 4^-j) and each warp's sum of that plane's inputs times 4^j into sums[slot].
// The block of c0 == 0 zeroes the padding.
__device__ __forceinline__ void WritePrepared(const float* v, int n, int c0, const float* cs, const float* gains,
                                              int cols, __half* xh, float* sums) {
  const std::int64_t padded = NqGemvPaddedCols(cols);
  if (gains == nullptr) {
    float sum = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const int c = c0 + i;
      const float x = v[i] * cs[c], scale = NqGemvEvenGridInputScale(c);
      const __half even = __float2half_rn(x * scale);
      xh[NqGemvInputIndex(c)] = __float2half_rn(x);
      xh[padded + NqGemvInputIndex(c)] = even;
      sum += __half2float(even) / scale;  // exact: scale is a power of two
    }
    sum = PartialWarpSum(sum);
    if (threadIdx.x % kWarpSize == 0) sums[blockIdx.y * PrepWarps() + threadIdx.x / kWarpSize] = sum;
    if (c0 == 0) {
      for (int c = cols + threadIdx.x; c < padded; c += blockDim.x) {
        xh[NqGemvInputIndex(c)] = xh[padded + NqGemvInputIndex(c)] = __float2half_rn(0.0f);
      }
    }
    return;
  }
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int c = c0 + i;
    const float scaled = v[i] * cs[c] * quant::trellis::kInvByteSumSd;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      xh[q * padded + NqGemvTrellisInputIndex(c)] = __float2half_rn(scaled * gains[(c / 16) * kNqGainsPerBlock + q]);
    }
  }
  if (c0 == 0) {
    for (int c = cols + threadIdx.x; c < padded; c += blockDim.x) {
      xh[NqGemvTrellisInputIndex(c)] = xh[padded + NqGemvTrellisInputIndex(c)] = __float2half_rn(0.0f);
    }
  }
}

// The expert's gains of one projection (trellis_v1), or null.
__device__ __forceinline__ const float* ExpertGains(const NqMoeParams& p, const NqProjectionView& proj, int e,
                                                    int cols) {
  if (p.codec != NqCodec::kTrellis) return nullptr;
  return proj.gains + static_cast<std::int64_t>(e) * (cols / 16) * kNqGainsPerBlock;
}

// grid (T, D / input.block, K): xr chunk = H (signs * x chunk), then the gate and up inputs of
// assignment k of token t. Each (token, chunk) is rotated K times over: a few hundred flops
// against one serial chain of column-scale loads per block instead of 2K.
// Both preparation kernels let the GEMV that follows launch at once (griddepcontrol): its
// blocks build their plans and start their code copies while these run, then wait for them.
__device__ __forceinline__ void LetTheGemvStart() { LetDependentsLaunch(); }

__device__ __forceinline__ void PrefetchL2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

__global__ void __launch_bounds__(kVectorMaxThreads) NqRotatePrepKernel(const __grid_constant__ PrepParams g) {
  extern __shared__ float chunk[];
  // A programmatic dependent of the routing: its experts and x come from before. The GEMV may
  // launch only after this wait, as it reads the routing's expert ids before its own wait (the
  // routing is then complete and its writes visible to every later launch; before it, they were
  // only issued).
  WaitForPrerequisiteGrid();
  LetTheGemvStart();
  const int D = g.cols, t = blockIdx.x, K = static_cast<int>(g.p.top_k), k = blockIdx.z;
  const int n = static_cast<int>(g.p.input.block), c0 = blockIdx.y * n;
  const int a = t * K + k, e = g.p.expert_ids[a];
  // The gate/up GEMV adds into its outputs: zero this assignment's, a slice per block.
  float* out = g.zero + static_cast<std::int64_t>(a) * g.zero_width;
  for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < g.zero_width; i += gridDim.y * blockDim.x) out[i] = 0.0f;
  const bool valid = e >= 0 && e < g.p.num_experts;
  // The token's rotated input for the low-rank corrections comes from its k == 0 blocks, whose
  // expert may be invalid while another of the token's is not: they rotate regardless.
  const bool keeps_rotated = g.rotated != nullptr && k == 0;
  if (!valid && !keeps_rotated) return;
  // The column scales are read after the rotation: start pulling them into L2 now.
  for (int i = threadIdx.x; valid && i < n && g.p.codec != NqCodec::kTrellis; i += blockDim.x) {
    PrefetchL2(g.proj[0].col_scales + std::int64_t{e} * D + c0 + i);
    PrefetchL2(g.proj[1].col_scales + std::int64_t{e} * D + c0 + i);
  }
  for (int i = threadIdx.x; i < n; i += blockDim.x) chunk[i] = g.p.x[t * D + c0 + i] * g.p.input.signs[c0 + i];
  __syncthreads();
  BlockFwht(chunk, n, n);
  const float scale = rsqrtf(static_cast<float>(n));
  for (int i = threadIdx.x; i < n; i += blockDim.x) chunk[i] *= scale;
  __syncthreads();
  if (keeps_rotated) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) g.rotated[static_cast<std::int64_t>(t) * D + c0 + i] = chunk[i];
  }
  if (!valid) return;
  const std::int64_t padded = NqGemvPaddedCols(D), planes = NqGemvInputPlanes(g.p.codec);
  for (int j = 0; j < 2; ++j) {
    const std::int64_t vec = static_cast<std::int64_t>(a) * 2 + j;
    WritePrepared(chunk, n, c0, g.proj[j].col_scales + static_cast<std::int64_t>(e) * D,
                  ExpertGains(g.p, g.proj[j], e, D), D, g.xh + vec * planes * padded, g.xsum + vec * g.xsum_parts);
  }
}

// grid (A, I / n), n = the larger of the two intermediate Hadamard blocks: g and u unrotated,
// silu(g) * u rotated for down_proj, the down input written.
// Launched as a programmatic dependent of the gate/up GEMV (LaunchProgrammaticDependent): the
// launch overlaps the GEMV's end, the column scales this block will need are pulled into L2
// meanwhile, and nothing the GEMV writes is read before griddepcontrol.wait.
__global__ void __launch_bounds__(kVectorMaxThreads) NqSwigluPrepKernel(const __grid_constant__ PrepParams g,
                                                                     const float* hg, int n) {
  extern __shared__ float chunk[];  // [2n]: gate then up
  LetTheGemvStart();
  const int I = g.cols, a = blockIdx.x, c0 = blockIdx.y * n;
  const int e = g.p.expert_ids[a];
  if (e >= 0 && e < g.p.num_experts && g.p.codec != NqCodec::kTrellis) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) PrefetchL2(g.proj[0].col_scales + std::int64_t{e} * I + c0 + i);
  }
  WaitForPrerequisiteGrid();
  // The down GEMV adds into its outputs: zero this assignment's, a slice per block.
  float* out = g.zero + static_cast<std::int64_t>(a) * g.zero_width;
  for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < g.zero_width; i += gridDim.y * blockDim.x) out[i] = 0.0f;
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
  if (g.rotated != nullptr) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) g.rotated[static_cast<std::int64_t>(a) * I + c0 + i] = chunk[i];
  }
  WritePrepared(chunk, n, c0, g.proj[0].col_scales + static_cast<std::int64_t>(e) * I, ExpertGains(g.p, g.proj[0], e, I),
                I, g.xh + static_cast<std::int64_t>(a) * NqGemvInputPlanes(g.p.codec) * NqGemvPaddedCols(I),
                g.xsum + static_cast<std::int64_t>(a) * g.xsum_parts);
}

absl::Status LaunchChunk(const NqMoeParams& p, float* ws, const LaunchContext& ctx) {
  const std::int64_t T = p.tokens, K = p.top_k, D = p.hidden, I = p.intermediate;
  NqVectorParams v{.p = p};
  v.xr = ws;
  v.hg = v.xr + kNqMaxDecodeTokens * D;
  v.hh = v.hg + kNqMaxDecodeTokens * K * 2 * I;
  v.yd = v.hh + kNqMaxDecodeTokens * K * I;
  float* xsum = v.yd + kNqMaxDecodeTokens * K * D;
  __half* xh = reinterpret_cast<__half*>(xsum + NqMoeInputSumFloats(K, D, I));
  // Partial sums per input vector: one per warp of each preparation block (PrepWarps).
  auto parts = [](std::int64_t cols, std::int64_t block) {
    return static_cast<int>(cols / block * ((std::min<std::int64_t>(block, kVectorMaxThreads) + kWarpSize - 1) / kWarpSize));
  };
  const int gate_parts = parts(D, p.input.block);
  const int n_down = static_cast<int>(std::max(p.gate_rows.block, p.down_cols.block));
  const int down_parts = parts(I, n_down);
  // Low-rank corrections (nq_moe_low_rank.cuh): the preparations keep the rotated inputs in
  // fp32 (xr, hh), and each GEMV with factors is followed by the kernel that adds them.
  {
    const PrepParams prep{.p = p,
                          .proj = {p.gate, p.up},
                          .cols = static_cast<int>(D),
                          .xh = xh,
                          .xsum = xsum,
                          .xsum_parts = gate_parts,
                          .zero = v.hg,
                          .zero_width = static_cast<int>(2 * I),
                          .rotated = NqLowRankOnGateUp(p) ? v.xr : nullptr};
    const std::size_t smem = p.input.block * sizeof(float);
    NQ_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(NqRotatePrepKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(smem)));
    const dim3 grid(static_cast<unsigned>(T), static_cast<unsigned>(D / p.input.block), static_cast<unsigned>(K));
    RETURN_IF_ERROR(
        LaunchProgrammaticDependent(NqRotatePrepKernel, grid, dim3(ChunkThreads(p.input.block)), smem, ctx, prep));
    RETURN_IF_ERROR(CheckLaunch("NqRotatePrepKernel"));
  }
  RETURN_IF_ERROR(LaunchNqGemv({.p = p,
                                .proj = {p.gate, p.up},
                                .num_proj = 2,
                                .rows = static_cast<int>(I),
                                .cols = static_cast<int>(D),
                                .xh = xh,
                                .xsum = xsum,
                                .xsum_parts = gate_parts,
                                .out = v.hg,
                                .out_stride = 2 * I},
                               ctx));
  RETURN_IF_ERROR(LaunchNqLowRankGateUp(p, v.xr, v.hg, ctx));
  {
    const PrepParams prep{.p = p,
                          .proj = {p.down, p.down},
                          .cols = static_cast<int>(I),
                          .xh = xh,
                          .xsum = xsum,
                          .xsum_parts = down_parts,
                          .zero = v.yd,
                          .zero_width = static_cast<int>(D),
                          .rotated = NqLowRankOnDown(p) ? v.hh : nullptr};
    const int n = n_down;
    const std::size_t smem = 2 * n * sizeof(float);
    NQ_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(NqSwigluPrepKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(smem)));
    RETURN_IF_ERROR(LaunchProgrammaticDependent(NqSwigluPrepKernel,
                                                dim3(static_cast<unsigned>(T * K), static_cast<unsigned>(I / n)),
                                                ChunkThreads(n), smem, ctx, prep, static_cast<const float*>(v.hg), n));
    RETURN_IF_ERROR(CheckLaunch("NqSwigluPrepKernel"));
  }
  RETURN_IF_ERROR(LaunchNqGemv({.p = p,
                                .proj = {p.down, p.down},
                                .num_proj = 1,
                                .rows = static_cast<int>(D),
                                .cols = static_cast<int>(I),
                                .xh = xh,
                                .xsum = xsum,
                                .xsum_parts = down_parts,
                                .out = v.yd,
                                .out_stride = D},
                               ctx));
  RETURN_IF_ERROR(LaunchNqLowRankDown(p, v.hh, v.yd, ctx));
  return LaunchNqCombine(v, ctx);
}

}  // namespace

std::int64_t NqMoeInputSumFloats(std::int64_t top_k, std::int64_t hidden, std::int64_t intermediate) {
  // At most one partial per input (a block of one column has one warp), for gate and up.
  return kNqMaxDecodeTokens * top_k * 2 * std::max(hidden, intermediate);
}

std::size_t NqMoeWorkspaceBytes(std::int64_t top_k, std::int64_t hidden, std::int64_t intermediate) {
  const std::int64_t A = kNqMaxDecodeTokens * top_k;
  const std::int64_t floats = kNqMaxDecodeTokens * hidden + A * (2 * intermediate + intermediate + hidden) +
                              NqMoeInputSumFloats(top_k, hidden, intermediate);
  // Two input planes per (assignment, projection): what trellis_v1 needs, the most of any codec.
  const std::int64_t halves =
      A * 2 * 2 * std::max(NqGemvPaddedCols(static_cast<int>(hidden)), NqGemvPaddedCols(static_cast<int>(intermediate)));
  return static_cast<std::size_t>(floats) * sizeof(float) + static_cast<std::size_t>(halves) * sizeof(__half);
}

absl::Status LaunchNqMoe(const NqMoeParams& p, void* workspace, std::size_t workspace_bytes, const LaunchContext& ctx) {
  const std::int64_t D = p.hidden, I = p.intermediate;
  if (D % kCodesPerWord != 0 || I % kCodesPerWord != 0 || 2 * I > kNqMaxVectorWidth || D > kNqMaxVectorWidth) {
    return absl::InvalidArgumentError(absl::StrCat("NqMoe (CUDA): hidden ", D, " and intermediate ", I,
                                                   " must be multiples of ", kCodesPerWord, " with hidden and 2 x "
                                                   "intermediate at most ", kNqMaxVectorWidth));
  }
  if (kNqMaxDecodeTokens * p.top_k > kNqMaxDecodeAssignments) {
    return absl::InvalidArgumentError(absl::StrCat("NqMoe (CUDA): top_k ", p.top_k, " exceeds ",
                                                   kNqMaxDecodeAssignments / kNqMaxDecodeTokens));
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
