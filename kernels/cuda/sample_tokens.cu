#include "kernels/cuda/sample_tokens.cuh"

#include <cooperative_groups.h>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <climits>
#include <cmath>

#include "services/common/status_macros.h"

#include "kernels/cuda/launch_dependent.cuh"

namespace nq::kernels::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 512;
// A row is read by a cluster of blocks (one per SM), each over its own contiguous chunk of the
// row; they combine their histograms and sums through distributed shared memory. One block per
// row was bound by one SM's arithmetic (an exp per id per pass): 330-500 us a 129280-id row.
constexpr int kClusterBlocks = 8;  // the portable cluster size
// The radix descent's digits, most significant first (32 bits of key in three passes).
__device__ __forceinline__ int DigitBits(int pass) { return pass < 2 ? 11 : 10; }
constexpr int kMaxBins = 1 << 11;
// Each block of the cluster sums one slice of the places (digits in descending order) over the
// cluster's histograms; the slice the point falls in is then read by every block.
constexpr int kMaxSlice = kMaxBins / kClusterBlocks;
static_assert(kMaxSlice <= kThreads);

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

// Each block's shared memory (dynamic: it is larger than the static limit), followed by the
// weights of the block's chunk when they fit (Cached below).
struct Shared {
  // Per digit: weight (or count) of this block's ids in play, and their lowest id. Two
  // histograms, alternate passes: other blocks read a pass's histogram after its last barrier,
  // so a block clears the one the pass before last used.
  unsigned long long weight[2][kMaxBins];
  int min_id[2][kMaxBins];
  unsigned long long slice[kMaxSlice];  // the cluster's weight of each place of this block's slice
  unsigned long long slice_total;
  union {
    BestReduce::TempStorage best;
    SumReduce::TempStorage sum;
    Scan::TempStorage scan;
  } cub;
  // One value per block, read by every block (ShareAcrossCluster), and what each block gathered.
  Best best_slot;
  unsigned long long sum_slot;
  Best gathered_best[kClusterBlocks];
  unsigned long long gathered[kClusterBlocks];
  // The pass's verdict, written by the thread it falls on.
  unsigned long long before;
  unsigned long long final_weight;
  std::uint32_t digit;
  int final_min_id;
  std::int32_t id;
};

struct RowContext {
  const float* row;
  std::int32_t vocab;
  std::int32_t begin, end;  // this block's chunk of the row
  float max_logit;
  float inv_temperature;
  unsigned long long* weights;  // the chunk's weights (null until computed, or when they do not fit)
};

// Calls f(id, logit) for every id of the block's chunk that this thread reads (16-byte loads
// where the row allows, four in flight per thread).
template <typename F>
__device__ __forceinline__ void ForEachLogit(const RowContext& r, F&& f) {
  if ((r.vocab & 3) == 0 && (reinterpret_cast<std::uintptr_t>(r.row) & 15) == 0) {
    // Chunks start and end on multiples of 4 (ChunkOf).
    const float4* row4 = reinterpret_cast<const float4*>(r.row);
    const std::int32_t end4 = r.end >> 2;
#pragma unroll 4
    for (std::int32_t q = (r.begin >> 2) + threadIdx.x; q < end4; q += kThreads) {
      const float4 v = row4[q];
      f(4 * q, v.x);
      f(4 * q + 1, v.y);
      f(4 * q + 2, v.z);
      f(4 * q + 3, v.w);
    }
  } else {
    for (std::int32_t i = r.begin + threadIdx.x; i < r.end; i += kThreads) f(i, r.row[i]);
  }
}

__device__ __forceinline__ unsigned long long ComputeWeight(const RowContext& r, std::uint32_t key, float logit) {
  return key == 0 ? 0ull : static_cast<unsigned long long>(SampleWeight(logit, r.max_logit, r.inv_temperature));
}

__device__ __forceinline__ unsigned long long WeightOf(const RowContext& r, std::int32_t i, std::uint32_t key,
                                                       float logit) {
  return r.weights != nullptr ? r.weights[i - r.begin] : ComputeWeight(r, key, logit);
}

