// Checkpoint: single-file and sharded directories, and every index/shard consistency rule.
#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "services/model/dtype_convert.h"
#include "services/model/safetensors.h"
#include "services/model/safetensors_writer.h"
#include "tests/common/status_matchers.h"
#include "tests/model/safetensors_test_util.h"

namespace nq::model {
namespace {

namespace fs = std::filesystem;
using ::nq::model::testing::ReadFile;
using ::nq::model::testing::TempDirTest;
using ::nq::model::testing::WriteFile;
using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr char kShard1[] = "model-00001-of-00003.safetensors";
constexpr char kShard2[] = "model-00002-of-00003.safetensors";

// Three 64-byte tensors and a 192-byte one. With 128-byte shards, filled in name order:
// a, b -> shard 1; c -> shard 2 (c + d would exceed 128); d, larger than a shard -> shard 3.
SafetensorsWriter FourTensors() {
  SafetensorsWriter writer;
  for (const char* name : {"a", "b", "c"}) {
    std::vector<float> values(16);
    for (size_t i = 0; i < values.size(); ++i) values[i] = name[0] * 100.0f + i;
    EXPECT_THAT(writer.AddFloat32(name, {4, 4}, values), IsOk());
  }
  std::vector<float> big(48, 1.5f);  // 192 bytes: bigger than a shard, gets its own
  EXPECT_THAT(writer.AddFloat32("d", {48}, big), IsOk());
  return writer;
}

class CheckpointTest : public TempDirTest {
 protected:
  nlohmann::json ReadIndex() {
    return nlohmann::json::parse(ReadFile(Path(std::string(Checkpoint::kIndexFileName))));
  }
  void WriteIndex(const nlohmann::json& index) {
    WriteFile(Path(std::string(Checkpoint::kIndexFileName)), index.dump());
  }
  void WriteSharded() { ASSERT_THAT(FourTensors().WriteCheckpoint(dir(), 128), IsOk()); }
};

TEST_F(CheckpointTest, SingleFileRoundTrip) {
  ASSERT_THAT(FourTensors().WriteCheckpoint(dir()), IsOk());
  EXPECT_TRUE(fs::exists(Path("model.safetensors")));
  EXPECT_FALSE(fs::exists(Path("model.safetensors.index.json")));
  absl::StatusOr<Checkpoint> checkpoint = Checkpoint::Open(dir());
  ASSERT_THAT(checkpoint, IsOk());
  EXPECT_FALSE(checkpoint->sharded());
  EXPECT_THAT(checkpoint->Names(), ElementsAre("a", "b", "c", "d"));
  absl::StatusOr<TensorView> b = checkpoint->Find("b");
  ASSERT_THAT(b, IsOk());
  EXPECT_EQ((*ConvertToFloat32(b->dtype, b->data))[3], 'b' * 100.0f + 3);
  // The file itself opens as a checkpoint too.
  EXPECT_THAT(Checkpoint::Open(Path("model.safetensors")), IsOk());
}

TEST_F(CheckpointTest, ShardedRoundTrip) {
  WriteSharded();
  EXPECT_FALSE(fs::exists(Path("model.safetensors")));
  const nlohmann::json index = ReadIndex();
  EXPECT_EQ(index["metadata"]["total_size"], 3 * 64 + 192);
  EXPECT_EQ(index["weight_map"]["a"], kShard1);
  EXPECT_EQ(index["weight_map"]["b"], kShard1);
  EXPECT_EQ(index["weight_map"]["c"], kShard2);
  EXPECT_EQ(index["weight_map"]["d"], "model-00003-of-00003.safetensors");

  absl::StatusOr<Checkpoint> checkpoint = Checkpoint::Open(dir());
  ASSERT_THAT(checkpoint, IsOk());
  EXPECT_TRUE(checkpoint->sharded());
  EXPECT_EQ(checkpoint->shards().size(), 3u);
  EXPECT_EQ(checkpoint->size(), 4u);
  EXPECT_THAT(checkpoint->Names(), ElementsAre("a", "b", "c", "d"));
  for (const char* name : {"a", "b", "c"}) {
    absl::StatusOr<TensorView> view = checkpoint->Find(name);
    ASSERT_THAT(view, IsOk());
    EXPECT_THAT(view->shape, ElementsAre(4, 4));
    EXPECT_EQ((*ConvertToFloat32(view->dtype, view->data))[15], name[0] * 100.0f + 15);
  }
  EXPECT_EQ((*ConvertToFloat32(DType::kF32, checkpoint->Find("d")->data)),
            std::vector<float>(48, 1.5f));
  EXPECT_THAT(Checkpoint::Open(Path("model.safetensors.index.json")), IsOk());
}

std::vector<std::string> Files(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

TEST_F(CheckpointTest, RewritingLeavesOnlyTheNewCheckpoint) {
  WriteSharded();
  ASSERT_THAT(FourTensors().WriteCheckpoint(dir()), IsOk());
  EXPECT_THAT(Files(dir_), ElementsAre("model.safetensors"));
  WriteSharded();
  EXPECT_THAT(Files(dir_), ElementsAre(kShard1, kShard2, "model-00003-of-00003.safetensors",
                                       "model.safetensors.index.json"));
  ASSERT_THAT(FourTensors().WriteCheckpoint(dir(), 256), IsOk());  // two shards now
  EXPECT_THAT(Files(dir_), ElementsAre("model-00001-of-00002.safetensors",
                                       "model-00002-of-00002.safetensors",
                                       "model.safetensors.index.json"));
  absl::StatusOr<Checkpoint> checkpoint = Checkpoint::Open(dir());
  ASSERT_THAT(checkpoint, IsOk());
  EXPECT_TRUE(checkpoint->sharded());
  EXPECT_EQ(checkpoint->shards().size(), 2u);
}

TEST_F(CheckpointTest, MissingTensorIsNotFoundNamingCheckpoint) {
  WriteSharded();
  absl::StatusOr<Checkpoint> checkpoint = Checkpoint::Open(dir());
  ASSERT_THAT(checkpoint, IsOk());
  EXPECT_FALSE(checkpoint->Contains("zz"));
  EXPECT_THAT(checkpoint->Find("zz"),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("tensor 'zz' not found in checkpoint " + dir() + " (4 tensors)")));
}

TEST_F(CheckpointTest, EmptyDirectoryIsNotFound) {
  EXPECT_THAT(Checkpoint::Open(dir()),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("holds neither model.safetensors nor "
                                 "model.safetensors.index.json")));
  EXPECT_THAT(Checkpoint::Open(Path("nothing")), StatusIs(absl::StatusCode::kNotFound, HasSubstr("nothing")));
}

TEST_F(CheckpointTest, MissingShardIsNotFound) {
  WriteSharded();
  fs::remove(Path(kShard2));
  EXPECT_THAT(Checkpoint::Open(dir()),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr(std::string("shard '") + kShard2 +
                                 "' (listed for tensor 'c') does not exist")));
}

