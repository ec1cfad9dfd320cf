#include <algorithm>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "kernels/cuda/elementwise.cuh"

namespace nq::kernels::cuda {
namespace {

// Resident blocks per SM the grid-stride loop aims for (2048 threads / kElementwiseThreads).
constexpr std::int64_t kBlocksPerSm = 8;

}  // namespace

absl::Status LaunchAdd(const AddParams& p, const LaunchContext& ctx) {
  if (p.count < 0) {
    return absl::InvalidArgumentError(absl::StrCat("Add: negative size count=", p.count));
  }
  if (p.count == 0) return absl::OkStatus();
  const bool vec4 = IsAligned(p.a, 16) && IsAligned(p.b, 16) && IsAligned(p.out, 16);
  const std::int64_t items = vec4 ? CeilDiv(p.count, 4) : p.count;
  const std::int64_t blocks =
      std::clamp<std::int64_t>(CeilDiv(items, kElementwiseThreads), 1, ctx.num_sms * kBlocksPerSm);
  const dim3 grid(static_cast<unsigned>(blocks));
  if (vec4) {
    RETURN_IF_ERROR(LaunchProgrammaticDependent(AddKernel<true>, grid, dim3(kElementwiseThreads), 0, ctx, p));
  } else {
    RETURN_IF_ERROR(LaunchProgrammaticDependent(AddKernel<false>, grid, dim3(kElementwiseThreads), 0, ctx, p));
  }
  return CheckLaunch("AddKernel");
}

}  // namespace nq::kernels::cuda