// Every block's `value` (thread 0's, through `slot` in each block's shared memory) into
// `gathered`, indexed by rank. Ends on a cluster barrier, after which no block reads another's
// slot: the slot may be written again.
template <typename T>
__device__ void ShareAcrossCluster(T& slot, T (&gathered)[kClusterBlocks], const T& value) {
  cg::cluster_group cluster = cg::this_cluster();
  if (threadIdx.x == 0) slot = value;
  cluster.sync();
  if (threadIdx.x < kClusterBlocks) gathered[threadIdx.x] = *cluster.map_shared_rank(&slot, threadIdx.x);
  cluster.sync();
}

enum class Point { kGiven, kGivenIfReached, kFraction };

// The first id in play, in descending order, whose running weight (count when !by_weight)
// exceeds the point: `point` itself, or for kFraction SampleDrawPoint(fraction, total in play).
// False (the cut unchanged) for kGivenIfReached when the ids in play weigh no more than it.
// Every block of the cluster calls it and takes the same branches (every verdict comes from
// cluster-wide sums). `pass_count` counts the histogram passes of the whole kernel (which
// histogram a pass uses).
__device__ bool Select(const RowContext& r, Shared& s, bool by_weight, const Cut& cut, Point kind,
                       unsigned long long point, double fraction, int& pass_count, Cut* selected) {
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  std::uint32_t prefix = 0;
  int prefix_bits = 0;
  unsigned long long u = point;
  for (int pass = 0; pass < 3; ++pass, ++pass_count) {
    const int buffer = pass_count & 1;
    unsigned long long* weight = s.weight[buffer];
    int* min_id = s.min_id[buffer];
    const int bits = DigitBits(pass);
    const int bins = 1 << bits;
    const int shift = 32 - prefix_bits - bits;
    for (int b = threadIdx.x; b < bins; b += kThreads) {
      weight[b] = 0;
      min_id[b] = INT_MAX;
    }
    __syncthreads();
    ForEachLogit(r, [&](std::int32_t i, float logit) {
      const std::uint32_t key = SampleKey(logit);
      if (!InCut(key, i, cut)) return;
      if (prefix_bits > 0 && (key >> (32 - prefix_bits)) != prefix) return;
      const unsigned long long w = by_weight ? WeightOf(r, i, key, logit) : 1ull;
      if (w == 0) return;  // never the first to exceed a point
      const std::uint32_t d = (key >> shift) & static_cast<std::uint32_t>(bins - 1);
      atomicAdd(&weight[d], w);
      atomicMin(&min_id[d], i);
    });
    cluster.sync();  // every block's histogram is complete
    // This block's slice of the places (place p is digit bins - 1 - p), summed over the cluster.
    const int slice = bins / kClusterBlocks;
    unsigned long long mine = 0;
    if (static_cast<int>(threadIdx.x) < slice) {
      const int digit = bins - 1 - (rank * slice + static_cast<int>(threadIdx.x));
      for (int b = 0; b < kClusterBlocks; ++b) mine += cluster.map_shared_rank(weight, b)[digit];
      s.slice[threadIdx.x] = mine;
    }
    const unsigned long long slice_total = SumReduce(s.cub.sum).Sum(mine);
    if (threadIdx.x == 0) s.slice_total = slice_total;
    cluster.sync();  // every slice is summed
    if (threadIdx.x < kClusterBlocks) s.gathered[threadIdx.x] = *cluster.map_shared_rank(&s.slice_total, threadIdx.x);
    __syncthreads();
    unsigned long long total = 0;
    for (int b = 0; b < kClusterBlocks; ++b) total += s.gathered[b];
    if (pass == 0) {
      if (kind == Point::kFraction) u = SampleDrawPoint(fraction, total);
      if (kind == Point::kGivenIfReached && total <= u) return false;  // the same verdict in every block
    }
    // The slice the point falls in, then its place.
    int k = 0;
    unsigned long long slice_before = 0;
    while (k + 1 < kClusterBlocks && slice_before + s.gathered[k] <= u) slice_before += s.gathered[k++];
    const unsigned long long v = static_cast<int>(threadIdx.x) < slice
                                     ? cluster.map_shared_rank(s.slice, k)[threadIdx.x]
                                     : 0ull;
    unsigned long long before = 0;
    Scan(s.cub.scan).ExclusiveSum(v, before);
    before += slice_before;
    if (v > 0 && before <= u && u < before + v) {
      s.digit = static_cast<std::uint32_t>(bins - 1 - (k * slice + static_cast<int>(threadIdx.x)));
      s.before = before;
      s.final_weight = v;
    }
    __syncthreads();
    const std::uint32_t digit = s.digit;
    if (threadIdx.x == 0) {
      int lowest = INT_MAX;
      for (int b = 0; b < kClusterBlocks; ++b) lowest = min(lowest, cluster.map_shared_rank(min_id, b)[digit]);
      s.final_min_id = lowest;
    }
    u -= s.before;
    prefix = (prefix << bits) | digit;
    prefix_bits += bits;
    __syncthreads();
  }
  // The ids of key `prefix` in play all weigh the same: the point falls on the j-th of them in
  // id order.
  const unsigned long long w = by_weight ? ComputeWeight(r, prefix, KeyLogit(prefix)) : 1ull;
  const unsigned long long ties = s.final_weight / w;
  const unsigned long long j = u / w;
  selected->key = prefix;
  if (ties == 1) {
    selected->id = s.final_min_id;
    return true;
  }
  // A scan in id order: over contiguous ranges, one per thread, then over the blocks' chunks.
  const std::int32_t length = r.end - r.begin;
  const std::int32_t chunk = (length + kThreads - 1) / kThreads;
  const std::int32_t first = min(r.end, r.begin + static_cast<std::int32_t>(threadIdx.x) * chunk);
  const std::int32_t end = min(r.end, first + chunk);
  unsigned long long count = 0;
  for (std::int32_t i = first; i < end; ++i) count += SampleKey(r.row[i]) == prefix && InCut(prefix, i, cut);
  unsigned long long before = 0, block_total = 0;
  Scan(s.cub.scan).ExclusiveSum(count, before, block_total);
  ShareAcrossCluster(s.sum_slot, s.gathered, block_total);
  for (int b = 0; b < rank; ++b) before += s.gathered[b];
  if (count > 0 && before <= j && j < before + count) {
    unsigned long long seen = before;
    for (std::int32_t i = first; i < end; ++i) {
      if (SampleKey(r.row[i]) == prefix && InCut(prefix, i, cut)) {
        if (seen == j) {
          for (int b = 0; b < kClusterBlocks; ++b) *cluster.map_shared_rank(&s.id, b) = i;
          break;
        }
        ++seen;
      }
    }
  }
  cluster.sync();  // the id is in every block
  selected->id = s.id;
  return true;
}

