// CPU reference of the NestQuant routed-expert block (contract: kernels/nq_moe.h).
#pragma once

#include "absl/status/status.h"
#include "kernels/nq_moe_params.h"

namespace nq::kernels::cpu {

// InvalidArgument for an expert id outside [0, E) or repeated within a token (checked before
// anything is written); otherwise fills p.out.
absl::Status NqMoe(const NqMoeParams& p, int threads);

}  // namespace nq::kernels::cpu
