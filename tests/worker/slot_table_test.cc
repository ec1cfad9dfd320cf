#include "services/worker/slot_table.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/common/status_matchers.h"

namespace nq::worker {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::Optional;

// MoE layers 1 and 2, 3 slots each, 8 experts.
SlotGeometry Geometry() { return SlotGeometry::Packed({1, 2}, 3, 4096, 8, 1); }

nq::v1::SlotTableUpdate Update(uint64_t generation,
                               std::initializer_list<std::tuple<nq::v1::SlotChange::Kind, int, int, int>> changes) {
  nq::v1::SlotTableUpdate update;
  update.set_generation(generation);
  for (const auto& [kind, layer, slot, expert] : changes) {
    nq::v1::SlotChange* change = update.add_changes();
    change->set_kind(kind);
    change->set_layer(layer);
    change->set_slot(slot);
    change->set_expert(expert);
  }
  return update;
}

constexpr auto kReady = nq::v1::SlotChange::KIND_READY;
constexpr auto kUnmap = nq::v1::SlotChange::KIND_UNMAP;

TEST(SlotTableTest, ReadyThenUnmapWithAck) {
  SlotTable table(Geometry());
  EXPECT_EQ(table.SlotOf(1, 5), std::nullopt);
  std::vector<nq::v1::SlotRef> unmapped;
  ASSERT_THAT(table.ApplyAtStepBoundary(Update(1, {{kReady, 1, 0, 5}, {kReady, 2, 2, 7}}), &unmapped), IsOk());
  EXPECT_THAT(table.SlotOf(1, 5), Optional(0u));
  EXPECT_THAT(table.SlotOf(2, 7), Optional(2u));
  EXPECT_EQ(table.SlotOf(2, 5), std::nullopt);
  EXPECT_TRUE(unmapped.empty());

  ASSERT_THAT(table.ApplyAtStepBoundary(Update(2, {{kUnmap, 1, 0, 0}}), &unmapped), IsOk());
  EXPECT_EQ(table.SlotOf(1, 5), std::nullopt);
  ASSERT_EQ(unmapped.size(), 1u);
  EXPECT_EQ(unmapped[0].layer(), 1u);
  EXPECT_EQ(unmapped[0].slot(), 0u);
  EXPECT_EQ(table.applied_generation(), 2u);
  ASSERT_EQ(table.ReadySlots().size(), 1u);
  EXPECT_EQ(table.ReadySlots()[0].expert(), 7u);
  EXPECT_EQ(table.ReadySlots()[0].generation(), 1u);
}

TEST(SlotTableTest, StaleAndDuplicateGenerationsAreIgnored) {
  SlotTable table(Geometry());
  ASSERT_THAT(table.ApplyAtStepBoundary(Update(5, {{kReady, 1, 0, 5}}), nullptr), IsOk());
  // A replay of generation 5 (or anything older) must not touch the table.
  EXPECT_THAT(table.ApplyAtStepBoundary(Update(5, {{kUnmap, 1, 0, 0}}), nullptr), IsOk());
  EXPECT_THAT(table.ApplyAtStepBoundary(Update(3, {{kUnmap, 1, 0, 0}}), nullptr), IsOk());
  EXPECT_THAT(table.SlotOf(1, 5), Optional(0u));
  EXPECT_EQ(table.applied_generation(), 5u);
}

TEST(SlotTableTest, ProtocolViolationsRejectTheWholeUpdate) {
  SlotTable table(Geometry());
  ASSERT_THAT(table.ApplyAtStepBoundary(Update(1, {{kReady, 1, 0, 5}}), nullptr), IsOk());
  struct Case {
    nq::v1::SlotTableUpdate update;
    absl::StatusCode code;
    const char* message;
  };
  const Case cases[] = {
      // The first change is fine; the second breaks a rule: neither may apply.
      {Update(2, {{kReady, 1, 1, 6}, {kReady, 1, 0, 3}}), absl::StatusCode::kFailedPrecondition, "still maps"},
      {Update(2, {{kReady, 1, 1, 6}, {kReady, 1, 2, 5}}), absl::StatusCode::kFailedPrecondition, "already READY"},
      {Update(2, {{kReady, 1, 1, 6}, {kUnmap, 2, 0, 0}}), absl::StatusCode::kFailedPrecondition, "not mapped"},
      {Update(2, {{kReady, 1, 1, 6}, {kReady, 3, 0, 1}}), absl::StatusCode::kNotFound, "layer 3"},
      {Update(2, {{kReady, 1, 1, 6}, {kReady, 1, 3, 1}}), absl::StatusCode::kInvalidArgument, "slot 3"},
      {Update(2, {{kReady, 1, 1, 6}, {kReady, 1, 2, 8}}), absl::StatusCode::kInvalidArgument, "expert 8"},
  };
  for (const Case& c : cases) {
    std::vector<nq::v1::SlotRef> unmapped;
    EXPECT_THAT(table.ApplyAtStepBoundary(c.update, &unmapped), StatusIs(c.code, HasSubstr(c.message)));
    EXPECT_EQ(table.SlotOf(1, 6), std::nullopt) << c.message;
    EXPECT_THAT(table.SlotOf(1, 5), Optional(0u)) << c.message;
    EXPECT_EQ(table.applied_generation(), 1u) << c.message;
    EXPECT_TRUE(unmapped.empty());
  }
}

TEST(SlotTableTest, UnmapAndReuseInOneUpdate) {
  SlotTable table(Geometry());
  ASSERT_THAT(table.ApplyAtStepBoundary(Update(1, {{kReady, 2, 1, 4}}), nullptr), IsOk());
  std::vector<nq::v1::SlotRef> unmapped;
  ASSERT_THAT(table.ApplyAtStepBoundary(Update(2, {{kUnmap, 2, 1, 0}, {kReady, 2, 0, 4}}), &unmapped), IsOk());
  EXPECT_THAT(table.SlotOf(2, 4), Optional(0u));
  EXPECT_EQ(unmapped.size(), 1u);
}

}  // namespace
}  // namespace nq::worker
