#include "kernels/cuda/rmsnorm.cuh"

#include "absl/strings/str_cat.h"

namespace nq::kernels::cuda {

absl::Status LaunchRmsNorm(const RmsNormParams& p, const LaunchContext& ctx) {
  if (p.rows < 0 || p.rows > kMaxGridX || p.cols < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("RmsNorm: unsupported size rows=", p.rows, " cols=", p.cols));
  }
  if (p.rows == 0 || p.cols == 0) return absl::OkStatus();
  if (p.delta1 != nullptr && p.delta0 == nullptr) return absl::InvalidArgumentError("RmsNorm: delta1 without delta0");
  const bool vec4 = p.cols % 4 == 0 && IsAligned(p.x, 16) && IsAligned(p.y, 16) &&
                    IsAligned(p.weight, 4 * DTypeSize(p.weight_dtype)) && IsAligned(p.delta0, 16) &&
                    IsAligned(p.delta1, 16) && IsAligned(p.x_out, 16);
  const dim3 grid(static_cast<unsigned>(p.rows));
  return VisitFloatDType(p.weight_dtype, [&](auto tag) {
    using WeightT = decltype(tag);
    // A programmatic dependent: its weight loads overlap the end of the kernel that writes x.
    return LaunchProgrammaticDependent(vec4 ? &RmsNormKernel<WeightT, true> : &RmsNormKernel<WeightT, false>, grid,
                                       dim3(kRmsNormThreads), 0, ctx, p);
  });
}

}  // namespace nq::kernels::cuda
