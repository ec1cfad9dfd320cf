// The NVFP4 routed-expert block (issue #20): every routed expert of a layer held as ModelOpt's
// packed NVFP4 (kernels/nvfp4_codes.h), dequantised inside the GEMV, never expanded in memory.
//
// For each token t and each of its top-k assignments (expert e, weight w):
//   h   = GU_e x[t]                 fused gate/up rows: [2I, D], gate rows first, then up rows
//   a   = silu(h[0:I]) * h[I:2I]
//   out[t] += w * DOWN_e a          [D, I]
// with W[r][c] = E2M1(code[r][c]) * E4M3(scale[r][c / 16]) * global[e] for GU and DOWN alike.
// The fused gate/up matrix has ONE global scale per expert: the checkpoint's separate gate and
// up globals are reconciled when it is built (services/nvfp4/gate_up_repack.h,
// --nvfp4_gate_up_scale). The shared expert is not part of this op (callers add it).
#pragma once

#include <cstdint>

#include "kernels/nvfp4_moe_params.h"
#include "kernels/tensor.h"

namespace nq::kernels {

// One projection of every routed expert of a layer, ModelOpt layout per expert, experts stacked.
struct Nvfp4Projection {
  Tensor packed;         // U8 [E, rows, cols / 2]: E2M1 codes, element 2j in the low nibble of byte j
  Tensor scales;         // F8_E4M3 [E, rows, cols / 16]: the block scales (weight_scale)
  Tensor global_scales;  // F32 [E]: weight_scale_2 of each expert
};

// A layer's routed experts: E experts, hidden size D, intermediate size I (this rank's slice).
struct Nvfp4MoeWeights {
  std::int64_t hidden = 0;
  std::int64_t intermediate = 0;
  std::int64_t num_experts = 0;
  Nvfp4Projection gate_up;  // rows 2I, cols D
  Nvfp4Projection down;     // rows D, cols I
};

}  // namespace nq::kernels
