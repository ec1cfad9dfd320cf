#include <algorithm>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "kernels/cuda/rope.cuh"

namespace nq::kernels::cuda {
namespace {

// Resident blocks per SM the grid-stride loop aims for (2048 threads / kRopeThreads).
constexpr std::int64_t kBlocksPerSm = 8;

}  // namespace

absl::Status LaunchRope(const RopeParams& p, bool interleaved, const LaunchContext& ctx) {
  if (p.tokens < 0 || p.heads < 0 || p.dim < 0 || p.rotary < 0 || p.rotary % 2 != 0 || p.rotary > p.dim ||
      p.start_pos < 0) {
    return absl::InvalidArgumentError(absl::StrCat("Rope: unsupported size tokens=", p.tokens,
                                                   " heads=", p.heads, " dim=", p.dim,
                                                   " start_pos=", p.start_pos));
  }
  const std::int64_t pairs = p.tokens * p.heads * (p.rotary / 2);
  if (pairs == 0) return absl::OkStatus();
  const std::int64_t blocks =
      std::clamp<std::int64_t>(CeilDiv(pairs, kRopeThreads), 1, ctx.num_sms * kBlocksPerSm);
  const dim3 grid(static_cast<unsigned>(blocks));
  if (interleaved) {
    RETURN_IF_ERROR(LaunchProgrammaticDependent(RopeKernel<true>, grid, dim3(kRopeThreads), 0, ctx, p));
  } else {
    RETURN_IF_ERROR(LaunchProgrammaticDependent(RopeKernel<false>, grid, dim3(kRopeThreads), 0, ctx, p));
  }
  return CheckLaunch("RopeKernel");
}

}  // namespace nq::kernels::cuda
