// The decode GEMV of nested_scalar_v1 experts at whole 256-input steps (cols % kNqStepCodes ==
// 0: every real model's shapes), with its code words loaded straight into registers: a warp
// holds its next step's code words in a register slot, reloaded as soon as the step is decoded,
// and the SM's other warps cover the load's latency (the NVFP4 GEMV loads into registers too,
// which beat a cp.async ring by 12 % there; one slot beat two to eight, whose unrolled loops cost
// instruction fetch: bench/README.md). No shared-memory ring, no copy groups to commit and wait
// for, no shared-memory reads.
//
// A warp's register slots have one size, so each warp streams experts of one width: the grid's
// warps are split between the chunk's 2-bit and 4-bit experts in proportion to their bytes
// (a 4-bit step reads the base and the residual), spread evenly over the SMs.
#pragma once

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/nq_moe_gemv.cuh"

namespace nq::kernels::cuda {

// Same contract and results as LaunchNqGemv (nq_moe_gemv.cuh) for g.p.codec == kNestedScalar and
// g.cols % kNqStepCodes == 0 (INVALID_ARGUMENT otherwise).
absl::Status LaunchNqGemvBatched(const NqGemvParams& g, const LaunchContext& ctx);

}  // namespace nq::kernels::cuda
