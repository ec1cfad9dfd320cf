#include "kernels/cuda/l2_prefetch.cuh"

namespace nq::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr std::int64_t kAlign = 16;                      // cp.async.bulk: 16-byte addresses and sizes
constexpr std::int64_t kMaxBytesPerPrefetch = 1 << 16;  // one instruction's range (a range loops)

__device__ __forceinline__ void BulkPrefetchL2(const std::byte* p, std::uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

__device__ __forceinline__ void BulkPrefetchL2EvictLast(const std::byte* p, std::uint32_t bytes, std::uint64_t policy) {
  asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(p), "r"(bytes), "l"(policy)
               : "memory");
}

// One thread per (row, range): the range's first prefix_bytes, trimmed to 16-byte bounds.
__global__ void __launch_bounds__(kThreads) L2PrefetchKernel(const __grid_constant__ L2PrefetchParams p) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= p.rows * p.ranges) return;
  const std::int64_t row = i / p.ranges, range = i % p.ranges;
  const std::int64_t range_bytes = p.row_bytes / p.ranges;
  const std::int64_t first = row * p.row_bytes + range * range_bytes;
  const std::int64_t last = range + 1 == p.ranges ? (row + 1) * p.row_bytes : first + range_bytes;
  const std::uintptr_t base = reinterpret_cast<std::uintptr_t>(p.base);
  // Absolute addresses aligned: the start rounded up, the end rounded down.
  const std::uintptr_t begin = (base + first + kAlign - 1) / kAlign * kAlign;
  const std::int64_t stop = last < first + p.prefix_bytes ? last : first + p.prefix_bytes;
  const std::uintptr_t end = (base + stop) / kAlign * kAlign;
  std::uint64_t policy = 0;
  if (p.evict_last) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  for (std::uintptr_t a = begin; a < end; a += kMaxBytesPerPrefetch) {
    const auto bytes = static_cast<std::uint32_t>(end - a < kMaxBytesPerPrefetch ? end - a : kMaxBytesPerPrefetch);
    const auto* at = reinterpret_cast<const std::byte*>(a);
    if (p.evict_last) {
      BulkPrefetchL2EvictLast(at, bytes, policy);
    } else {
      BulkPrefetchL2(at, bytes);
    }
  }
}

}  // namespace

absl::Status LaunchL2Prefetch(const L2PrefetchParams& p, const LaunchContext& ctx) {
  if (p.base == nullptr || p.rows <= 0 || p.row_bytes <= 0 || p.ranges < 1 || p.prefix_bytes < kAlign) {
    return absl::OkStatus();  // nothing worth a launch
  }
  const std::int64_t segments = p.rows * p.ranges;
  const auto blocks = static_cast<unsigned>((segments + kThreads - 1) / kThreads);
  L2PrefetchKernel<<<blocks, kThreads, 0, ctx.stream>>>(p);
  return CheckLaunch("L2PrefetchKernel");
}

}  // namespace nq::kernels::cuda
