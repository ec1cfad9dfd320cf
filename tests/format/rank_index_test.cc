#include "services/format/rank_index.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "services/format/manifest.h"
#include "tests/common/status_matchers.h"
#include "tests/format/test_release.h"

namespace nq::format {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;
using Json = nlohmann::json;

RankIndex TestIndex() {
  RankIndex index;
  index.format = kFormatName;
  index.version = kFormatVersion;
  index.rank = 1;
  index.experts_per_layer = testing::kExperts;
  const RecordLayout layout = testing::TestLayout();
  for (uint32_t layer : {3u, 4u}) {
    LayerEntry e;
    e.layer = layer;
    e.layout = layout;
    e.records = {RecordFile(1, layer), 0, testing::kExperts * layout.rec_bytes,
                 std::string(64, 'c')};
    e.resident = {ResidentFile(1, layer), 0, 1234, std::string(64, 'd')};
    index.layers.push_back(e);
  }
  return index;
}

absl::Status ParseJson(const Json& j) { return ParseRankIndex(j.dump(), "rank1.json").status(); }

TEST(RankIndexTest, RoundTrip) {
  const std::string text = SerializeRankIndex(TestIndex());
  auto parsed = ParseRankIndex(text, "rank1.json");
  ASSERT_THAT(parsed.status(), IsOk());
  EXPECT_EQ(*parsed, TestIndex());
  EXPECT_EQ(SerializeRankIndex(*parsed), text);
  EXPECT_EQ(RecordFile(1, 4), "rank1/L4.bin");
  EXPECT_EQ(ResidentFile(1, 4), "res/rank1/L4.safetensors");
}

TEST(RankIndexTest, MissingKeysAndWrongTypes) {
  Json j = Json::parse(SerializeRankIndex(TestIndex()));
  j["layers"][0]["records"].erase("sha256");
  EXPECT_THAT(ParseJson(j), StatusIs(absl::StatusCode::kInvalidArgument,
                                     HasSubstr("rank1.json: layers[0].records.sha256 is missing")));
  j = Json::parse(SerializeRankIndex(TestIndex()));
  j["layers"][1]["resident"]["bytes"] = -1;
  EXPECT_THAT(ParseJson(j),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("layers[1].resident.bytes must be a non-negative integer")));
  j = Json::parse(SerializeRankIndex(TestIndex()));
  j["layers"] = Json::object();
  EXPECT_THAT(ParseJson(j),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layers must be an array")));
  j = Json::parse(SerializeRankIndex(TestIndex()));
  j["version"] = 7;
  EXPECT_THAT(ParseJson(j), StatusIs(absl::StatusCode::kInvalidArgument,
                                     HasSubstr("version 7 is not supported")));
}

TEST(RankIndexTest, OffsetsAndSizes) {
  RankIndex index = TestIndex();
  index.layers[0].records.offset = 512;
  EXPECT_THAT(index.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("layer 3: records offset 512 is not a multiple of 4096")));
  index = TestIndex();
  index.layers[1].records.bytes += 4096;
  EXPECT_THAT(index.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("records bytes")));
  index = TestIndex();
  index.layers[0].layout.rec_bytes = 12000;
  EXPECT_THAT(index.Validate(), StatusIs(absl::StatusCode::kInvalidArgument,
                                         HasSubstr("not a positive multiple of 4096")));
  index = TestIndex();
  index.layers[0].layout.segments[1].offset = 5100;
  EXPECT_THAT(index.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a multiple of 256")));
  index = TestIndex();
  index.layers[0].layout.segments[1].offset = index.layers[0].layout.rec_bytes;
  EXPECT_THAT(index.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exceeds rec_bytes")));
  index = TestIndex();
  index.layers[0].records.file = "../elsewhere.bin";
  EXPECT_THAT(index.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a relative path")));
  index = TestIndex();
  index.layers[0].records.sha256 = "abc";
  EXPECT_THAT(index.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("64 lower-case hex")));
}

TEST(RankIndexTest, OverlappingRecordsInOneFile) {
  RankIndex index = TestIndex();
  index.layers[1].records.file = index.layers[0].records.file;
  index.layers[1].records.offset = index.layers[0].records.bytes - 4096;
  EXPECT_THAT(index.Validate(), StatusIs(absl::StatusCode::kInvalidArgument,
                                         HasSubstr("layer 4: records overlap those of layer 3")));
  index.layers[1].records.offset = index.layers[0].records.bytes;  // back to back is fine
  EXPECT_THAT(index.Validate(), IsOk());
}

TEST(RankIndexTest, UpsertAndRemoveKeepOrder) {
  RankIndex index = TestIndex();
  LayerEntry e = index.layers[0];
  EXPECT_TRUE(index.Remove(3));
  EXPECT_FALSE(index.Remove(3));
  index.Upsert(e);
  EXPECT_EQ(index, TestIndex());
}

TEST(CompleteTest, RoundTripSortedAndMalformed) {
  std::string text =
      SerializeComplete({{"b", std::string(64, '1')}, {"a/x", std::string(64, '2')}});
  EXPECT_EQ(text, std::string(64, '2') + "  a/x\n" + std::string(64, '1') + "  b\n");
  auto parsed = ParseComplete(text);
  ASSERT_THAT(parsed.status(), IsOk());
  EXPECT_EQ(parsed->size(), 2u);
  EXPECT_THAT(ParseComplete("deadbeef  x\n"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("COMPLETE line 1")));
}

}  // namespace
}  // namespace nq::format
