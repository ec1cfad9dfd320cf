#include "services/format/rank_index.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <limits>

#include "services/format/manifest.h"
#include "tests/common/status_matchers.h"
#include "tests/format/test_release.h"

namespace nq::format {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::AllOf;
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
    for (uint32_t x = 0; x < testing::kExperts; ++x) {
      e.record_sha256.push_back(std::string(63, 'e') + "0123456789"[x % 10]);
      e.record_xxh3.push_back(std::string(31, 'f') + "0123456789"[x % 10]);
    }
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
  j = Json::parse(SerializeRankIndex(TestIndex()));
  j["layers"][1].erase("record_sha256");
  EXPECT_THAT(ParseJson(j), StatusIs(absl::StatusCode::kInvalidArgument,
                                     HasSubstr("rank1.json: layers[1].record_sha256 is missing")));
  j = Json::parse(SerializeRankIndex(TestIndex()));
  j["layers"][0]["record_sha256"][2] = 5;
  EXPECT_THAT(ParseJson(j), StatusIs(absl::StatusCode::kInvalidArgument,
                                     HasSubstr("rank1.json: layers[0].record_sha256[2] is not a string")));
}

// A version-1 index (before per-record checksums) is refused, saying what to do about it.
TEST(RankIndexTest, OldIndexWithoutRecordChecksumsIsRefusedWithTheRemedy) {
  Json j = Json::parse(SerializeRankIndex(TestIndex()));
  j["version"] = 1;
  for (Json& layer : j["layers"]) layer.erase("record_sha256");
  EXPECT_THAT(ParseJson(j), StatusIs(absl::StatusCode::kInvalidArgument,
                                     AllOf(HasSubstr("rank1.json: format version 1 is not supported"),
                                           HasSubstr("lack the per-record sha256"), HasSubstr("nq encode"))));
}

// One record checksum per expert, each 64 lower-case hex digits.
TEST(RankIndexTest, RecordChecksumsAreOnePerExpertAndHex) {
  RankIndex index = TestIndex();
  index.layers[1].record_sha256.pop_back();
  EXPECT_THAT(index.Validate(), StatusIs(absl::StatusCode::kInvalidArgument,
                                         HasSubstr("layer 4: 3 record_sha256 entries for 4 experts")));
  index = TestIndex();
  index.layers[0].record_sha256[3] = std::string(64, 'E');
  EXPECT_THAT(index.Validate(), StatusIs(absl::StatusCode::kInvalidArgument,
                                         HasSubstr("layer 3: record_sha256[3] must be 64 lower-case hex digits")));
}

// XXH3 record checksums are optional (releases written before them have none), and when
// present one per expert of 32 lower-case hex digits; an index without them round-trips
// without the field.
TEST(RankIndexTest, Xxh3RecordChecksumsAreOptionalButWholeAndHex) {
  RankIndex index = TestIndex();
  for (LayerEntry& e : index.layers) e.record_xxh3.clear();
  EXPECT_THAT(index.Validate(), IsOk());
  const std::string text = SerializeRankIndex(index);
  EXPECT_THAT(text, ::testing::Not(HasSubstr("record_xxh3")));
  auto parsed = ParseRankIndex(text, "rank1.json");
  ASSERT_THAT(parsed.status(), IsOk());
  EXPECT_EQ(*parsed, index);

  index = TestIndex();
  index.layers[1].record_xxh3.pop_back();
  EXPECT_THAT(index.Validate(), StatusIs(absl::StatusCode::kInvalidArgument,
                                         HasSubstr("layer 4: 3 record_xxh3 entries for 4 experts")));
  index = TestIndex();
  index.layers[0].record_xxh3[1] = std::string(64, 'a');  // a sha256 in the xxh3 field
  EXPECT_THAT(index.Validate(), StatusIs(absl::StatusCode::kInvalidArgument,
                                         HasSubstr("layer 3: record_xxh3[1] must be 32 lower-case hex digits")));
  Json j = Json::parse(SerializeRankIndex(TestIndex()));
  j["layers"][0]["record_xxh3"][2] = 7;
  EXPECT_THAT(ParseJson(j), StatusIs(absl::StatusCode::kInvalidArgument,
                                     HasSubstr("rank1.json: layers[0].record_xxh3[2] is not a string")));
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

// Issue #22: offsets are uint64 from the JSON; offset + bytes must not wrap around (an
// aligned offset near UINT64_MAX would otherwise end "before" the file's size) nor leave
// off_t's range, and experts_per_layer x rec_bytes must not overflow into a match.
TEST(RankIndexTest, OffsetPlusBytesMustNotOverflow) {
  RankIndex index = TestIndex();
  index.layers[1].records.offset = std::numeric_limits<uint64_t>::max() - (kRecordAlign - 1);  // aligned
  EXPECT_THAT(index.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("rank1.json: layer 4 records"), HasSubstr(RecordFile(1, 4)),
                             HasSubstr("past the largest file offset"))));
  index = TestIndex();
  // The largest aligned off_t: fits alone, not with the records' bytes.
  constexpr uint64_t kMaxOffT = std::numeric_limits<int64_t>::max();
  index.layers[0].records.offset = kMaxOffT - (kMaxOffT % kRecordAlign);
  EXPECT_THAT(index.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank1.json: layer 3 records: offset")));
  index = TestIndex();
  index.layers[0].resident.bytes = std::numeric_limits<uint64_t>::max();
  EXPECT_THAT(index.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank1.json: layer 3 resident: offset 0")));
  // experts_per_layer x rec_bytes = 2^16 x (2^48 + 2^12) = 2^64 + 2^28 wraps to 2^28 in uint64.
  index = TestIndex();
  index.experts_per_layer = 1u << 16;
  index.layers[0].layout.rec_bytes = (uint64_t{1} << 48) + kRecordAlign;
  index.layers[0].records.bytes = uint64_t{1} << 28;
  EXPECT_THAT(index.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank1.json: layer 3: records bytes")));
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
