#include "kernels/cuda/nq_moe_low_rank.cuh"

#include "kernels/cuda/launch_dependent.cuh"
#include "kernels/cuda/reduce.cuh"
#include "kernels/nq_moe.h"
#include "services/common/status_macros.h"

namespace nq::kernels::cuda {
namespace {

constexpr int kLowRankThreads = 512;
constexpr int kLowRankWarps = kLowRankThreads / kWarpSize;
constexpr int kDenseThreads = 256;

// One expert's factors of one projection: resident F32, and the slot's fp16 ones or null.
struct Factors {
  const float* u = nullptr;   // [rows][R]
  const float* v = nullptr;   // [R][cols]
  const __half* u4 = nullptr;  // [rows][R] or null (2 bits, or no slot factors)
  const __half* v4 = nullptr;  // [R][cols]
};

__device__ __forceinline__ Factors FactorsOf(const NqMoeParams& p, const NqProjectionView& proj, int e, int rows,
                                             int cols) {
  const std::int64_t R = p.lowrank_rank;
  Factors f{.u = proj.lowrank_u + e * rows * R, .v = proj.lowrank_v + e * R * cols};
  const std::int32_t slot = p.slot_of_expert[e];
  if (proj.lowrank_offset >= 0 && p.arena != nullptr && slot >= 0 && slot < p.num_slots) {
    // lowrank_offset is even (Backend::NqMoe checks it): the fp16 reads are aligned.
    f.u4 = reinterpret_cast<const __half*>(NqSlotRecord(p, slot) + proj.lowrank_offset);
    f.v4 = f.u4 + static_cast<std::int64_t>(rows) * R;
  }
  return f;
}

// grid (assignments, projections). Every block waits before anything else (also before an early
// return), so the kernel never completes ahead of the GEMV it follows.
__global__ void __launch_bounds__(kLowRankThreads) NqLowRankKernel(const __grid_constant__ NqLowRankParams l) {
  __shared__ float partial[kLowRankWarps][2 * kNqMaxLowRank];
  __shared__ float t_shared[2 * kNqMaxLowRank];
  StartAsProgrammaticDependent();
  const int a = blockIdx.x, j = blockIdx.y, R = static_cast<int>(l.p.lowrank_rank);
  const NqProjectionView& proj = l.proj[j];
  const int e = l.p.expert_ids[a];
  if (proj.lowrank_u == nullptr || e < 0 || e >= l.p.num_experts) return;
  const Factors f = FactorsOf(l.p, proj, e, l.rows, l.cols);
  const int cols = l.cols;
  const float* v = l.in + static_cast<std::int64_t>(l.in_per_assignment ? a : a / l.p.top_k) * cols;
  // t = V_b v and t4 = V_r v: R dot products each, strided over the block, then reduced.
  float t[2 * kNqMaxLowRank] = {};
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    const float x = v[c];
#pragma unroll
    for (int k = 0; k < kNqMaxLowRank; ++k) {
      if (k < R) t[k] += f.v[k * cols + c] * x;
    }
    if (f.v4 != nullptr) {
#pragma unroll
      for (int k = 0; k < kNqMaxLowRank; ++k) {
        if (k < R) t[kNqMaxLowRank + k] += __half2float(f.v4[k * cols + c]) * x;
      }
    }
  }
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
  float* y = l.out + a * l.out_stride + static_cast<std::int64_t>(j) * l.rows;
  for (int i = threadIdx.x; i < l.rows; i += blockDim.x) {
    float acc = 0.0f;
#pragma unroll
    for (int k = 0; k < kNqMaxLowRank; ++k) {
      if (k < R) acc += f.u[i * R + k] * t[k];
    }
    if (f.u4 != nullptr) {
#pragma unroll
      for (int k = 0; k < kNqMaxLowRank; ++k) {
        if (k < R) acc += __half2float(f.u4[i * R + k]) * t[kNqMaxLowRank + k];
      }
    }
    y[i] += acc;
  }
}

// One thread per weight: w[i][c] += sum_k U[i][k] V[k][c] at the levels the expert runs at.
__global__ void __launch_bounds__(kDenseThreads)
    NqLowRankIntoDenseKernel(const __grid_constant__ NqMoeParams p, const __grid_constant__ NqProjectionView proj,
                             int expert, int rows, int cols, __half* w) {
  const std::int64_t n = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= static_cast<std::int64_t>(rows) * cols) return;
  const int i = static_cast<int>(n / cols), c = static_cast<int>(n % cols), R = static_cast<int>(p.lowrank_rank);
  const Factors f = FactorsOf(p, proj, expert, rows, cols);
  float acc = 0.0f;
#pragma unroll
  for (int k = 0; k < kNqMaxLowRank; ++k) {
    if (k < R) acc += f.u[i * R + k] * f.v[k * cols + c];
  }
  if (f.u4 != nullptr) {
#pragma unroll
    for (int k = 0; k < kNqMaxLowRank; ++k) {
      if (k < R) acc += __half2float(f.u4[i * R + k]) * __half2float(f.v4[k * cols + c]);
    }
  }
  w[n] = __float2half_rn(__half2float(w[n]) + acc);
}

}  // namespace

absl::Status LaunchNqLowRank(const NqLowRankParams& l, const LaunchContext& ctx) {
  const std::int64_t assignments = l.p.tokens * l.p.top_k;
  if (assignments == 0 || l.num_proj < 1 || l.num_proj > 2) {
    return absl::InvalidArgumentError("NqLowRank: no assignments, or not 1 or 2 projections");
  }
  const dim3 grid(static_cast<unsigned>(assignments), static_cast<unsigned>(l.num_proj));
  RETURN_IF_ERROR(LaunchProgrammaticDependent(NqLowRankKernel, grid, dim3(kLowRankThreads), 0, ctx, l));
  return CheckLaunch("NqLowRankKernel");
}

absl::Status LaunchNqLowRankIntoDense(const NqMoeParams& p, const NqProjectionView& proj, int expert, int rows,
                                      int cols, __half* w, const LaunchContext& ctx) {
  if (p.lowrank_rank == 0 || proj.lowrank_u == nullptr) return absl::OkStatus();
  const std::int64_t n = static_cast<std::int64_t>(rows) * cols;
  const unsigned grid = static_cast<unsigned>(CeilDiv(n, kDenseThreads));
  NqLowRankIntoDenseKernel<<<grid, kDenseThreads, 0, ctx.stream>>>(p, proj, expert, rows, cols, w);
  return CheckLaunch("NqLowRankIntoDenseKernel");
}

}  // namespace nq::kernels::cuda
