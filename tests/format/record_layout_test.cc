#include "services/format/record_layout.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

#include "tests/common/status_matchers.h"

namespace nq::format {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;

TEST(RecordLayoutTest, BuildAlignsSegmentsAndRoundsRecord) {
  std::vector<SegmentSpec> specs = {{"a", 1000}, {"b", 1}, {"c", 256}};
  auto layout = RecordLayout::Build(specs);
  ASSERT_THAT(layout.status(), IsOk());
  EXPECT_EQ(layout->segments[0].offset, 0u);
  EXPECT_EQ(layout->segments[1].offset, 1024u);
  EXPECT_EQ(layout->segments[2].offset, 1280u);
  EXPECT_EQ(layout->rec_bytes, 4096u);

  std::vector<SegmentSpec> big = {{"a", 4096}, {"b", 1}};
  EXPECT_EQ(RecordLayout::Build(big)->rec_bytes, 8192u);
}

TEST(RecordLayoutTest, BuildRejectsBadSpecs) {
  std::vector<SegmentSpec> none;
  EXPECT_THAT(RecordLayout::Build(none),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("needs a segment")));
  std::vector<SegmentSpec> empty = {{"a", 0}};
  EXPECT_THAT(RecordLayout::Build(empty),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'a' is empty")));
  std::vector<SegmentSpec> repeated = {{"a", 1}, {"a", 2}};
  EXPECT_THAT(RecordLayout::Build(repeated),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("repeated")));
}

TEST(RecordLayoutTest, PackUnpackRoundTrip) {
  std::vector<SegmentSpec> specs = {{"a", 300}, {"b", 17}};
  RecordLayout layout = RecordLayout::Build(specs).value();
  std::vector<std::byte> a(300, std::byte{7}), b(17, std::byte{9});
  std::vector<std::span<const std::byte>> data = {a, b};
  auto record = layout.Pack(data);
  ASSERT_THAT(record.status(), IsOk());
  ASSERT_EQ(record->size(), 4096u);
  EXPECT_EQ((*record)[300], std::byte{0});  // padding is zero
  auto got_b = layout.Unpack(*record, "b");
  ASSERT_THAT(got_b.status(), IsOk());
  EXPECT_TRUE(std::equal(got_b->begin(), got_b->end(), b.begin(), b.end()));
  EXPECT_EQ(got_b->data(), record->data() + 512);
  EXPECT_THAT(layout.Unpack(*record, "zz"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("'zz'")));
  std::vector<std::byte> short_record(100);
  EXPECT_THAT(layout.Unpack(short_record, "a"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("100 bytes")));
  std::vector<std::span<const std::byte>> wrong = {b, b};
  EXPECT_THAT(layout.Pack(wrong),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'a' has 17 bytes")));
}

TEST(RecordLayoutTest, ValidateNamesTheBrokenRule) {
  RecordLayout layout{4096, {{"a", 0, 100}, {"b", 256, 100}}};
  EXPECT_THAT(layout.Validate(), IsOk());
  RecordLayout odd = layout;
  odd.rec_bytes = 5000;
  EXPECT_THAT(odd.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("multiple of 4096")));
  RecordLayout misaligned = layout;
  misaligned.segments[1].offset = 200;
  EXPECT_THAT(misaligned.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("multiple of 256")));
  RecordLayout beyond = layout;
  beyond.segments[1] = {"b", 3840, 300};
  EXPECT_THAT(beyond.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exceeds rec_bytes")));
  RecordLayout overlap = layout;
  overlap.segments[0].bytes = 300;
  EXPECT_THAT(overlap.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overlaps")));
}

TEST(RecordLayoutTest, JsonRoundTripAndErrors) {
  RecordLayout layout{8192, {{"a", 0, 100}, {"b", 4096, 100}}};
  auto back = RecordLayout::FromJson(layout.ToJson(), "x");
  ASSERT_THAT(back.status(), IsOk());
  EXPECT_EQ(*back, layout);
  nlohmann::json j = layout.ToJson();
  j.erase("rec_bytes");
  EXPECT_THAT(RecordLayout::FromJson(j, "x"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("x.rec_bytes is missing")));
  j = layout.ToJson();
  j["segments"][1]["offset"] = "4096";
  EXPECT_THAT(RecordLayout::FromJson(j, "x"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("x.segments[1].offset must be a non-negative integer")));
}

}  // namespace
}  // namespace nq::format
