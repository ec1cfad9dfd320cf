#include "kernels/cuda/nq_moe_low_rank.cuh"

#include <algorithm>

#include "kernels/cuda/launch_dependent.cuh"
#include "kernels/cuda/reduce.cuh"
#include "services/common/status_macros.h"

namespace nq::kernels::cuda {
namespace {

struct NqLowRankParams {
  NqMoeParams p;  // tokens x top_k assignments, expert ids, slots, lowrank_rank
  NqProjectionView proj[2];
  int num_proj = 0;
  int rows = 0, cols = 0;  // of each projection
  // The rotated inputs, `cols` wide: row a / top_k (one per token) or row a (one per assignment).
  const float* in = nullptr;
  bool in_per_assignment = false;
  float* out = nullptr;  // out[a * out_stride + proj * rows + row], added to
  std::int64_t out_stride = 0;
};

constexpr int kLowRankThreads = 256;
constexpr int kLowRankWarps = kLowRankThreads / kWarpSize;
// The fewest rows a block corrects: below it, working out V v again costs more than the rows.
constexpr int kMinSliceRows = 256;

// t[k] += V[k] . v and t[kNqMaxLowRank + k] += V_r[k] . v over this thread's columns.
template <bool kVector>
__device__ __forceinline__ void PartialDots(const NqLowRankFactors& f, const float* v, int cols, int R,
                                            float (&t)[2 * kNqMaxLowRank]) {
  if constexpr (kVector) {  // cols % 4 == 0: V's and v's rows are 16-byte aligned
    const float4* v4 = reinterpret_cast<const float4*>(v);
    for (int c = threadIdx.x; c < cols / 4; c += blockDim.x) {
      const float4 x = v4[c];
#pragma unroll
      for (int k = 0; k < kNqMaxLowRank; ++k) {
        if (k >= R) break;
        const float4 w = reinterpret_cast<const float4*>(f.v + k * cols)[c];
        t[k] += w.x * x.x + w.y * x.y + w.z * x.z + w.w * x.w;
        if (f.v4 != nullptr) {
          const __half* h = f.v4 + k * cols + 4 * c;
          t[kNqMaxLowRank + k] += __half2float(h[0]) * x.x + __half2float(h[1]) * x.y + __half2float(h[2]) * x.z +
                                  __half2float(h[3]) * x.w;
        }
      }
    }
  } else {
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
      const float x = v[c];
#pragma unroll
      for (int k = 0; k < kNqMaxLowRank; ++k) {
        if (k >= R) break;
        t[k] += f.v[k * cols + c] * x;
        if (f.v4 != nullptr) t[kNqMaxLowRank + k] += __half2float(f.v4[k * cols + c]) * x;
      }
    }
  }
}

// grid (assignments, projections, row slices). Every block waits before anything else (also
// before an early return), so the kernel never completes ahead of the GEMV it follows.
template <bool kVector>
__global__ void __launch_bounds__(kLowRankThreads) NqLowRankKernel(const __grid_constant__ NqLowRankParams l) {
  __shared__ float partial[kLowRankWarps][2 * kNqMaxLowRank];
  __shared__ float t_shared[2 * kNqMaxLowRank];
  StartAsProgrammaticDependent();
  const int a = blockIdx.x, j = blockIdx.y, R = static_cast<int>(l.p.lowrank_rank);
  const NqProjectionView& proj = l.proj[j];
  const int e = l.p.expert_ids[a];
  if (proj.lowrank_u == nullptr || e < 0 || e >= l.p.num_experts) return;
  const NqLowRankFactors f = NqLowRankFactorsOf(l.p, proj, e, l.rows, l.cols);
  const float* v = l.in + static_cast<std::int64_t>(l.in_per_assignment ? a : a / l.p.top_k) * l.cols;
  float t[2 * kNqMaxLowRank] = {};
  PartialDots<kVector>(f, v, l.cols, R, t);
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
#pragma unroll
  for (int k = 0; k < 2 * kNqMaxLowRank; ++k) {
    const float s = WarpSum(t[k]);
    if (lane == 0) partial[warp][k] = s;
  }
  __syncthreads();
  if (threadIdx.x < 2 * kNqMaxLowRank) {
    float s = 0.0f;
    for (int w = 0; w < kLowRankWarps; ++w) s += partial[w][threadIdx.x];
    t_shared[threadIdx.x] = s;
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < 2 * kNqMaxLowRank; ++k) t[k] = t_shared[k];
  // This block's slice of the rows.
  const int per_slice = (l.rows + gridDim.z - 1) / gridDim.z;
  const int row_end = min(l.rows, (static_cast<int>(blockIdx.z) + 1) * per_slice);
  float* y = l.out + a * l.out_stride + static_cast<std::int64_t>(j) * l.rows;
  for (int i = blockIdx.z * per_slice + threadIdx.x; i < row_end; i += blockDim.x) {
    float acc = 0.0f;
#pragma unroll
    for (int k = 0; k < kNqMaxLowRank; ++k) {
      if (k >= R) break;
      acc += f.u[i * R + k] * t[k];
      if (f.u4 != nullptr) acc += __half2float(f.u4[i * R + k]) * t[kNqMaxLowRank + k];
    }
    y[i] += acc;
  }
}

absl::Status Launch(const NqLowRankParams& l, const LaunchContext& ctx) {
  const std::int64_t assignments = l.p.tokens * l.p.top_k;
  if (assignments == 0 || l.num_proj < 1 || l.num_proj > 2 || l.rows <= 0 || l.cols <= 0) {
    return absl::InvalidArgumentError("NqLowRank: no assignments, no rows or columns, or not 1 or 2 projections");
  }
  // Enough blocks for about two per SM (decode: a few assignments), each at least kMinSliceRows.
  const std::int64_t wanted = CeilDiv(2 * static_cast<std::int64_t>(ctx.num_sms), assignments * l.num_proj);
  const std::int64_t slices = std::clamp<std::int64_t>(wanted, 1, std::max(1, l.rows / kMinSliceRows));
  const dim3 grid(static_cast<unsigned>(assignments), static_cast<unsigned>(l.num_proj), static_cast<unsigned>(slices));
  if (l.cols % 4 == 0) {
    RETURN_IF_ERROR(LaunchProgrammaticDependent(NqLowRankKernel<true>, grid, dim3(kLowRankThreads), 0, ctx, l));
  } else {
    RETURN_IF_ERROR(LaunchProgrammaticDependent(NqLowRankKernel<false>, grid, dim3(kLowRankThreads), 0, ctx, l));
  }
  return CheckLaunch("NqLowRankKernel");
}

}  // namespace

absl::Status LaunchNqLowRankGateUp(const NqMoeParams& p, const float* xr, float* hg, const LaunchContext& ctx) {
  if (!NqLowRankOnGateUp(p)) return absl::OkStatus();
  return Launch({.p = p,
                 .proj = {p.gate, p.up},
                 .num_proj = 2,
                 .rows = static_cast<int>(p.intermediate),
                 .cols = static_cast<int>(p.hidden),
                 .in = xr,
                 .in_per_assignment = false,
                 .out = hg,
                 .out_stride = 2 * p.intermediate},
                ctx);
}

absl::Status LaunchNqLowRankDown(const NqMoeParams& p, const float* hh, float* yd, const LaunchContext& ctx) {
  if (!NqLowRankOnDown(p)) return absl::OkStatus();
  return Launch({.p = p,
                 .proj = {p.down, p.down},
                 .num_proj = 1,
                 .rows = static_cast<int>(p.hidden),
                 .cols = static_cast<int>(p.intermediate),
                 .in = hh,
                 .in_per_assignment = true,
                 .out = yd,
                 .out_stride = p.hidden},
                ctx);
}

}  // namespace nq::kernels::cuda
