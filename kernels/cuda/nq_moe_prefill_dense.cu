#include "kernels/cuda/nq_moe_prefill_dense.cuh"

#include <cuda_fp16.h>


#include "absl/strings/str_cat.h"
#include "kernels/cuda/nq_moe_prefill.cuh"
#include "kernels/cuda/nq_moe_low_rank.cuh"
#include "kernels/cuda/nq_moe_vector.cuh"
#include "kernels/cuda/trellis_tile.cuh"
#include "kernels/nq_moe.h"
#include "services/common/status_macros.h"

namespace nq::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kCodesPerWord = 16;

struct Buffers {
  float* xr = nullptr;    // [C, D] rotated inputs
  float* acc = nullptr;   // [C, D] weighted sum of the experts' outputs, before the output rotation
  int* counts = nullptr;  // [E], then offsets [E]: copied to the host together
  int* offsets = nullptr;
  int* order = nullptr;   // [C * K]
  __half* xe = nullptr;   // [C, D] one expert's token rows
  float* he = nullptr;    // [C, 2I] its gate and up outputs
  __half* hh = nullptr;   // [C, I] SwiGLU, rotated for down_proj
  float* ye = nullptr;    // [C, D] its down outputs
  __half* w_gu[2] = {};  // [2I, D] an expert's dequantised gate and up rows (double buffer)
  __half* w_d[2] = {};   // [D, I] its dequantised down rows
};

// Carves the workspace (every piece 256-byte aligned); bytes needed when base is null.
std::size_t Carve(std::int64_t K, std::int64_t D, std::int64_t I, std::int64_t E, void* base, Buffers* b) {
  const std::int64_t C = kNqDensePrefillChunk;
  WorkspaceCarver carver(base);
  Buffers scratch;
  Buffers& out = b != nullptr ? *b : scratch;
  carver.Take(out.xr, C * D);
  carver.Take(out.acc, C * D);
  carver.Take(out.counts, 2 * E);
  out.offsets = base != nullptr ? out.counts + E : nullptr;
  carver.Take(out.order, C * K);
  carver.Take(out.xe, C * D);
  carver.Take(out.he, C * 2 * I);
  carver.Take(out.hh, C * I);
  carver.Take(out.ye, C * D);
  for (int k = 0; k < 2; ++k) {
    carver.Take(out.w_gu[k], 2 * I * D);
    carver.Take(out.w_d[k], D * I);
  }
  return carver.Bytes();
}

struct DequantParams {
  NqMoeParams p;
  NqProjectionView proj;
  int expert = 0;
  int rows = 0;
  int cols = 0;
  __half* out = nullptr;  // [rows, cols] row-major: rs * Q * cs
};

// The expert's residual plane of this projection when it runs at 4 bits, else null.
__device__ __forceinline__ const std::uint32_t* Residual(const DequantParams& d) {
  const int slot = d.p.slot_of_expert[d.expert];
  if (d.p.arena == nullptr || slot < 0 || slot >= d.p.num_slots) return nullptr;
  return reinterpret_cast<const std::uint32_t*>(NqSlotRecord(d.p, slot) + d.proj.residual_offset);
}

// nested_scalar_v1: one thread per code word (16 weights of one row).
__global__ void __launch_bounds__(kThreads) DequantScalarKernel(const __grid_constant__ DequantParams d) {
  __shared__ float levels[kNqLevelTable];
  if (threadIdx.x < kNqLevelTable) {
    levels[threadIdx.x] = d.proj.levels[static_cast<std::int64_t>(d.expert) * kNqLevelTable + threadIdx.x];
  }
  __syncthreads();
  const int words = d.cols / kCodesPerWord;
  const std::int64_t w = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (w >= static_cast<std::int64_t>(d.rows) * words) return;
  const int row = static_cast<int>(w / words), c0 = static_cast<int>(w % words) * kCodesPerWord;
  const std::int64_t plane_words = static_cast<std::int64_t>(d.rows) * words;
  const std::uint32_t base = reinterpret_cast<const std::uint32_t*>(d.proj.base)[d.expert * plane_words + w];
  const std::uint32_t* residual = Residual(d);
  const std::uint32_t res = residual != nullptr ? residual[w] : 0u;
  const float rs = d.proj.row_scales[static_cast<std::int64_t>(d.expert) * d.rows + row];
  const float* cs = d.proj.col_scales + static_cast<std::int64_t>(d.expert) * d.cols + c0;
  float w16[kCodesPerWord];
#pragma unroll
  for (int i = 0; i < kCodesPerWord; ++i) {
    const int b = (base >> (2 * i)) & 3;
    const float q = residual != nullptr ? levels[kNqBaseLevels + 4 * b + ((res >> (2 * i)) & 3)] : levels[b];
    w16[i] = rs * q * cs[i];
  }
  // Low-rank corrections (nq_moe_low_rank.cuh) into the weights: the GEMMs then apply them.
  AddLowRankRun(d.p, d.proj, d.expert, d.rows, d.cols, row, c0, w16);
  __align__(16) __half out[kCodesPerWord];
#pragma unroll
  for (int i = 0; i < kCodesPerWord; ++i) out[i] = __float2half_rn(w16[i]);
  uint4* dst = reinterpret_cast<uint4*>(d.out + static_cast<std::int64_t>(row) * d.cols + c0);
  dst[0] = reinterpret_cast<const uint4*>(out)[0];
  dst[1] = reinterpret_cast<const uint4*>(out)[1];
}

