// CudaBackend::CopyToHostAsync: copies of up to kMappedHostCopyMaxBytes into the backend's own
// page-locked staging are a kernel storing into it (kernels/cuda/mapped_host_copy.cuh), the rest
// take the copy engine. Either way the destination must hold exactly the source's bytes and
// nothing around it may change, at every size and alignment, in a stream and in a replayed graph.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cuda/mapped_host_copy.cuh"
#include "services/common/status_macros.h"
#include "tests/kernels/cuda/backend_pair.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::cuda::kMappedHostCopyMaxBytes;
using ::nq::kernels::testing::Backends;
using ::nq::kernels::testing::UploadBytes;

constexpr std::uint8_t kUntouched = 0xab;
constexpr std::size_t kGuard = 64;  // bytes before and after each destination that must not change

std::vector<std::uint8_t> RandomBytes(std::mt19937_64& rng, std::size_t n) {
  std::vector<std::uint8_t> bytes(n);
  for (auto& b : bytes) b = static_cast<std::uint8_t>(rng() & 0xff);
  return bytes;
}

// Whether staging holds `expected` at `offset` and kUntouched everywhere else.
::testing::AssertionResult LandedExactly(const std::byte* staging, std::size_t staging_bytes, std::size_t offset,
                                         const std::vector<std::uint8_t>& expected) {
  const auto* s = reinterpret_cast<const std::uint8_t*>(staging);
  for (std::size_t i = 0; i < staging_bytes; ++i) {
    const bool inside = i >= offset && i < offset + expected.size();
    const std::uint8_t want = inside ? expected[i - offset] : kUntouched;
    if (s[i] != want) {
      return ::testing::AssertionFailure() << "byte " << i << " (offset " << offset << ", " << expected.size()
                                           << " bytes): " << int{s[i]} << ", expected " << int{want};
    }
  }
  return ::testing::AssertionSuccess();
}

// Sizes across the kernel's paths (head, whole 16-byte pieces, tail) and past its limit (the copy
// engine), at destination offsets that share the source's 16-byte alignment and that do not.
TEST(CudaCopyToHostAsync, EverySizeAndAlignmentLandsExactlyAndTouchesNothingElse) {
  if (Backends().cuda == nullptr) return;
  Backend& cuda = *Backends().cuda;
  std::mt19937_64 rng(4411);
  const std::size_t sizes[] = {1, 3, 15, 16, 17, 31, 64, 4099, 24576, kMappedHostCopyMaxBytes - 1,
                               kMappedHostCopyMaxBytes, kMappedHostCopyMaxBytes + 1, 3 * kMappedHostCopyMaxBytes};
  const std::size_t offsets[] = {0, 1, 4, 8, 16};
  for (std::size_t bytes : sizes) {
    const std::vector<std::uint8_t> values = RandomBytes(rng, bytes);
    Tensor src = UploadBytes(cuda, values, DType::kU8, {static_cast<std::int64_t>(bytes)});
    const std::size_t staging_bytes = kGuard + 16 + bytes + kGuard;
    absl::StatusOr<std::unique_ptr<Storage>> staging = cuda.AllocateHostStaging(staging_bytes);
    NQ_ASSERT_OK(staging.status());
    auto* base = static_cast<std::byte*>((*staging)->data());
    for (std::size_t offset : offsets) {
      std::memset(base, kUntouched, staging_bytes);
      NQ_ASSERT_OK(cuda.CopyToHostAsync(src, std::span<std::byte>(base + kGuard + offset, bytes)));
      NQ_ASSERT_OK(cuda.Synchronize());
      EXPECT_TRUE(LandedExactly(base, staging_bytes, kGuard + offset, values));
    }
  }
}

// A captured copy replayed lands each replay's value (the graph holds the copy, not its bytes).
TEST(CudaCopyToHostAsync, AReplayedGraphLandsEachReplaysValue) {
  if (Backends().cuda == nullptr) return;
  Backend& cuda = *Backends().cuda;
  std::mt19937_64 rng(4412);
  constexpr std::size_t kBytes = 24 * 1024 + 4;  // a step's final hidden state and its sampled id
  Tensor src = UploadBytes(cuda, RandomBytes(rng, kBytes), DType::kU8, {static_cast<std::int64_t>(kBytes)});
  absl::StatusOr<std::unique_ptr<Storage>> staging = cuda.AllocateHostStaging(kBytes + 2 * kGuard);
  NQ_ASSERT_OK(staging.status());
  auto* base = static_cast<std::byte*>((*staging)->data());
  NQ_ASSERT_OK(cuda.Synchronize());
  NQ_ASSERT_OK(cuda.BeginCapture());
  const absl::Status copied = cuda.CopyToHostAsync(src, std::span<std::byte>(base + kGuard, kBytes));
  absl::StatusOr<std::unique_ptr<Backend::Graph>> graph = cuda.EndCapture();
  NQ_ASSERT_OK(copied);
  NQ_ASSERT_OK(graph.status());
  for (int replay = 0; replay < 3; ++replay) {
    const std::vector<std::uint8_t> values = RandomBytes(rng, kBytes);
    NQ_ASSERT_OK(cuda.Copy(UploadBytes(cuda, values, DType::kU8, {static_cast<std::int64_t>(kBytes)}), src));
    NQ_ASSERT_OK(cuda.Synchronize());
    std::memset(base, kUntouched, kBytes + 2 * kGuard);
    NQ_ASSERT_OK((*graph)->Run());
    EXPECT_TRUE(LandedExactly(base, kBytes + 2 * kGuard, kGuard, values)) << "replay " << replay;
  }
}

// Memory the backend did not stage (pageable, or another allocator's) is never written by a
// kernel: the copy engine takes it, and it lands all the same.
TEST(CudaCopyToHostAsync, PageableMemoryTakesTheCopyEngine) {
  if (Backends().cuda == nullptr) return;
  Backend& cuda = *Backends().cuda;
  std::mt19937_64 rng(4413);
  for (std::size_t bytes : {std::size_t{1}, std::size_t{4096}, kMappedHostCopyMaxBytes}) {
    const std::vector<std::uint8_t> values = RandomBytes(rng, bytes);
    Tensor src = UploadBytes(cuda, values, DType::kU8, {static_cast<std::int64_t>(bytes)});
    std::vector<std::byte> host(bytes + 2 * kGuard, std::byte{kUntouched});
    NQ_ASSERT_OK(cuda.CopyToHostAsync(src, std::span<std::byte>(host.data() + kGuard, bytes)));
    NQ_ASSERT_OK(cuda.Synchronize());
    EXPECT_TRUE(LandedExactly(host.data(), host.size(), kGuard, values));
  }
}

}  // namespace
}  // namespace nq::kernels
