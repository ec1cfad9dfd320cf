#include "kernels/cuda/softmax.cuh"

#include "absl/strings/str_cat.h"

namespace nq::kernels::cuda {

absl::Status LaunchSoftmax(const SoftmaxParams& p, const LaunchContext& ctx) {
  if (p.rows < 0 || p.rows > kMaxGridX || p.cols < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Softmax: unsupported size rows=", p.rows, " cols=", p.cols));
  }
  if (p.rows == 0 || p.cols == 0) return absl::OkStatus();
  const bool vec4 = p.cols % 4 == 0 && IsAligned(p.x, 16) && IsAligned(p.y, 16);
  const dim3 grid(static_cast<unsigned>(p.rows));
  if (vec4) {
    SoftmaxKernel<true><<<grid, kSoftmaxThreads, 0, ctx.stream>>>(p);
  } else {
    SoftmaxKernel<false><<<grid, kSoftmaxThreads, 0, ctx.stream>>>(p);
  }
  return CheckLaunch("SoftmaxKernel");
}

}  // namespace nq::kernels::cuda
