// Low-rank corrections on the CUDA NqMoe paths (kernels/nq_moe.h states the math; issue #16):
// a projection with factors adds, in the rotated domain where its GEMV runs,
//   y' += U_b (V_b v)  [+ U_r (V_r v) when the expert runs at 4 bits]
// v being the GEMV's rotated input (before the column scales). U_b, V_b are the resident F32
// factors, U_r, V_r the fp16 ones in the expert's slot record at the projection's lowrank_offset.
//   LaunchNqLowRank*    the decode and grouped-prefill paths: after a projection's GEMV, blocks
//                       per (assignment, projection, slice of rows) add the correction to the
//                       GEMV's fp32 outputs (each block works out V v itself: V is small and
//                       sits in L2 after the first)
//   AddLowRankRun       the dense prefill path: the dequantisation kernels add U V to the 16
//                       weights each thread writes, so cuBLAS multiplies corrected weights
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/nq_moe.h"
#include "kernels/nq_moe_params.h"

namespace nq::kernels::cuda {

#if defined(__CUDACC__)
// One expert's factors of one projection: resident F32, and the slot's fp16 ones or null.
struct NqLowRankFactors {
  const float* u = nullptr;    // [rows][R]
  const float* v = nullptr;    // [R][cols]
  const __half* u4 = nullptr;  // [rows][R], or null (2 bits, or no slot factors)
  const __half* v4 = nullptr;  // [R][cols]
};

__device__ __forceinline__ NqLowRankFactors NqLowRankFactorsOf(const NqMoeParams& p, const NqProjectionView& proj,
                                                               int e, int rows, int cols) {
  const std::int64_t R = p.lowrank_rank;
  NqLowRankFactors f{.u = proj.lowrank_u + e * rows * R, .v = proj.lowrank_v + e * R * cols};
  const std::int32_t slot = p.slot_of_expert[e];
  if (proj.lowrank_offset >= 0 && p.arena != nullptr && slot >= 0 && slot < p.num_slots) {
    // lowrank_offset is even (Backend::NqMoe checks it): the fp16 reads are aligned.
    f.u4 = reinterpret_cast<const __half*>(NqSlotRecord(p, slot) + proj.lowrank_offset);
    f.v4 = f.u4 + static_cast<std::int64_t>(rows) * R;
  }
  return f;
}

// w[j] += (U V)[row][c0 + j] for j < n at the levels expert e runs at: the dense prefill's
// dequantisation, for the n consecutive weights of a row one thread writes. A no-op without factors.
template <int n>
__device__ __forceinline__ void AddLowRankRun(const NqMoeParams& p, const NqProjectionView& proj, int e, int rows,
                                              int cols, int row, int c0, float (&w)[n]) {
  if (p.lowrank_rank == 0 || proj.lowrank_u == nullptr) return;
  const int R = static_cast<int>(p.lowrank_rank);
  const NqLowRankFactors f = NqLowRankFactorsOf(p, proj, e, rows, cols);
#pragma unroll
  for (int k = 0; k < kNqMaxLowRank; ++k) {
    if (k >= R) break;
    const float u = f.u[row * R + k];
    const float u4 = f.u4 != nullptr ? __half2float(f.u4[row * R + k]) : 0.0f;
#pragma unroll
    for (int j = 0; j < n; ++j) {
      w[j] += u * f.v[k * cols + c0 + j];
      if (f.u4 != nullptr) w[j] += u4 * __half2float(f.v4[k * cols + c0 + j]);
    }
  }
}
#endif

// Whether gate or up, and whether down, has factors (else its correction is not launched, and the
// decode path's preparations do not keep its rotated input).
inline bool NqLowRankOnGateUp(const NqMoeParams& p) {
  return p.lowrank_rank > 0 && (p.gate.lowrank_u != nullptr || p.up.lowrank_u != nullptr);
}
inline bool NqLowRankOnDown(const NqMoeParams& p) { return p.lowrank_rank > 0 && p.down.lowrank_u != nullptr; }

// The corrections of the decode and grouped-prefill paths, which share their buffers' layouts
// (NqVectorParams): launched right after the GEMV they correct, as its programmatic dependents; no
// launch where the projections have no factors.
// hg[a] (gate rows, then up rows: 2 x intermediate) += the corrections of v = xr[a / top_k].
absl::Status LaunchNqLowRankGateUp(const NqMoeParams& p, const float* xr, float* hg, const LaunchContext& ctx);
// yd[a] (hidden) += the corrections of v = hh[a] (intermediate).
absl::Status LaunchNqLowRankDown(const NqMoeParams& p, const float* hh, float* yd, const LaunchContext& ctx);

}  // namespace nq::kernels::cuda