TEST_F(CheckpointTest, IndexListingNonexistentFileIsNotFound) {
  WriteSharded();
  nlohmann::json index = ReadIndex();
  index["weight_map"]["a"] = "model-typo.safetensors";
  WriteIndex(index);
  EXPECT_THAT(Checkpoint::Open(dir()),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(HasSubstr("index " + Path("model.safetensors.index.json")),
                             HasSubstr("shard 'model-typo.safetensors' (listed for tensor 'a') "
                                       "does not exist"))));
}

TEST_F(CheckpointTest, TensorMissingFromItsShardIsInvalid) {
  WriteSharded();
  nlohmann::json index = ReadIndex();
  index["weight_map"]["ghost"] = kShard1;
  WriteIndex(index);
  EXPECT_THAT(Checkpoint::Open(dir()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(std::string("maps tensor 'ghost' to shard '") + kShard1 +
                                 "', which does not hold it (no shard does)")));
}

TEST_F(CheckpointTest, TensorMappedToWrongShardIsInvalid) {
  WriteSharded();
  nlohmann::json index = ReadIndex();
  index["weight_map"]["a"] = kShard2;
  WriteIndex(index);
  EXPECT_THAT(Checkpoint::Open(dir()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(std::string("maps tensor 'a' to shard '") + kShard2 +
                                 "', which does not hold it (shard '" + kShard1 + "' does)")));
}

