// The tensor-parallel group's wire pieces: step commands (what the leader broadcasts before
// each model operation) and identities (what a rank must share with rank 0 to join).
#include <cstring>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "services/worker/step_command.h"
#include "services/worker/tp_identity.h"
#include "tests/common/status_matchers.h"

namespace nq::worker {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::_;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(StepCommandTest, RoundTripsThroughHeaderAndPayload) {
  StepCommand sent{.op = StepCommand::Op::kForward, .position = 77, .sequence = 5, .step = 12};
  sent.tokens = {3, 1, 4, 1, 5};
  const std::vector<std::byte> header = EncodeStepHeader(sent);
  ASSERT_EQ(header.size(), kStepCommandHeaderBytes);
  absl::StatusOr<StepCommand> got = DecodeStepHeader(header, 512);
  ASSERT_THAT(got, IsOk());
  EXPECT_EQ(got->op, StepCommand::Op::kForward);
  EXPECT_EQ(got->position, 77);
  EXPECT_EQ(got->sequence, 5u);
  EXPECT_EQ(got->step, 12u);
  ASSERT_EQ(got->tokens.size(), 5u);
  ASSERT_THAT(DecodeStepPayload(EncodeStepPayload(sent), *got), IsOk());
  EXPECT_THAT(got->tokens, ElementsAre(3, 1, 4, 1, 5));
}

TEST(StepCommandTest, RefusesHeadersThatAreNotCommands) {
  StepCommand sent{.op = StepCommand::Op::kForwardLast};
  sent.tokens.assign(600, 1);
  std::vector<std::byte> header = EncodeStepHeader(sent);
  EXPECT_THAT(DecodeStepHeader(header, 512), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("600 tokens")));
  header[0] = std::byte{0};
  EXPECT_THAT(DecodeStepHeader(header, 512),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a step command")));
  std::vector<std::byte> bad_op = EncodeStepHeader(StepCommand{});
  const uint32_t op = 99;
  std::memcpy(bad_op.data() + 4, &op, sizeof(op));
  EXPECT_THAT(DecodeStepHeader(bad_op, 512), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("op 99")));
  EXPECT_THAT(DecodeStepHeader(std::span<const std::byte>(header).first(10), 512),
              StatusIs(absl::StatusCode::kInvalidArgument, _));
  StepCommand two_tokens;
  two_tokens.tokens.resize(2);
  EXPECT_THAT(DecodeStepPayload(std::vector<std::byte>(12), two_tokens),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("12 bytes for 2 tokens")));
}

TpIdentity Nano() {
  return TpIdentity{.model_id = "embedded",
                    .config_hash = "0123456789abcdef",
                    .release_id = "",
                    .expert_bits = "",
                    .world_size = 2,
                    .backend = "cpu",
                    .weight_dtype = "f32",
                    .kv_cache_dtype = "f32",
                    .max_model_len = 512};
}

TEST(TpIdentityTest, SameIdentityJoinsAndEachDifferenceIsNamed) {
  const std::string leader = Nano().Serialize();
  EXPECT_THAT(Nano().CheckAgainstLeader(leader), IsOk());
  TpIdentity other = Nano();
  other.release_id = "rel-b";
  EXPECT_THAT(other.CheckAgainstLeader(leader),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("release mismatch: rank 0 serves '', this rank 'rel-b'")));
  other = Nano();
  other.world_size = 4;
  EXPECT_THAT(other.CheckAgainstLeader(leader),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("world_size mismatch: rank 0 serves '2'")));
  other = Nano();
  other.config_hash = "fedcba9876543210";
  EXPECT_THAT(other.CheckAgainstLeader(leader), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("config.json")));
  EXPECT_THAT(Nano().CheckAgainstLeader("model=embedded\n"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("another nq-worker build")));
}

TEST(TpIdentityTest, ConfigHashReadsTheFileAndMissingIsNotFound) {
  absl::StatusOr<std::string> hash = ConfigHash(NQ_SOURCE_DIR "/models/glm5_nano");
  ASSERT_THAT(hash, IsOk());
  EXPECT_EQ(hash->size(), 16u);
  EXPECT_THAT(ConfigHash("/nonexistent"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("config.json")));
}

}  // namespace
}  // namespace nq::worker
