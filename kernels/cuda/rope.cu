#include <algorithm>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "kernels/cuda/launch_dependent.cuh"
#include "kernels/cuda/rope.cuh"

namespace nq::kernels::cuda {
namespace {

constexpr int kRopeThreads = 256;

__global__ void __launch_bounds__(kRopeThreads) RopeKernel(const __grid_constant__ RopeParams p) {
  StartAsProgrammaticDependent();
  const int half = p.rotary / 2;
  const std::int64_t start = p.position != nullptr ? std::int64_t{*p.position} : p.start_pos;
  for (int k = 0; k < p.target_count; ++k) {
    const RopeTargetParams& target = p.targets[k];
    const std::int64_t pairs_per_token = std::int64_t{target.heads} * half;
    const std::int64_t total = p.tokens * pairs_per_token;
    for (std::int64_t pair = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; pair < total;
         pair += std::int64_t{gridDim.x} * blockDim.x) {
      const std::int64_t t = pair / pairs_per_token;
      const std::int64_t in_token = pair - t * pairs_per_token;
      const std::int64_t head = in_token / half;
      const int i = static_cast<int>(in_token - head * half);
      const float position = static_cast<float>(start + t);
      const float angle = __fmul_rn(__ldg(p.inv_freq + i), position);
      float sine;
      float cosine;
      sincosf(angle, &sine, &cosine);
      cosine = __fmul_rn(cosine, p.attention_scaling);
      sine = __fmul_rn(sine, p.attention_scaling);
      float* x = target.x + (t * target.heads + head) * target.dim;
      float* re = target.interleaved ? x + 2 * i : x + i;
      float* im = target.interleaved ? x + 2 * i + 1 : x + i + half;
      const float a = *re;
      const float b = *im;
      *re = a * cosine - b * sine;
      *im = b * cosine + a * sine;
    }
  }
}

// Resident blocks per SM the grid-stride loop aims for (2048 threads / kRopeThreads).
constexpr std::int64_t kBlocksPerSm = 8;

}  // namespace

absl::Status LaunchRope(const RopeParams& p, const LaunchContext& ctx) {
  if (p.target_count < 1 || p.target_count > kMaxRopeLaunchTargets || p.tokens < 0 || p.rotary < 0 ||
      p.rotary % 2 != 0 || p.start_pos < 0) {
    return absl::InvalidArgumentError(absl::StrCat("Rope: unsupported launch: ", p.target_count,
                                                   " targets, tokens=", p.tokens, " rotary=", p.rotary,
                                                   " start_pos=", p.start_pos));
  }
  // The grid covers the largest target; the others take fewer of its threads.
  std::int64_t pairs = 0;
  for (int k = 0; k < p.target_count; ++k) {
    const RopeTargetParams& t = p.targets[k];
    if (t.x == nullptr || t.heads < 0 || t.dim < p.rotary) {
      return absl::InvalidArgumentError(absl::StrCat("Rope: unsupported target ", k, ": heads=", t.heads,
                                                     " dim=", t.dim, " rotary=", p.rotary));
    }
    pairs = std::max(pairs, p.tokens * t.heads * (p.rotary / 2));
  }
  if (pairs == 0) return absl::OkStatus();
  const std::int64_t blocks =
      std::clamp<std::int64_t>(CeilDiv(pairs, kRopeThreads), 1, ctx.num_sms * kBlocksPerSm);
  RETURN_IF_ERROR(
      LaunchProgrammaticDependent(RopeKernel, dim3(static_cast<unsigned>(blocks)), dim3(kRopeThreads), 0, ctx, p));
  return CheckLaunch("RopeKernel");
}

}  // namespace nq::kernels::cuda
