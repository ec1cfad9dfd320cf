// The CUDA backend's stream-ordered pool (kernels/cuda/stream_pool.h): a free that fails (a block
// allocated before a capture freed inside it, the fault that once turned the worker's step graphs
// off) is counted and leaves no error behind for the next, unrelated launch check.
#include <cuda_runtime_api.h>

#include <memory>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "kernels/cuda/stream_pool.h"
#include "tests/kernels/cuda/backend_pair.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::Backends;

TEST(CudaStreamPool, AFailedFreeIsCountedAndLeavesNoErrorForTheNextCheck) {
  if (Backends().cuda == nullptr) return;
  absl::StatusOr<std::shared_ptr<cuda::StreamPool>> created = cuda::StreamPool::Create(0);
  ASSERT_TRUE(created.ok()) << created.status();
  cuda::StreamPool& pool = **created;
  absl::StatusOr<void*> block = pool.Allocate(1 << 20);
  ASSERT_TRUE(block.ok()) << block.status();

  ASSERT_EQ(cudaStreamBeginCapture(pool.stream(), cudaStreamCaptureModeThreadLocal), cudaSuccess);
  pool.Free(*block);  // allocated outside the capture: cudaFreeAsync refuses it
  EXPECT_EQ(pool.failed_frees(), 1);
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);
  cudaGraph_t graph = nullptr;
  cudaStreamEndCapture(pool.stream(), &graph);  // the refused free may have invalidated it
  if (graph != nullptr) cudaGraphDestroy(graph);
  cudaGetLastError();

  // The block was not freed: outside the capture it is, and the pool serves on.
  pool.Free(*block);
  EXPECT_EQ(pool.failed_frees(), 1);
  absl::StatusOr<void*> again = pool.Allocate(1 << 20);
  ASSERT_TRUE(again.ok()) << again.status();
  pool.Free(*again);
  EXPECT_EQ(cudaStreamSynchronize(pool.stream()), cudaSuccess);
  EXPECT_EQ(pool.failed_frees(), 1);
}

}  // namespace
}  // namespace nq::kernels
