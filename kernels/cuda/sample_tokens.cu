#include "kernels/cuda/sample_tokens.cuh"

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <climits>
#include <cmath>

#include "services/common/status_macros.h"

#include "kernels/cuda/launch_dependent.cuh"

namespace nq::kernels::cuda {
namespace {

constexpr int kThreads = 1024;
// The radix descent's digits, most significant first (32 bits of key in three passes).
__device__ __forceinline__ int DigitBits(int pass) { return pass < 2 ? 11 : 10; }
constexpr int kMaxBins = 1 << 11;
constexpr int kBinsPerThread = kMaxBins / kThreads;

// The ids in play: those before (and including) one place of the descending order, i.e.
// key > cut.key, or key == cut.key and id <= cut.id. The whole row at first.
struct Cut {
  std::uint32_t key = 0;
  std::int32_t id = INT_MAX;
};

__device__ __forceinline__ bool InCut(std::uint32_t key, std::int32_t id, const Cut& cut) {
  return key > cut.key || (key == cut.key && id <= cut.id);
}

// The logit of a non-zero key (SampleKey's inverse).
__device__ __forceinline__ float KeyLogit(std::uint32_t key) {
  return __uint_as_float((key & 0x80000000u) != 0 ? key & 0x7fffffffu : ~key);
}

struct Best {
  float value;
  std::int32_t id;  // -1: none
};

struct BetterOf {
  __device__ Best operator()(const Best& a, const Best& b) const {
    if (a.id < 0) return b;
    if (b.id < 0) return a;
    return (a.value > b.value || (a.value == b.value && a.id < b.id)) ? a : b;
  }
};

using BestReduce = cub::BlockReduce<Best, kThreads>;
using SumReduce = cub::BlockReduce<unsigned long long, kThreads>;
using Scan = cub::BlockScan<unsigned long long, kThreads>;

struct Shared {
  unsigned long long weight[kMaxBins];  // per digit: weight (or count) of the ids in play
  int min_id[kMaxBins];                 // per digit: the lowest id (the id itself when alone)
  union {
    BestReduce::TempStorage best;
    SumReduce::TempStorage sum;
    Scan::TempStorage scan;
  } cub;
  Best best;
  unsigned long long total;
  unsigned long long before;
  std::uint32_t digit;
  std::int32_t id;
};

// Calls f(id, logit) for every id of the row this thread reads (16-byte loads where the row
// allows, four in flight per thread).
template <typename F>
__device__ __forceinline__ void ForEachLogit(const float* row, std::int32_t vocab, F&& f) {
  if ((vocab & 3) == 0 && (reinterpret_cast<std::uintptr_t>(row) & 15) == 0) {
    const float4* row4 = reinterpret_cast<const float4*>(row);
    const std::int32_t n4 = vocab >> 2;
#pragma unroll 4
    for (std::int32_t q = threadIdx.x; q < n4; q += kThreads) {
      const float4 v = row4[q];
      f(4 * q, v.x);
      f(4 * q + 1, v.y);
      f(4 * q + 2, v.z);
      f(4 * q + 3, v.w);
    }
  } else {
    for (std::int32_t i = threadIdx.x; i < vocab; i += kThreads) f(i, row[i]);
  }
}

struct RowContext {
  const float* row;
  std::int32_t vocab;
  float max_logit;
  float inv_temperature;
};

__device__ __forceinline__ unsigned long long WeightOf(const RowContext& r, std::uint32_t key, float logit) {
  return key == 0 ? 0ull : static_cast<unsigned long long>(SampleWeight(logit, r.max_logit, r.inv_temperature));
}

enum class Point { kGiven, kGivenIfReached, kFraction };

// The first id in play, in descending order, whose running weight (count when !by_weight)
// exceeds the point: `point` itself, or for kFraction SampleDrawPoint(fraction, total in play).
// False (the cut unchanged) for kGivenIfReached when the ids in play weigh no more than it.
__device__ bool Select(const RowContext& r, Shared& s, bool by_weight, const Cut& cut, Point kind,
                       unsigned long long point, double fraction, Cut* selected) {
  std::uint32_t prefix = 0;
  int prefix_bits = 0;
  unsigned long long u = point;
  unsigned long long final_weight = 0;
  int final_min_id = 0;
  for (int pass = 0; pass < 3; ++pass) {
    const int bits = DigitBits(pass);
    const int bins = 1 << bits;
    const int shift = 32 - prefix_bits - bits;
    for (int b = threadIdx.x; b < bins; b += kThreads) {
      s.weight[b] = 0;
      s.min_id[b] = INT_MAX;
    }
    __syncthreads();
    ForEachLogit(r.row, r.vocab, [&](std::int32_t i, float logit) {
      const std::uint32_t key = SampleKey(logit);
      if (!InCut(key, i, cut)) return;
      if (prefix_bits > 0 && (key >> (32 - prefix_bits)) != prefix) return;
      const unsigned long long w = by_weight ? WeightOf(r, key, logit) : 1ull;
      if (w == 0) return;  // never the first to exceed a point
      const std::uint32_t d = (key >> shift) & static_cast<std::uint32_t>(bins - 1);
      atomicAdd(&s.weight[d], w);
      atomicMin(&s.min_id[d], i);
    });
    __syncthreads();
    // Digits in descending order: thread t holds places t * per .. t * per + per - 1.
    const int per = bins / kThreads;
    unsigned long long mine[kBinsPerThread];
    unsigned long long sum = 0;
    for (int j = 0; j < per; ++j) {
      mine[j] = s.weight[bins - 1 - (threadIdx.x * per + j)];
      sum += mine[j];
    }
    unsigned long long before = 0, total = 0;
    Scan(s.cub.scan).ExclusiveSum(sum, before, total);
    if (pass == 0) {
      if (kind == Point::kFraction) u = SampleDrawPoint(fraction, total);
      if (kind == Point::kGivenIfReached && total <= u) return false;  // the same verdict in every thread
    }
    for (int j = 0; j < per; ++j) {
      if (before <= u && u < before + mine[j]) {
        s.digit = static_cast<std::uint32_t>(bins - 1 - (threadIdx.x * per + j));
        s.before = before;
      }
      before += mine[j];
    }
    __syncthreads();
    const std::uint32_t digit = s.digit;
    u -= s.before;
    prefix = (prefix << bits) | digit;
    prefix_bits += bits;
    final_weight = s.weight[digit];
    final_min_id = s.min_id[digit];
    __syncthreads();  // every thread has read the bins before the next pass clears them
  }
  // The ids of key `prefix` in play all weigh the same: the point falls on the j-th of them in
  // id order.
  const unsigned long long w = by_weight ? WeightOf(r, prefix, KeyLogit(prefix)) : 1ull;
  const unsigned long long ties = final_weight / w;
  const unsigned long long j = u / w;
  selected->key = prefix;
  if (ties == 1) {
    selected->id = final_min_id;
    return true;
  }
  // A scan over contiguous id ranges, one per thread.
  const std::int32_t chunk = (r.vocab + kThreads - 1) / kThreads;
  const std::int32_t first = min(r.vocab, static_cast<std::int32_t>(threadIdx.x) * chunk);
  const std::int32_t end = min(r.vocab, first + chunk);
  unsigned long long count = 0;
  for (std::int32_t i = first; i < end; ++i) count += SampleKey(r.row[i]) == prefix && InCut(prefix, i, cut);
  unsigned long long before = 0, total = 0;
  Scan(s.cub.scan).ExclusiveSum(count, before, total);
  if (before <= j && j < before + count) {
    unsigned long long seen = before;
    for (std::int32_t i = first; i < end; ++i) {
      if (SampleKey(r.row[i]) == prefix && InCut(prefix, i, cut)) {
        if (seen == j) {
          s.id = i;
          break;
        }
        ++seen;
      }
    }
  }
  __syncthreads();
  selected->id = s.id;
  __syncthreads();
  return true;
}

__global__ void __launch_bounds__(kThreads) SampleTokensKernel(SampleTokensLaunch launch) {
  __shared__ Shared s;
  WaitForPrerequisiteGrid();  // the logits come from the launch before
  const std::int64_t row_index = blockIdx.x;
  RowContext r{.row = launch.logits + row_index * launch.vocab,
               .vocab = static_cast<std::int32_t>(launch.vocab),
               .max_logit = 0,
               .inv_temperature = 1};
  const SampleParams p = launch.params[row_index];

  Best best{-INFINITY, -1};
  ForEachLogit(r.row, r.vocab, [&](std::int32_t i, float logit) {
    if (isfinite(logit) && (best.id < 0 || logit > best.value || (logit == best.value && i < best.id))) {
      best = {logit, i};
    }
  });
  best = BestReduce(s.cub.best).Reduce(best, BetterOf());
  if (threadIdx.x == 0) s.best = best;
  __syncthreads();
  best = s.best;
  std::int32_t id = best.id;
  // Greedy, or no finite logit (kNoFiniteLogit is -1, the id of no best). A temperature that is
  // not a positive finite number (the CPU backend refuses it) is greedy too.
  if (best.id >= 0 && p.temperature > 0 && isfinite(p.temperature)) {
    r.max_logit = best.value;
    r.inv_temperature = 1.0f / p.temperature;
    Cut cut;
    Cut selected;
    if (p.top_k > 0 && p.top_k < r.vocab) {
      Select(r, s, /*by_weight=*/false, cut, Point::kGiven, static_cast<unsigned long long>(p.top_k - 1), 0, &selected);
      cut = selected;
    }
    if (p.top_p < 1) {
      unsigned long long sum = 0;
      ForEachLogit(r.row, r.vocab, [&](std::int32_t, float logit) { sum += WeightOf(r, SampleKey(logit), logit); });
      sum = SumReduce(s.cub.sum).Sum(sum);
      if (threadIdx.x == 0) s.total = sum;
      __syncthreads();
      const unsigned long long point = SampleTopPPoint(p.top_p, s.total);
      __syncthreads();
      if (Select(r, s, /*by_weight=*/true, cut, Point::kGivenIfReached, point, 0, &selected)) cut = selected;
    }
    Select(r, s, /*by_weight=*/true, cut, Point::kFraction, 0, p.u01, &selected);
    id = selected.id;
  }
  if (threadIdx.x == 0) launch.ids[row_index] = id;
  LetDependentsLaunch();
}

}  // namespace

absl::Status LaunchSampleTokens(const SampleTokensLaunch& launch, const LaunchContext& ctx) {
  RETURN_IF_ERROR(LaunchProgrammaticDependent(SampleTokensKernel, dim3(static_cast<unsigned>(launch.rows)),
                                              dim3(kThreads), 0, ctx, launch));
  return CheckLaunch("SampleTokensKernel");
}

}  // namespace nq::kernels::cuda
