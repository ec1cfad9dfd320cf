#include "kernels/cuda/mapped_host_copy.cuh"

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/launch_dependent.cuh"
#include "services/common/status_macros.h"

namespace nq::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// Whole 16-byte pieces when both ends share their alignment to 16 (the usual case: tensors from
// the pool, offsets into a staging buffer that are multiples of 16), bytes otherwise; the head
// before the first aligned piece and the tail after the last go byte by byte.
__global__ void __launch_bounds__(kThreads) MappedHostCopyKernel(const unsigned char* src, unsigned char* dst,
                                                                 std::size_t bytes) {
  StartAsProgrammaticDependent();
  const std::size_t thread = static_cast<std::size_t>(blockIdx.x) * kThreads + threadIdx.x;
  const std::size_t threads = static_cast<std::size_t>(gridDim.x) * kThreads;
  const std::uintptr_t s = reinterpret_cast<std::uintptr_t>(src), d = reinterpret_cast<std::uintptr_t>(dst);
  std::size_t head = bytes, pieces = 0;
  if (s % 16 == d % 16) {
    head = (16 - s % 16) % 16;
    if (head > bytes) head = bytes;
    pieces = (bytes - head) / 16;
  }
  const std::size_t tail_begin = head + pieces * 16;
  const uint4* src16 = reinterpret_cast<const uint4*>(src + head);
  uint4* dst16 = reinterpret_cast<uint4*>(dst + head);
  for (std::size_t i = thread; i < pieces; i += threads) dst16[i] = src16[i];
  for (std::size_t i = thread; i < head; i += threads) dst[i] = src[i];
  for (std::size_t i = tail_begin + thread; i < bytes; i += threads) dst[i] = src[i];
}

}  // namespace

absl::Status LaunchMappedHostCopy(const void* src, void* dst, std::size_t bytes, const LaunchContext& ctx) {
  if (bytes > kMappedHostCopyMaxBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("MappedHostCopy: ", bytes, " bytes exceed the kernel's ", kMappedHostCopyMaxBytes));
  }
  if (bytes == 0) return absl::OkStatus();
  // One 16-byte piece a thread: up to 32 blocks at the largest copy, one for the usual few KiB.
  const std::size_t blocks = (bytes / 16 + kThreads - 1) / kThreads;
  const dim3 grid(static_cast<unsigned>(blocks < 1 ? 1 : blocks));
  RETURN_IF_ERROR(LaunchProgrammaticDependent(MappedHostCopyKernel, grid, dim3(kThreads), 0, ctx,
                                              static_cast<const unsigned char*>(src),
                                              static_cast<unsigned char*>(dst), bytes));
  return CheckLaunch("MappedHostCopyKernel");
}

}  // namespace nq::kernels::cuda