// The block's chunk of a row: equal multiples of 4 ids (so 16-byte loads never straddle two).
__device__ __forceinline__ void ChunkOf(std::int32_t vocab, int rank, std::int32_t& begin, std::int32_t& end) {
  const std::int32_t per = (((vocab + kClusterBlocks - 1) / kClusterBlocks) + 3) & ~3;
  begin = min(vocab, rank * per);
  end = min(vocab, begin + per);
}

template <bool kCached>
__global__ void __launch_bounds__(kThreads) SampleTokensKernel(SampleTokensLaunch launch) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  Shared& s = *reinterpret_cast<Shared*>(shared_bytes);
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  WaitForPrerequisiteGrid();  // the logits come from the launch before
  const std::int64_t row_index = blockIdx.x / kClusterBlocks;
  RowContext r{.row = launch.logits + row_index * launch.vocab,
               .vocab = static_cast<std::int32_t>(launch.vocab),
               .begin = 0,
               .end = 0,
               .max_logit = 0,
               .inv_temperature = 1,
               .weights = nullptr};
  ChunkOf(r.vocab, rank, r.begin, r.end);
  const SampleParams p = launch.params[row_index];

  Best best{-INFINITY, -1};
  ForEachLogit(r, [&](std::int32_t i, float logit) {
    if (isfinite(logit) && (best.id < 0 || logit > best.value || (logit == best.value && i < best.id))) {
      best = {logit, i};
    }
  });
  best = BestReduce(s.cub.best).Reduce(best, BetterOf());
  ShareAcrossCluster(s.best_slot, s.gathered_best, best);
  best = Best{-INFINITY, -1};
  for (int b = 0; b < kClusterBlocks; ++b) best = BetterOf()(best, s.gathered_best[b]);
  std::int32_t id = best.id;
  // Greedy, or no finite logit (kNoFiniteLogit is -1, the id of no best). A temperature that is
  // not a positive finite number (the CPU backend refuses it) is greedy too.
  if (best.id >= 0 && p.temperature > 0 && isfinite(p.temperature)) {
    r.max_logit = best.value;
    r.inv_temperature = 1.0f / p.temperature;
    int pass_count = 0;
    Cut cut;
    Cut selected;
    if (p.top_k > 0 && p.top_k < r.vocab) {
      Select(r, s, /*by_weight=*/false, cut, Point::kGiven, static_cast<unsigned long long>(p.top_k - 1), 0,
             pass_count, &selected);
      cut = selected;
    }
    // Each id's weight once (an exp): every pass below reads it instead of computing it again.
    unsigned long long sum = 0;
    unsigned long long* weights = reinterpret_cast<unsigned long long*>(shared_bytes + sizeof(Shared));
    ForEachLogit(r, [&](std::int32_t i, float logit) {
      const unsigned long long w = ComputeWeight(r, SampleKey(logit), logit);
      if constexpr (kCached) weights[i - r.begin] = w;
      sum += w;
    });
    if constexpr (kCached) r.weights = weights;
    if (p.top_p < 1) {
      sum = SumReduce(s.cub.sum).Sum(sum);
      ShareAcrossCluster(s.sum_slot, s.gathered, sum);  // also the barrier after which the cached weights are read
      unsigned long long total = 0;
      for (int b = 0; b < kClusterBlocks; ++b) total += s.gathered[b];
      const unsigned long long point = SampleTopPPoint(p.top_p, total);
      if (Select(r, s, /*by_weight=*/true, cut, Point::kGivenIfReached, point, 0, pass_count, &selected)) {
        cut = selected;
      }
    } else {
      __syncthreads();  // the cached weights are read by other threads of the block
    }
    Select(r, s, /*by_weight=*/true, cut, Point::kFraction, 0, p.u01, pass_count, &selected);
    id = selected.id;
  }
  cluster.sync();  // no block leaves while another may still read its shared memory
  if (rank == 0 && threadIdx.x == 0) launch.ids[row_index] = id;
  LetDependentsLaunch();
}

