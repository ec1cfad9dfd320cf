#include "services/format/manifest.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "tests/common/status_matchers.h"
#include "tests/format/test_release.h"

namespace nq::format {
namespace {

using ::nq::format::testing::TestManifest;
using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using Json = nlohmann::json;

Json ManifestJson() { return Json::parse(SerializeManifest(TestManifest())); }

TEST(ManifestTest, RoundTripIsDeterministic) {
  const std::string text = SerializeManifest(TestManifest());
  auto parsed = ParseManifest(text);
  ASSERT_THAT(parsed.status(), IsOk());
  EXPECT_EQ(*parsed, TestManifest());
  EXPECT_EQ(SerializeManifest(*parsed), text);
}

TEST(ManifestTest, MalformedInputsNameTheField) {
  EXPECT_THAT(ParseManifest("{not json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not valid JSON")));
  EXPECT_THAT(ParseManifest("[]"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("JSON object")));

  Json j = ManifestJson();
  j.erase("config_hash");
  EXPECT_THAT(ParseManifest(j.dump()), StatusIs(absl::StatusCode::kInvalidArgument,
                                                HasSubstr("manifest.json.config_hash is missing")));

  j = ManifestJson();
  j["tp_size"] = "2";
  EXPECT_THAT(ParseManifest(j.dump()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tp_size must be a non-negative integer")));

  j = ManifestJson();
  j["layers"][1]["rotation"].erase("sign_seed");
  EXPECT_THAT(ParseManifest(j.dump()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("layers[1].rotation.sign_seed is missing")));

  j = ManifestJson();
  j["codec"] = "scalar";
  EXPECT_THAT(ParseManifest(j.dump()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("codec must be an object")));
}

TEST(ManifestTest, VersionAndFormatMismatch) {
  Json j = ManifestJson();
  // Newer than the newest version this build reads (kLowRankFormatVersion, issue #16).
  j["version"] = kLowRankFormatVersion + 1;
  j.erase("layers");  // a newer release is refused for its version, not a field
  EXPECT_THAT(ParseManifest(j.dump()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(absl::StrCat("version ", kLowRankFormatVersion + 1, " is not supported"))));
  // Version 3 is version 2 with low-rank corrections, and only with them.
  j = ManifestJson();
  j["version"] = kLowRankFormatVersion;
  EXPECT_THAT(ParseManifest(j.dump()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("version 3 lacks codec.params.lowrank")));
  // An older release (version 1: no per-record checksums) is told how to move on.
  j = ManifestJson();
  j["version"] = 1;
  EXPECT_THAT(ParseManifest(j.dump()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("manifest.json: format version 1 is not supported"),
                             HasSubstr("re-encode the release with `nq encode`"))));
  j = ManifestJson();
  j["format"] = "gguf";
  EXPECT_THAT(ParseManifest(j.dump()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("format is 'gguf'")));
}

TEST(ManifestTest, SemanticRules) {
  Manifest m = TestManifest();
  m.layers[0].ranking = {0, 1, 1, 2};
  EXPECT_THAT(m.Validate(), StatusIs(absl::StatusCode::kInvalidArgument,
                                     HasSubstr("layer 3: ranking is not a permutation")));
  m = TestManifest();
  m.layers[1].fixed_4bit = {4};
  EXPECT_THAT(m.Validate(), StatusIs(absl::StatusCode::kInvalidArgument,
                                     HasSubstr("fixed_4bit expert 4 is out of range")));
  m = TestManifest();
  m.layers[0].rotation.hadamard_width = 96;
  EXPECT_THAT(m.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("96 is not a power of two")));
  m = TestManifest();
  m.layers[1].layer = 3;
  EXPECT_THAT(m.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("strictly increasing")));
}

TEST(ManifestTest, CheckMatchesModelListsEveryDifference) {
  ModelIdentity model{std::string(64, 'a'), testing::kTpSize, {3, 4}, 4};
  EXPECT_THAT(CheckManifestMatchesModel(TestManifest(), model), IsOk());
  model.config_hash = std::string(64, 'b');
  model.moe_layer_ids = {3, 4, 5};
  EXPECT_THAT(CheckManifestMatchesModel(TestManifest(), model),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("does not match the model"), HasSubstr("config hash"),
                             HasSubstr("MoE layers [3,4] (release) vs [3,4,5] (model)"))));
}

}  // namespace
}  // namespace nq::format