// trellis_v1: one thread per tile row (16 weights), rs * cs * (gb U(sb) [+ gr U(sr)]) as the CPU
// decoder computes it, U = (S - 510) / 147.8005 from trellis_tile.cuh's exact S - 510.
__global__ void __launch_bounds__(kThreads) DequantTrellisKernel(const __grid_constant__ DequantParams d) {
  const int blocks = d.cols / trellis::kTileDim;
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<std::int64_t>(d.rows) * blocks) return;
  const int row = static_cast<int>(idx / blocks), tj = static_cast<int>(idx % blocks);
  const int ti = row / trellis::kTileDim, tr = row % trellis::kTileDim;
  const std::int64_t tile_word = (static_cast<std::int64_t>(ti) * blocks + tj) * trellis::kTileWords;
  const std::int64_t plane_words = static_cast<std::int64_t>(d.rows) * d.cols / kCodesPerWord;
  const std::uint32_t* base = reinterpret_cast<const std::uint32_t*>(d.proj.base) + d.expert * plane_words + tile_word;
  const std::uint32_t* residual = Residual(d);
  __half2 sb[8], sr[8];
  trellis::TileRow(base[(tr + trellis::kTileWords - 1) % trellis::kTileWords], base[tr], sb);
  if (residual != nullptr) {
    residual += tile_word;
    trellis::TileRow(residual[(tr + trellis::kTileWords - 1) % trellis::kTileWords], residual[tr], sr);
  }
  const float* gains = d.proj.gains + (static_cast<std::int64_t>(d.expert) * blocks + tj) * kNqGainsPerBlock;
  const float gb = gains[0] * trellis::kInvByteSumSd, gr = gains[1] * trellis::kInvByteSumSd;
  const float rs = d.proj.row_scales[static_cast<std::int64_t>(d.expert) * d.rows + row];
  const int c0 = tj * trellis::kTileDim;
  const float* cs = d.proj.col_scales + static_cast<std::int64_t>(d.expert) * d.cols + c0;
  float w16[trellis::kTileDim];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float2 b = __half22float2(sb[i]);
    float2 q = make_float2(gb * b.x, gb * b.y);
    if (residual != nullptr) {
      const float2 r = __half22float2(sr[i]);
      q.x += gr * r.x;
      q.y += gr * r.y;
    }
    w16[2 * i] = rs * q.x * cs[2 * i];
    w16[2 * i + 1] = rs * q.y * cs[2 * i + 1];
  }
  AddLowRankRun(d.p, d.proj, d.expert, d.rows, d.cols, row, c0, w16);
  __align__(16) __half out[trellis::kTileDim];
#pragma unroll
  for (int i = 0; i < trellis::kTileDim; ++i) out[i] = __float2half_rn(w16[i]);
  uint4* dst = reinterpret_cast<uint4*>(d.out + static_cast<std::int64_t>(row) * d.cols + c0);
  dst[0] = reinterpret_cast<const uint4*>(out)[0];
  dst[1] = reinterpret_cast<const uint4*>(out)[1];
}

absl::Status Dequantise(const NqMoeParams& p, const NqProjectionView& proj, int expert, int rows, int cols,
                        __half* out, const LaunchContext& ctx) {
  const DequantParams d{.p = p, .proj = proj, .expert = expert, .rows = rows, .cols = cols, .out = out};
  const std::int64_t threads = static_cast<std::int64_t>(rows) * cols / kCodesPerWord;
  const unsigned grid = static_cast<unsigned>((threads + kThreads - 1) / kThreads);
  if (p.codec == NqCodec::kTrellis) {
    DequantTrellisKernel<<<grid, kThreads, 0, ctx.stream>>>(d);
    return CheckLaunch("DequantTrellisKernel");
  }
  DequantScalarKernel<<<grid, kThreads, 0, ctx.stream>>>(d);
  return CheckLaunch("DequantScalarKernel");
}

}  // namespace

std::size_t NqMoeDensePrefillWorkspaceBytes(std::int64_t top_k, std::int64_t hidden, std::int64_t intermediate,
                                            std::int64_t num_experts) {
  return Carve(top_k, hidden, intermediate, num_experts, nullptr, nullptr);
}

bool NqMoeDensePrefillPays(const NqMoeParams& p) {
  constexpr std::int64_t kMinRowsPerExpert = 128;
  return p.tokens * p.top_k >= kMinRowsPerExpert * p.num_experts && p.hidden % kCodesPerWord == 0 &&
         p.intermediate % kCodesPerWord == 0;
}