// Largest row whose chunk's weights fit beside Shared in one block's shared memory.
std::size_t CachedSharedBytes(std::int64_t vocab) {
  const std::int64_t per = (((vocab + kClusterBlocks - 1) / kClusterBlocks) + 3) & ~std::int64_t{3};
  return sizeof(Shared) + static_cast<std::size_t>(per) * sizeof(unsigned long long);
}

template <bool kCached>
absl::Status Launch(const SampleTokensLaunch& launch, std::size_t smem, const LaunchContext& ctx) {
  NQ_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(SampleTokensKernel<kCached>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  cudaLaunchAttribute attributes[2];
  attributes[0].id = cudaLaunchAttributeClusterDimension;
  attributes[0].val.clusterDim.x = kClusterBlocks;
  attributes[0].val.clusterDim.y = 1;
  attributes[0].val.clusterDim.z = 1;
  // A programmatic dependent of the head: its launch overlaps the head's end (it waits for it).
  attributes[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[1].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(launch.rows * kClusterBlocks));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = ctx.stream;
  config.attrs = attributes;
  config.numAttrs = 2;
  NQ_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&config, SampleTokensKernel<kCached>, launch));
  return CheckLaunch("SampleTokensKernel");
}

}  // namespace

absl::Status LaunchSampleTokens(const SampleTokensLaunch& launch, const LaunchContext& ctx) {
  int device = 0, limit = 0;
  NQ_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  NQ_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const std::size_t cached = CachedSharedBytes(launch.vocab);
  if (cached <= static_cast<std::size_t>(limit)) return Launch<true>(launch, cached, ctx);
  return Launch<false>(launch, sizeof(Shared), ctx);
}

}  // namespace nq::kernels::cuda
