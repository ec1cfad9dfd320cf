// Low-rank corrections on the CUDA NqMoe paths (kernels/nq_moe.h states the math; issue #16):
// a projection with factors adds, in the rotated domain where its GEMV runs,
//   y' += U_b (V_b v)  [+ U_r (V_r v) when the expert runs at 4 bits]
// v being the GEMV's rotated input (before the column scales). U_b, V_b are the resident F32
// factors, U_r, V_r the fp16 ones in the expert's slot record at the projection's lowrank_offset.
//   LaunchNqLowRank           the decode and grouped-prefill paths: after a projection's GEMV,
//                             one block per (assignment, projection) adds the correction to the
//                             GEMV's fp32 outputs
//   LaunchNqLowRankIntoDense  the dense prefill path: U V added to an expert's dequantised fp16
//                             weights before its cuBLAS GEMM, so its tokens need nothing more
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/nq_moe_params.h"

namespace nq::kernels::cuda {

// Whether the op has any factors (the launches below are skipped when not).
inline bool NqLowRankApplies(const NqMoeParams& p) {
  return p.lowrank_rank > 0 &&
         (p.gate.lowrank_u != nullptr || p.up.lowrank_u != nullptr || p.down.lowrank_u != nullptr);
}

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

// Launched as a programmatic dependent of the GEMV that wrote `out` (it waits for it first).
absl::Status LaunchNqLowRank(const NqLowRankParams& l, const LaunchContext& ctx);

// w [rows][cols] (fp16, row-major: expert `expert`'s rows x cols weights of `proj` in the rotated
// domain, row and column scales applied) += U_b V_b, + U_r V_r when the expert has a slot. The
// slot is read on the device, as the dequantisation does. A no-op launch-free return when the
// projection has no factors.
absl::Status LaunchNqLowRankIntoDense(const NqMoeParams& p, const NqProjectionView& proj, int expert, int rows,
                                      int cols, __half* w, const LaunchContext& ctx);

}  // namespace nq::kernels::cuda
