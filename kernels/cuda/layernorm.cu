#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "kernels/cuda/layernorm.cuh"

namespace nq::kernels::cuda {

absl::Status LaunchLayerNorm(const LayerNormParams& p, const LaunchContext& ctx) {
  if (p.rows < 0 || p.rows > kMaxGridX || p.cols < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("LayerNorm: unsupported size rows=", p.rows, " cols=", p.cols));
  }
  if (p.rows == 0 || p.cols == 0) return absl::OkStatus();
  const dim3 grid(static_cast<unsigned>(p.rows));
  RETURN_IF_ERROR(
      LaunchProgrammaticDependent(LayerNormKernel<kLayerNormThreads>, grid, dim3(kLayerNormThreads), 0, ctx, p));
  return CheckLaunch("LayerNormKernel");
}

}  // namespace nq::kernels::cuda
