#include "kernels/cuda/moe_route.cuh"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

#include "kernels/cuda/launch_dependent.cuh"
#include "kernels/cuda/reduce.cuh"

namespace nq::kernels::cuda {
namespace {

// Groups per token at most: a thread per group ranks them (DeepSeek-V3 and GLM-5 use 8 or 1).
constexpr int kMaxGroups = 64;

// A choice score as an unsigned key in the same order (larger value, larger key): -0 counts
// as +0 (they compare equal, and ties go to the lower id), and NaN below every number (a NaN
// score has no rank anywhere; here it is at least a deterministic one).
__device__ __forceinline__ std::uint32_t ChoiceKey(float v) {
  if (v != v) return 0u;
  const std::uint32_t bits = __float_as_uint(v + 0.0f);
  return (bits & 0x80000000u) != 0 ? ~bits : bits | 0x80000000u;
}

__device__ __forceinline__ bool Beats(float other, int other_index, float mine, int my_index) {
  return other > mine || (other == mine && other_index < my_index);
}

// The sum of a group's two best choice scores (the host's TopK of 2, then a sum; a + b is
// exact either way round).
__device__ float GroupScore(const float* choice, int first, int size) {
  int best_at = 0;
  for (int i = 1; i < size; ++i) {
    if (choice[first + i] > choice[first + best_at]) best_at = i;
  }
  if (size == 1) return choice[first];
  float second = 0;
  bool have_second = false;
  for (int i = 0; i < size; ++i) {
    if (i == best_at) continue;
    const float v = choice[first + i];
    if (!have_second || v > second) {
      second = v;
      have_second = true;
    }
  }
  return choice[first + best_at] + second;
}

// kPerLane: experts a lane of the choosing warp holds (E <= 32 kPerLane), their keys in registers.
// A block takes up to kMaxRoutedExperts threads, so its registers are bounded for that many.
template <int kPerLane>
__global__ void __launch_bounds__(kMaxRoutedExperts) MoeRouteKernel(const __grid_constant__ MoeRouteLaunch p) {
  extern __shared__ float shared[];
  const int E = p.params.num_experts, K = p.params.top_k, G = p.params.n_group;
  float* scores = shared;         // [E]
  float* choice = shared + E;     // [E]
  __shared__ float group_score[kMaxGroups];
  __shared__ bool keep[kMaxGroups];
  __shared__ int chosen[kMaxRoutedExperts];
  const std::int64_t t = blockIdx.x;
  WaitForPrerequisiteGrid();  // the router logits come from the launch before
  // The kernel after (the experts' preparation) may launch now: it waits for this grid's end
  // before it reads the choices, and its launch hides behind this block's work.
  LetDependentsLaunch();

  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const float logit = p.logits[t * E + e];
    const float score = 1.0f / (1.0f + expf(-logit));
    scores[e] = score;
    choice[e] = score + (p.bias != nullptr ? p.bias[e] : 0.0f);
  }
  __syncthreads();
  if (G > 1) {
    const int size = E / G;
    for (int g = threadIdx.x; g < G; g += blockDim.x) group_score[g] = GroupScore(choice, g * size, size);
    __syncthreads();
    for (int g = threadIdx.x; g < G; g += blockDim.x) {
      int rank = 0;
      for (int o = 0; o < G; ++o) rank += Beats(group_score[o], o, group_score[g], g);
      keep[g] = rank < p.params.topk_group;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      if (!keep[e / size]) choice[e] = -INFINITY;
    }
    __syncthreads();
  }
  // The top K by K rounds of a warp's argmax (value, then the lower id), which is the order of
  // the host's ranking. A thread ranking its expert against all others took a warp through all
  // E comparisons whenever one of its experts was among the best: 14 us a token at E = 256.
  // Each round a lane scans its own experts (lane + 32 q, ids ascending) for its best untaken
  // key, and two warp reductions pick the round's winner: the largest key, then the lowest id
  // holding it (one redux instruction each, where a shuffle tree took five dependent rounds).
  // The lane's keys are read from shared memory once, into registers, and each round scans them
  // there (a round re-reading them took E / 32 dependent shared loads).
  if (threadIdx.x < kWarpSize) {
    const int lane = static_cast<int>(threadIdx.x);
    std::uint32_t key[kPerLane];
    std::uint32_t open = 0;  // bit q: expert lane + 32 q exists and is not chosen yet
#pragma unroll
    for (int q = 0; q < kPerLane; ++q) {
      const int e = lane + kWarpSize * q;
      key[q] = e < E ? ChoiceKey(choice[e]) : 0u;
      if (e < E) open |= 1u << q;
    }
    for (int j = 0; j < K; ++j) {
      std::uint32_t best = 0;
      int best_e = -1;
#pragma unroll
      for (int q = 0; q < kPerLane; ++q) {
        if (((open >> q) & 1u) != 0 && (best_e < 0 || key[q] > best)) {
          best = key[q];
          best_e = lane + kWarpSize * q;
        }
      }
      const std::uint32_t top = __reduce_max_sync(kFullWarpMask, best_e >= 0 ? best : 0u);
      const int winner = static_cast<int>(__reduce_min_sync(
          kFullWarpMask, best_e >= 0 && best == top ? static_cast<std::uint32_t>(best_e) : 0xffffffffu));
      if (winner % kWarpSize == lane) open &= ~(1u << (winner / kWarpSize));
      if (lane == 0) chosen[j] = winner;
    }
    __syncwarp();
    // The normalising sum in the host's order (one chain, j ascending), then each lane j < K
    // writes choice j.
    float sum = 0;
    if (lane == 0) {
      for (int j = 0; j < K; ++j) sum += scores[chosen[j]];
    }
    sum = __shfl_sync(kFullWarpMask, sum, 0);
    for (int j = lane; j < K; j += kWarpSize) {
      float w = scores[chosen[j]];
      if (p.params.norm_topk_prob) w /= (sum + 1e-20f);
      p.ids[t * K + j] = chosen[j];
      p.weights[t * K + j] = w * p.params.routed_scaling_factor;
    }
  }
}

}  // namespace

absl::Status LaunchMoeRoute(const MoeRouteLaunch& launch, const LaunchContext& ctx) {
  if (launch.params.n_group > kMaxGroups) {
    return absl::InvalidArgumentError(
        absl::StrCat("MoeRoute: ", launch.params.n_group, " expert groups; the CUDA router handles ", kMaxGroups));
  }
  const int E = launch.params.num_experts;
  const int threads = std::min(kMaxRoutedExperts, (E + 31) / 32 * 32);
  const std::size_t shared = 2 * static_cast<std::size_t>(E) * sizeof(float);
  static_assert(kMaxRoutedExperts <= 32 * kWarpSize, "a lane's open experts are one 32-bit mask");
  const int per_lane = (E + kWarpSize - 1) / kWarpSize;
  auto* kernel = per_lane <= 1 ? &MoeRouteKernel<1>
                 : per_lane <= 2 ? &MoeRouteKernel<2>
                 : per_lane <= 4 ? &MoeRouteKernel<4>
                 : per_lane <= 8 ? &MoeRouteKernel<8>
                 : per_lane <= 16 ? &MoeRouteKernel<16>
                                  : &MoeRouteKernel<32>;
  RETURN_IF_ERROR(LaunchProgrammaticDependent(kernel, dim3(static_cast<unsigned>(launch.tokens)),
                                              dim3(static_cast<unsigned>(threads)), shared, ctx, launch));
  return CheckLaunch("MoeRouteKernel");
}

}  // namespace nq::kernels::cuda
