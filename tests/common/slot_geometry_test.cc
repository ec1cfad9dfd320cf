#include "services/common/slot_geometry.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/common/status_matchers.h"

namespace nq {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;

SlotGeometry Valid() { return SlotGeometry::Packed({1, 2, 5}, 4, 8192, 16, 2); }

TEST(SlotGeometryTest, OffsetsAndSize) {
  SlotGeometry geometry = Valid();
  ASSERT_THAT(geometry.Validate(), IsOk());
  EXPECT_EQ(geometry.ArenaBytes(), 3u * 4 * 8192);
  EXPECT_EQ(geometry.SlotOffset(0, 0), 0u);
  EXPECT_EQ(geometry.SlotOffset(2, 3), (2u * 4 + 3) * 8192);
  EXPECT_EQ(*geometry.LayerIndex(5), 2u);
  EXPECT_THAT(geometry.LayerIndex(3), StatusIs(absl::StatusCode::kNotFound, HasSubstr("layer 3")));
}

TEST(SlotGeometryTest, ProtoRoundTrip) {
  SlotGeometry geometry = Valid();
  geometry.slot_stride_bytes = 3 * 4096;
  absl::StatusOr<SlotGeometry> back = SlotGeometry::FromProto(geometry.ToProto());
  ASSERT_THAT(back, IsOk());
  EXPECT_EQ(back->moe_layer_ids, geometry.moe_layer_ids);
  EXPECT_EQ(back->slot_stride_bytes, 3u * 4096);
  EXPECT_EQ(back->ArenaBytes(), geometry.ArenaBytes());
}

TEST(SlotGeometryTest, RejectsEachBrokenRule) {
  struct Case {
    void (*mutate)(SlotGeometry&);
    const char* message;
  };
  const Case cases[] = {
      {[](SlotGeometry& g) { g.moe_layer_ids.clear(); }, "no MoE layers"},
      {[](SlotGeometry& g) { g.moe_layer_ids = {3, 2}; }, "strictly increasing"},
      {[](SlotGeometry& g) { g.moe_layer_ids = {2, 2}; }, "strictly increasing"},
      {[](SlotGeometry& g) { g.slots_per_layer = 0; }, "slots_per_layer is 0"},
      {[](SlotGeometry& g) { g.experts_per_layer = 0; }, "experts_per_layer is 0"},
      {[](SlotGeometry& g) { g.slots_per_layer = 17; }, "exceeds experts_per_layer"},
      {[](SlotGeometry& g) { g.fixed_slots_per_layer = 5; }, "exceeds slots_per_layer"},
      {[](SlotGeometry& g) { g.rec_bytes = 4097; g.slot_stride_bytes = 8192; }, "multiple of 4096"},
      {[](SlotGeometry& g) { g.slot_stride_bytes = 4096; }, "slot_stride_bytes"},
      {[](SlotGeometry& g) { g.slot_stride_bytes = 8192 + 100; }, "slot_stride_bytes"},
  };
  for (const Case& c : cases) {
    SlotGeometry geometry = Valid();
    c.mutate(geometry);
    EXPECT_THAT(geometry.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.message)));
    EXPECT_FALSE(SlotGeometry::FromProto(geometry.ToProto()).ok());
  }
}

}  // namespace
}  // namespace nq
