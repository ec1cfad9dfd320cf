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
using ::nq::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

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

TEST(ContextCapacityTest, MaxModelLenIsATokenCountOrAuto) {
  absl::StatusOr<std::optional<int64_t>> tokens = ParseMaxModelLen("8192");
  ASSERT_THAT(tokens, IsOk());
  EXPECT_EQ(*tokens, std::optional<int64_t>(8192));
  absl::StatusOr<std::optional<int64_t>> automatic = ParseMaxModelLen("auto");
  ASSERT_THAT(automatic, IsOk());
  EXPECT_FALSE(automatic->has_value());
  for (const char* bad : {"0", "-4", "4k", "", "Auto"}) {
    EXPECT_THAT(ParseMaxModelLen(bad), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("positive number"))) << bad;
  }
}

// auto: what is free beyond the rest of the model, less the headroom, in whole granules, up to
// the model's limit; too little is refused with the figures.
TEST(ContextCapacityTest, AutoContextTakesWhatTheFreeMemoryHolds) {
  constexpr uint64_t kGiB = uint64_t{1} << 30;
  // 10 GiB free, 4 GiB for the rest: 6 GiB * 0.9 at 64 KiB a token = 88473.6 tokens, so 88320.
  absl::StatusOr<int64_t> tokens = AutoMaxModelLen(10 * kGiB, 4 * kGiB, 64 << 10, 202752, "GPU 0");
  ASSERT_THAT(tokens, IsOk());
  EXPECT_EQ(*tokens, 88320);
  EXPECT_EQ(*tokens % kAutoContextGranule, 0);
  // Plenty free: the model's limit, even when it is not a whole granule.
  tokens = AutoMaxModelLen(1000 * kGiB, 4 * kGiB, 64 << 10, 163841, "GPU 0");
  ASSERT_THAT(tokens, IsOk());
  EXPECT_EQ(*tokens, 163841);
  // The rest of the model takes nearly everything: refused, naming the device and the bytes.
  EXPECT_THAT(AutoMaxModelLen(10 * kGiB, 10 * kGiB - (32 << 20), 64 << 10, 202752, "GPU 3"),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("GPU 3 has 10.00 GiB free"), HasSubstr("room for 256 tokens"),
                             HasSubstr("--kv_cache_dtype fp8"))));
  EXPECT_THAT(AutoMaxModelLen(kGiB, 2 * kGiB, 64 << 10, 202752, "the host"),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("room for 0 tokens")));
  EXPECT_THAT(AutoMaxModelLen(kGiB, 0, 0, 4096, "the host"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bytes per token")));
}

}  // namespace
}  // namespace nq::worker