absl::Status LaunchNqMoeDensePrefill(const NqMoeParams& p, void* workspace, std::size_t workspace_bytes,
                                     const DensePrefillResources& r, const LaunchContext& ctx) {
  const std::int64_t T = p.tokens, K = p.top_k, D = p.hidden, I = p.intermediate, E = p.num_experts;
  if (T > kNqDensePrefillChunk) {
    return absl::InvalidArgumentError(
        absl::StrCat("NqMoe dense prefill: ", T, " tokens exceed the chunk of ", kNqDensePrefillChunk));
  }
  if (D % kCodesPerWord != 0 || I % kCodesPerWord != 0) {
    return absl::InvalidArgumentError(absl::StrCat("NqMoe dense prefill: hidden ", D, " and intermediate ", I,
                                                   " must be multiples of ", kCodesPerWord));
  }
  if (workspace_bytes < NqMoeDensePrefillWorkspaceBytes(K, D, I, E)) {
    return absl::InvalidArgumentError(absl::StrCat("NqMoe dense prefill: workspace of ", workspace_bytes,
                                                   " bytes, need ", NqMoeDensePrefillWorkspaceBytes(K, D, I, E)));
  }
  RETURN_IF_ERROR(CheckDensePrefillResources(r, E, "NqMoe dense prefill"));
  Buffers b;
  Carve(K, D, I, E, workspace, &b);
  RETURN_IF_ERROR(CublasStatus(cublasSetStream(r.blas, ctx.stream), "cublasSetStream"));
  const LaunchContext side{.stream = r.side, .num_sms = ctx.num_sms};

  NqVectorParams rotate{.p = p};
  rotate.xr = b.xr;
  RETURN_IF_ERROR(LaunchNqRotateInput(rotate, ctx));
  NQ_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(b.acc, 0, static_cast<std::size_t>(T * D) * sizeof(float), ctx.stream));
  RETURN_IF_ERROR(LaunchNqGroupByExpert(p.expert_ids, static_cast<int>(T * K), static_cast<int>(E), b.counts,
                                        b.offsets, b.order, ctx));
  // The group sizes are GEMM shapes: the one synchronisation of this path.
  NQ_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(r.host_counts, b.counts, 2 * E * sizeof(int), cudaMemcpyDeviceToHost,
                                          ctx.stream));
  NQ_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ctx.stream));
  const int* counts = r.host_counts;
  const int* offsets = r.host_counts + E;
  // The side stream starts after everything before this call (the weights' and slots' writers).
  NQ_CUDA_RETURN_IF_ERROR(cudaEventRecord(r.start, ctx.stream));
  NQ_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(r.side, r.start, 0));

  int used = 0;  // experts with tokens so far: buffer used % 2
  for (int e = 0; e < E; ++e) {
    const int n = counts[e];
    if (n == 0) continue;
    const int buf = used++ % 2;
    // Side stream: this expert's weights into `buf` once the expert two back is done with it.
    if (used > 2) NQ_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(r.side, r.free[buf], 0));
    RETURN_IF_ERROR(Dequantise(p, p.gate, e, static_cast<int>(I), static_cast<int>(D), b.w_gu[buf], side));
    RETURN_IF_ERROR(Dequantise(p, p.up, e, static_cast<int>(I), static_cast<int>(D), b.w_gu[buf] + I * D, side));
    RETURN_IF_ERROR(Dequantise(p, p.down, e, static_cast<int>(D), static_cast<int>(I), b.w_d[buf], side));
    NQ_CUDA_RETURN_IF_ERROR(cudaEventRecord(r.ready[buf], r.side));

    const int* order = b.order + offsets[e];
    RETURN_IF_ERROR(LaunchGatherExpertRows(b.xr, order, static_cast<int>(K), static_cast<int>(D), n, b.xe, ctx));
    NQ_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(ctx.stream, r.ready[buf], 0));
    RETURN_IF_ERROR(GemmRowsF16(r.blas, b.w_gu[buf], b.xe, b.he, static_cast<int>(2 * I), n, static_cast<int>(D)));
    NqVectorParams swiglu{.p = p};
    swiglu.hg = b.he;
    swiglu.hh_half = b.hh;
    swiglu.rows = n;
    RETURN_IF_ERROR(LaunchNqSwiglu(swiglu, ctx));
    RETURN_IF_ERROR(GemmRowsF16(r.blas, b.w_d[buf], b.hh, b.ye, static_cast<int>(D), n, static_cast<int>(I)));
    NQ_CUDA_RETURN_IF_ERROR(cudaEventRecord(r.free[buf], ctx.stream));
    RETURN_IF_ERROR(LaunchScatterAddExpertRows(b.ye, order, static_cast<int>(K), static_cast<int>(D), n,
                                               p.expert_weights, nullptr, b.acc, ctx));
  }
  return LaunchNqRotateOutput(p, b.acc, ctx);
}

}  // namespace nq::kernels::cuda
