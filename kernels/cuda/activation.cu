#include "kernels/cuda/activation.cuh"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

namespace nq::kernels::cuda {
namespace {

// Resident blocks per SM the grid-stride loop aims for (2048 threads / kSiluAndMulThreads).
constexpr std::int64_t kBlocksPerSm = 8;

}  // namespace

absl::Status LaunchSiluAndMul(const SiluAndMulParams& p, const LaunchContext& ctx) {
  if (p.rows < 0 || p.cols < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("SiluAndMul: negative size rows=", p.rows, " cols=", p.cols));
  }
  if (p.rows == 0 || p.cols == 0) return absl::OkStatus();
  const bool vec4 = p.cols % 4 == 0 && IsAligned(p.x, 16) && IsAligned(p.y, 16);
  const std::int64_t items = p.rows * p.cols / (vec4 ? 4 : 1);
  const std::int64_t blocks =
      std::clamp<std::int64_t>(CeilDiv(items, kSiluAndMulThreads), 1, ctx.num_sms * kBlocksPerSm);
  const dim3 grid(static_cast<unsigned>(blocks));
  if (vec4) {
    RETURN_IF_ERROR(LaunchProgrammaticDependent(SiluAndMulKernel<true>, grid, dim3(kSiluAndMulThreads), 0, ctx, p));
  } else {
    RETURN_IF_ERROR(LaunchProgrammaticDependent(SiluAndMulKernel<false>, grid, dim3(kSiluAndMulThreads), 0, ctx, p));
  }
  return CheckLaunch("SiluAndMulKernel");
}

}  // namespace nq::kernels::cuda
