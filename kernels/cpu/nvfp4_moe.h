// CPU reference of the NVFP4 routed-expert block (contract: kernels/nvfp4_moe.h), built on the
// reference dequant-GEMV (kernels/cpu/nvfp4_gemv.h): the oracle the CUDA kernels are tested against.
#pragma once

#include "absl/status/status.h"
#include "kernels/nvfp4_moe_params.h"

namespace nq::kernels::cpu {

// InvalidArgument for an expert id outside [0, E) or repeated within a token, or a non-finite
// global scale (checked before anything is written); otherwise fills p.out. Each token's
// assignments are added in k order, so the result does not depend on `threads`.
absl::Status Nvfp4Moe(const Nvfp4MoeParams& p, int threads);

}  // namespace nq::kernels::cpu