TEST_F(CheckpointTest, TensorInTwoShardsIsInvalid) {
  SafetensorsWriter one;
  ASSERT_THAT(one.AddFloat32("x", {1}, std::vector<float>{1}), IsOk());
  ASSERT_THAT(one.Write(Path("s1.safetensors")), IsOk());
  ASSERT_THAT(one.Write(Path("s2.safetensors")), IsOk());
  SafetensorsWriter two;
  ASSERT_THAT(two.AddFloat32("y", {1}, std::vector<float>{2}), IsOk());
  ASSERT_THAT(two.AddFloat32("x", {1}, std::vector<float>{3}), IsOk());
  ASSERT_THAT(two.Write(Path("s2.safetensors")), IsOk());
  WriteIndex({{"weight_map", {{"x", "s1.safetensors"}, {"y", "s2.safetensors"}}}});
  EXPECT_THAT(Checkpoint::Open(dir()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tensor 'x' is stored in two shards, 's1.safetensors' and "
                                 "'s2.safetensors'")));
}

TEST_F(CheckpointTest, UnlistedTensorInShardIsInvalid) {
  WriteSharded();
  nlohmann::json index = ReadIndex();
  index["weight_map"].erase("b");
  WriteIndex(index);
  EXPECT_THAT(Checkpoint::Open(dir()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(std::string("shard '") + kShard1 +
                                 "' holds tensor 'b', which the index does not list")));
}

TEST_F(CheckpointTest, MalformedIndexIsInvalid) {
  WriteSharded();
  WriteFile(Path("model.safetensors.index.json"), "{\"weight_map\": {\"a\": ");
  EXPECT_THAT(Checkpoint::Open(dir()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("index " + Path("model.safetensors.index.json") + ": "),
                             HasSubstr("parse error"))));
  WriteIndex({{"metadata", {}}});
  EXPECT_THAT(Checkpoint::Open(dir()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("expected a JSON object with a \"weight_map\" object")));
  WriteIndex({{"weight_map", nlohmann::json::object()}});
  EXPECT_THAT(Checkpoint::Open(dir()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"weight_map\" is empty")));
  WriteIndex({{"weight_map", {{"a", 3}}}});
  EXPECT_THAT(Checkpoint::Open(dir()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tensor 'a' maps to a JSON number, expected a shard file name")));
  WriteFile(Path("model.safetensors.index.json"),
            "{\"weight_map\": {\"a\": \"" + std::string(kShard1) + "\", \"a\": \"x\"}}");
  EXPECT_THAT(Checkpoint::Open(dir()), StatusIs(absl::StatusCode::kInvalidArgument,
                                                HasSubstr("duplicate key 'a' in the object at "
                                                          "'/weight_map'")));
}

TEST_F(CheckpointTest, ShardPathsMustStayInsideTheCheckpoint) {
  WriteSharded();
  for (const char* bad : {"../model-00001-of-00003.safetensors", "/etc/passwd", ""}) {
    nlohmann::json index = ReadIndex();
    index["weight_map"]["a"] = bad;
    WriteIndex(index);
    EXPECT_THAT(Checkpoint::Open(dir()),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("which is not a relative path inside the checkpoint")))
        << bad;
  }
}

TEST_F(CheckpointTest, CorruptShardReportsTheShard) {
  WriteSharded();
  const std::string shard = ReadFile(Path(kShard2));
  WriteFile(Path(kShard2), shard.substr(0, shard.size() - 1));
  EXPECT_THAT(Checkpoint::Open(dir()),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("safetensors file " + Path(kShard2) + ": tensor 'c'")));
}

}  // namespace
}  // namespace nq::model
