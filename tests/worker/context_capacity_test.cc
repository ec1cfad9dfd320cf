// What a worker states at start about its context (issue #23): the KV cache it allocated, what
// the free memory would hold, capped at the model's limit.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "kernels/backend.h"
#include "services/worker/context_capacity.h"
#include "tests/common/status_matchers.h"

namespace nq::worker {
namespace {

using ::nq::testing::IsOk;

TEST(ContextCapacityTest, FreeMemoryStretchesTheCacheUpToTheModelsLimit) {
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend("cpu");
  ASSERT_THAT(backend, IsOk());
  absl::StatusOr<std::unique_ptr<model::Model>> m =
      model::Model::Load(std::string(NQ_SOURCE_DIR) + "/models/glm5_nano", **backend, nullptr, {.max_tokens = 512});
  ASSERT_THAT(m, IsOk());
  const ContextCapacity none = MeasureContextCapacity(**m, 0);
  EXPECT_EQ(none.allocated_tokens, 512);
  EXPECT_EQ(none.fit_tokens, 512);
  EXPECT_EQ(none.model_limit_tokens, 4096);  // glm5_nano's max_position_embeddings
  ASSERT_GT(none.bytes_per_token, 0);
  EXPECT_EQ(none.bytes_per_token * 512, (*m)->kv_cache_bytes());
  // 100 tokens' worth free: 90 of them fit beside the headroom.
  const ContextCapacity some = MeasureContextCapacity(**m, static_cast<uint64_t>(100 * none.bytes_per_token));
  EXPECT_NEAR(static_cast<double>(some.fit_tokens), 512 + 90, 1);
  const ContextCapacity plenty = MeasureContextCapacity(**m, uint64_t{1} << 40);
  EXPECT_EQ(plenty.fit_tokens, 4096);
  absl::StatusOr<uint64_t> host = HostAvailableBytes();
  ASSERT_THAT(host, IsOk());
  EXPECT_GT(*host, 0u);
}

}  // namespace
}  // namespace nq::worker
