#include <algorithm>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "kernels/cuda/rows.cuh"

namespace nq::kernels::cuda {
namespace {

// Resident blocks per SM the grid-stride conversion aims for (2048 threads / kRowsThreads).
constexpr std::int64_t kBlocksPerSm = 8;

}  // namespace

absl::Status LaunchFloatsToBf16(const FloatsToBf16Params& p, const LaunchContext& ctx) {
  if (p.count < 0) {
    return absl::InvalidArgumentError(absl::StrCat("FloatsToBf16: negative size count=", p.count));
  }
  if (p.count == 0) return absl::OkStatus();
  const std::int64_t blocks =
      std::clamp<std::int64_t>(CeilDiv(p.count, kRowsThreads), 1, ctx.num_sms * kBlocksPerSm);
  RETURN_IF_ERROR(LaunchProgrammaticDependent(FloatsToBf16Kernel<kRowsThreads>, dim3(static_cast<unsigned>(blocks)),
                                              dim3(kRowsThreads), 0, ctx, p));
  return CheckLaunch("FloatsToBf16Kernel");
}

absl::Status LaunchWriteRowsAt(const WriteRowsAtParams& p, const LaunchContext& ctx) {
  if (p.rows < 0 || p.rows > kMaxGridX || p.cols < 0 || p.row_offset == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("WriteRows: unsupported size rows=", p.rows, " cols=", p.cols, " (device offset required)"));
  }
  if (p.rows == 0 || p.cols == 0) return absl::OkStatus();
  RETURN_IF_ERROR(LaunchProgrammaticDependent(WriteRowsAtKernel<kRowsThreads>, dim3(static_cast<unsigned>(p.rows)),
                                              dim3(kRowsThreads), 0, ctx, p));
  return CheckLaunch("WriteRowsAtKernel");
}

absl::Status LaunchGatherRows(const GatherRowsParams& p, const LaunchContext& ctx) {
  if (p.n < 0 || p.n > kMaxGridX || p.cols < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("GatherRows: unsupported size n=", p.n, " cols=", p.cols));
  }
  if (p.n == 0 || p.cols == 0) return absl::OkStatus();
  const dim3 grid(static_cast<unsigned>(p.n));
  GatherRowsKernel<kRowsThreads><<<grid, kRowsThreads, 0, ctx.stream>>>(p);
  return CheckLaunch("GatherRowsKernel");
}

absl::Status LaunchScatterAddRows(const ScatterAddRowsParams& p, const LaunchContext& ctx) {
  if (p.num_targets < 0 || p.num_targets > kMaxGridX || p.cols < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ScatterAddRows: unsupported size targets=", p.num_targets, " cols=", p.cols));
  }
  if (p.num_targets == 0 || p.cols == 0) return absl::OkStatus();
  const dim3 grid(static_cast<unsigned>(p.num_targets));
  ScatterAddRowsKernel<kRowsThreads><<<grid, kRowsThreads, 0, ctx.stream>>>(p);
  return CheckLaunch("ScatterAddRowsKernel");
}

}  // namespace nq::kernels::cuda
