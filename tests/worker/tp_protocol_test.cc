// The tensor-parallel group's wire pieces: step commands (what the leader broadcasts before
// each model operation) and identities (what a rank must share with rank 0 to join).
#include <cstring>
#include <utility>

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

// The drafter's MTP forwards travel as commands too, naming the hidden rows each rank takes from
// its own last forward (or the previous draft's state).
TEST(StepCommandTest, MtpForwardNamesItsHiddenRows) {
  for (int64_t row : {int64_t{3}, StepCommand::kLastMtpHidden}) {
    StepCommand sent{.op = StepCommand::Op::kForwardMtpLast, .position = 21, .hidden_row = row};
    sent.tokens = {8, 6};
    absl::StatusOr<StepCommand> got = DecodeStepHeader(EncodeStepHeader(sent), 512);
    ASSERT_THAT(got, IsOk());
    EXPECT_EQ(got->op, StepCommand::Op::kForwardMtpLast);
    EXPECT_EQ(got->position, 21);
    EXPECT_EQ(got->hidden_row, row);
    ASSERT_THAT(DecodeStepPayload(EncodeStepPayload(sent), *got), IsOk());
    EXPECT_THAT(got->tokens, ElementsAre(8, 6));
  }
}

// A greedy drafting chain on the backend travels as one command: its entries' tokens, the hidden
// rows they start from, and how many drafts to chain; a count out of range is refused.
TEST(StepCommandTest, DraftChainCarriesItsDraftCount) {
  StepCommand sent{.op = StepCommand::Op::kDraftOnDevice, .position = 40, .hidden_row = 2, .num_drafts = 3};
  sent.tokens = {5, 9, 11};
  absl::StatusOr<StepCommand> got = DecodeStepHeader(EncodeStepHeader(sent), 512);
  ASSERT_THAT(got, IsOk());
  EXPECT_EQ(got->op, StepCommand::Op::kDraftOnDevice);
  EXPECT_EQ(got->position, 40);
  EXPECT_EQ(got->hidden_row, 2);
  EXPECT_EQ(got->num_drafts, 3);
  ASSERT_THAT(DecodeStepPayload(EncodeStepPayload(sent), *got), IsOk());
  EXPECT_THAT(got->tokens, ElementsAre(5, 9, 11));
  for (const auto& [drafts, row] : {std::pair{0, int64_t{0}}, std::pair{kMaxCommandDrafts + 1, int64_t{0}},
                                    std::pair{2, StepCommand::kLastMtpHidden}}) {
    StepCommand bad = sent;
    bad.num_drafts = drafts;
    bad.hidden_row = row;
    EXPECT_THAT(DecodeStepHeader(EncodeStepHeader(bad), 512),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("drafting")))
        << drafts << " drafts from row " << row;
  }
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

// Issue #18: the leader relays the slot-table updates it applied at a step's start inside that
// step's command, so every rank applies them before the same step.
TEST(StepCommandTest, CarriesTheSlotUpdatesAppliedAtItsStep) {
  StepCommand sent{.op = StepCommand::Op::kForward, .position = 40, .sequence = 2, .step = 17};
  sent.tokens = {9};
  for (uint64_t generation : {5u, 6u}) {
    nq::v1::SlotTableUpdate& update = sent.slot_updates.emplace_back();
    update.set_generation(generation);
    update.set_loads_in_flight(3);
    nq::v1::SlotChange* change = update.add_changes();
    change->set_kind(nq::v1::SlotChange::KIND_READY);
    change->set_layer(1);
    change->set_slot(static_cast<uint32_t>(generation));
    change->set_expert(7);
  }
  absl::StatusOr<StepCommand> got = DecodeStepHeader(EncodeStepHeader(sent), 512);
  ASSERT_THAT(got, IsOk());
  const std::vector<std::byte> payload = EncodeStepPayload(sent);
  EXPECT_EQ(StepPayloadBytes(*got), payload.size());
  ASSERT_THAT(DecodeStepPayload(payload, *got), IsOk());
  EXPECT_THAT(got->tokens, ElementsAre(9));
  ASSERT_EQ(got->slot_updates.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(got->slot_updates[i].SerializeAsString(), sent.slot_updates[i].SerializeAsString()) << i;
  }

  // A payload cut short, or an update's size past its end, is refused by what is wrong.
  EXPECT_THAT(DecodeStepPayload(std::span<const std::byte>(payload).first(payload.size() - 1), *got),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bytes of slot updates")));
  std::vector<std::byte> bad = payload;
  const uint32_t huge = 1000;
  std::memcpy(bad.data() + sizeof(int32_t), &huge, sizeof(huge));
  EXPECT_THAT(DecodeStepPayload(bad, *got),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("a slot update of 1000 bytes")));
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
