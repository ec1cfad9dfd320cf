// ReleaseWriter, Release and VerifyRelease on the synthetic release of test_release.h.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <limits>

#include <nlohmann/json.hpp>

#include "services/format/file_io.h"
#include "services/format/release_reader.h"
#include "services/format/release_writer.h"
#include "services/format/verify.h"
#include "tests/common/status_matchers.h"
#include "tests/format/test_release.h"

namespace nq::format {
namespace {

namespace fs = std::filesystem;
using ::nq::format::testing::FlipByte;
using ::nq::format::testing::MakeTempDir;
using ::nq::format::testing::Snapshot;
using ::nq::format::testing::TestLayout;
using ::nq::format::testing::TestManifest;
using ::nq::format::testing::WriteTestRelease;
using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

class ReleaseTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = MakeTempDir();
    dir_ = root_ + "/rel";
    WriteTestRelease(dir_);
  }
  void TearDown() override { fs::remove_all(root_); }
  std::string Path(const std::string& rel) const { return dir_ + "/" + rel; }
  std::string root_;
  std::string dir_;
};

TEST_F(ReleaseTest, WritesTheDesignLayout) {
  auto files = Snapshot(dir_);
  for (const char* f : {"manifest.json", "rank0.json", "rank1.json", "COMPLETE", "rank0/L3.bin",
                        "rank1/L4.bin", "res/rank0/L3.safetensors", "res/rank1/L4.safetensors"}) {
    EXPECT_TRUE(files.contains(f)) << f;
  }
  EXPECT_EQ(files["rank1/L4.bin"].size(), testing::kExperts * TestLayout().rec_bytes);
  EXPECT_EQ(files["rank1/L4.bin"].size() % kRecordAlign, 0u);
  for (const auto& [name, contents] : files) EXPECT_FALSE(name.ends_with(".tmp")) << name;
  // COMPLETE hashes every file but itself.
  auto complete = ParseComplete(files["COMPLETE"]);
  ASSERT_THAT(complete.status(), IsOk());
  EXPECT_EQ(complete->size(), files.size() - 1);
  for (const CompleteEntry& e : *complete) EXPECT_EQ(e.sha256, Sha256Hex(files[e.path])) << e.path;
}

TEST_F(ReleaseTest, RoundTripReadsRecords) {
  auto release = Release::Open(dir_);
  ASSERT_THAT(release.status(), IsOk());
  EXPECT_EQ(release->manifest(), TestManifest());
  EXPECT_TRUE(release->Verify().ok()) << release->Verify().ToString();
  const RecordLayout layout = TestLayout();
  for (uint32_t rank = 0; rank < testing::kTpSize; ++rank) {
    ASSERT_THAT(release->Layer(rank, 4).status(), IsOk());
    EXPECT_EQ((*release->Layer(rank, 4))->layout, layout);
    auto record = release->ReadRecord(rank, 4, 2);
    ASSERT_THAT(record.status(), IsOk());
    auto seg = layout.Unpack(*record, "down.residual");
    ASSERT_THAT(seg.status(), IsOk());
    for (size_t i = 0; i < seg->size(); ++i) {
      ASSERT_EQ((*seg)[i], std::byte((i * 7 + 2 * 13 + rank * 31 + 4 * 5 + 101) & 0xff)) << i;
    }
  }
  EXPECT_EQ(*release->ResidentPath(1, 3), Path("res/rank1/L3.safetensors"));
  EXPECT_EQ(*release->RecordPath(0, 3), Path("rank0/L3.bin"));
  EXPECT_THAT(release->ReadRecord(0, 3, testing::kExperts),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("expert 4")));
  EXPECT_THAT(release->ReadRecord(0, 5, 0),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no layer 5")));
  EXPECT_THAT(release->ReadRecord(2, 3, 0),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("not rank 2")));
}

// The writer records each record's sha256 in the index (format version 2): the streamer checks
// every read against it.
TEST_F(ReleaseTest, IndexHoldsEveryRecordsSha256) {
  auto release = Release::Open(dir_);
  ASSERT_THAT(release.status(), IsOk());
  for (uint32_t rank = 0; rank < testing::kTpSize; ++rank) {
    for (uint32_t layer : {3u, 4u}) {
      auto entry = release->Layer(rank, layer);
      ASSERT_THAT(entry.status(), IsOk());
      ASSERT_EQ((*entry)->record_sha256.size(), testing::kExperts);
      for (uint32_t e = 0; e < testing::kExperts; ++e) {
        auto record = release->ReadRecord(rank, layer, e);
        ASSERT_THAT(record.status(), IsOk());
        EXPECT_EQ((*entry)->record_sha256[e], Sha256Hex(*record)) << "rank " << rank << " layer " << layer << " expert " << e;
        EXPECT_EQ((*entry)->record_xxh3[e], Xxh3Hex(*record)) << "rank " << rank << " layer " << layer << " expert " << e;
      }
    }
  }
}

// Issue #22: no file a release names may lie outside it, through a symlink either (the index's
// paths are relative without ".."; rank_index_test covers those).
TEST_F(ReleaseTest, FilesLinkedFromOutsideTheReleaseAreRefused) {
  const std::string outside = MakeTempDir();
  fs::copy_file(Path("rank0/L3.bin"), outside + "/L3.bin");
  fs::remove(Path("rank0/L3.bin"));
  fs::create_symlink(outside + "/L3.bin", Path("rank0/L3.bin"));
  EXPECT_THAT(Release::Open(dir_).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("rank0/L3.bin resolves to"), HasSubstr("outside the release directory"))));
  EXPECT_THAT(VerifyRelease(dir_).status(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("rank0/L3.bin")));
  // A linked directory is a way out too.
  fs::remove(Path("rank0/L3.bin"));
  fs::copy_file(outside + "/L3.bin", Path("rank0/L3.bin"));
  ASSERT_THAT(Release::Open(dir_).status(), IsOk());
  fs::rename(Path("res"), outside + "/res");
  fs::create_directory_symlink(outside + "/res", Path("res"));
  EXPECT_THAT(Release::Open(dir_).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("outside the release directory")));
  // A link that stays inside the release is fine.
  fs::remove(Path("res"));
  fs::rename(outside + "/res", Path("res.real"));
  fs::create_directory_symlink("res.real", Path("res"));
  EXPECT_THAT(Release::Open(dir_).status(), IsOk());
  fs::remove_all(outside);
}

TEST_F(ReleaseTest, MissingCompleteIsRefused) {
  fs::remove(Path("COMPLETE"));
  EXPECT_THAT(Release::Open(dir_), StatusIs(absl::StatusCode::kFailedPrecondition,
                                            AllOf(HasSubstr(dir_), HasSubstr("has no COMPLETE"))));
  EXPECT_THAT(VerifyRelease(dir_),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("COMPLETE")));
}

TEST_F(ReleaseTest, ModelMismatchIsRefused) {
  auto release = Release::Open(dir_);
  ASSERT_THAT(release.status(), IsOk());
  ModelIdentity model{TestManifest().config_hash, testing::kTpSize, {3, 4}, testing::kExperts};
  EXPECT_THAT(release->CheckMatchesModel(model), IsOk());
  model.tp_size = 4;
  EXPECT_THAT(release->CheckMatchesModel(model),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr(dir_), HasSubstr("tp_size 2 (release) vs 4 (model)"))));
  model = {std::string(64, 'f'), testing::kTpSize, {3, 4}, testing::kExperts};
  EXPECT_THAT(release->CheckMatchesModel(model),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("config hash")));
}

TEST_F(ReleaseTest, MalformedManifestOrIndexIsRefused) {
  testing::WriteAll(Path("manifest.json"), "{\"format\": \"nestquant\"}");
  EXPECT_THAT(Release::Open(dir_), StatusIs(absl::StatusCode::kInvalidArgument,
                                            HasSubstr("manifest.json.version is missing")));
  const std::string other = root_ + "/other";
  WriteTestRelease(other);
  testing::WriteAll(other + "/rank1.json", "{");
  EXPECT_THAT(Release::Open(other), StatusIs(absl::StatusCode::kInvalidArgument,
                                             HasSubstr("rank1.json is not valid JSON")));
}

// Issue #22: a crafted index whose record offset wraps offset + bytes around uint64, or whose
// records run past the end of their file, is refused naming the index file, the layer and the
// records file; nothing in the release is changed, and with the index restored it opens.
TEST_F(ReleaseTest, CraftedIndexOffsetsAreRefusedAndNothingElseIsLost) {
  const std::map<std::string, std::string> before = Snapshot(dir_);
  const std::string original = testing::ReadAll(Path("rank1.json"));
  auto craft = [&](uint64_t offset) {
    nlohmann::json index = nlohmann::json::parse(original);
    for (nlohmann::json& layer : index["layers"]) {
      if (layer["layer"] == 4) layer["records"]["offset"] = offset;
    }
    testing::WriteAll(Path("rank1.json"), index.dump());
  };
  // Aligned and 4096 short of 2^64: offset + bytes wraps to a few KB, inside any file.
  craft(std::numeric_limits<uint64_t>::max() - (kRecordAlign - 1));
  EXPECT_THAT(Release::Open(dir_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("rank1.json: layer 4 records"), HasSubstr("rank1/L4.bin"),
                             HasSubstr("past the largest file offset"))));
  // One record in: the layer's records end a record past the end of the file.
  craft(TestLayout().rec_bytes);
  EXPECT_THAT(Release::Open(dir_),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr("rank 1 layer 4"), HasSubstr("rank1/L4.bin truncated"))));
  testing::WriteAll(Path("rank1.json"), original);
  EXPECT_EQ(Snapshot(dir_), before);
  auto release = Release::Open(dir_);
  ASSERT_THAT(release.status(), IsOk());
  EXPECT_THAT(release->ReadRecord(1, 4, 0).status(), IsOk());
}

TEST_F(ReleaseTest, VerifyCatchesFlippedRecordByte) {
  FlipByte(Path("rank1/L4.bin"), 3 * TestLayout().rec_bytes + 17);
  auto report = VerifyRelease(dir_);
  ASSERT_THAT(report.status(), IsOk());
  // The file, and the one record inside it that differs.
  EXPECT_THAT(report->differences,
              ElementsAre(Difference{1, 4, "rank1/L4.bin", "sha256 differs"},
                          Difference{1, 4, "rank1/L4.bin", "expert 3: record differs from its sha256 in rank1.json"}));
  EXPECT_EQ(report->ToString(),
            "rank 1 layer 4 rank1/L4.bin: sha256 differs\n"
            "rank 1 layer 4 rank1/L4.bin: expert 3: record differs from its sha256 in rank1.json\n");
}

// The streamer checks reads against the index's XXH3 entries, so nq verify checks them too: an
// entry that disagrees with a record whose file and sha256 match would refuse a good record.
TEST_F(ReleaseTest, VerifyCatchesAWrongXxh3Entry) {
  testing::EditRankIndexes(dir_, [](RankIndex& index) {
    if (index.rank == 1) index.layers[0].record_xxh3[2] = std::string(32, '0');
  });
  auto report = VerifyRelease(dir_);
  ASSERT_THAT(report.status(), IsOk());
  EXPECT_THAT(report->differences,
              ElementsAre(Difference{1, 3, "rank1/L3.bin", "expert 2: record differs from its xxh3 in rank1.json"}));
}

// Xxh3Hex is XXH3-128 in its canonical form, as `xxhsum -H2` prints it.
TEST(Xxh3HexTest, MatchesXxhsum) {
  EXPECT_EQ(Xxh3Hex({}), "99aa06d3014798d86001c324468d497f");
  EXPECT_EQ(Xxh3Hex(AsBytes(std::string("nestquant"))), "1289c8131541d911fe8d10aad6e830cf");
}

// nq verify's progress: one report per (rank, layer), every byte it hashed (records twice: as
// a file and record by record).
TEST_F(ReleaseTest, VerifyReportsEachLayerFileAndTheBytesHashed) {
  std::vector<ProgressState> progress;
  auto report = VerifyRelease(dir_, [&](const ProgressState& p) { progress.push_back(p); });
  ASSERT_THAT(report.status(), IsOk());
  auto release = Release::Open(dir_);
  ASSERT_THAT(release.status(), IsOk());
  double bytes = 0;
  int64_t layers = 0;
  for (uint32_t rank : {0u, 1u}) {
    for (uint32_t layer : {3u, 4u}) {
      auto entry = release->Layer(rank, layer);
      ASSERT_THAT(entry.status(), IsOk());
      bytes += 2.0 * static_cast<double>((*entry)->records.bytes) + static_cast<double>((*entry)->resident.bytes);
      ++layers;
    }
  }
  ASSERT_EQ(static_cast<int64_t>(progress.size()), layers);
  EXPECT_EQ(progress.back().done, layers);
  EXPECT_EQ(progress.back().total, layers);
  EXPECT_EQ(progress.back().work, bytes);
  EXPECT_EQ(progress.front().stage, "rank 0 layer 3");
}

TEST_F(ReleaseTest, VerifyCatchesFlippedResidentByte) {
  FlipByte(Path("res/rank0/L3.safetensors"), 200);
  auto report = VerifyRelease(dir_);
  ASSERT_THAT(report.status(), IsOk());
  EXPECT_THAT(report->differences,
              ElementsAre(Difference{0, 3, "res/rank0/L3.safetensors", "sha256 differs"}));
}

TEST_F(ReleaseTest, VerifyAndOpenCatchTruncation) {
  fs::resize_file(Path("rank0/L4.bin"), TestLayout().rec_bytes);
  EXPECT_THAT(Release::Open(dir_),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr("rank 0 layer 4"), HasSubstr("truncated"))));
  auto report = VerifyRelease(dir_);
  ASSERT_THAT(report.status(), IsOk());
  ASSERT_EQ(report->differences.size(), 1u);
  EXPECT_EQ(report->differences[0].rank, 0u);
  EXPECT_EQ(report->differences[0].layer, 4u);
  EXPECT_THAT(report->ToString(), HasSubstr("rank 0 layer 4 rank0/L4.bin: truncated"));
}

TEST_F(ReleaseTest, VerifyCatchesEditedManifest) {
  std::string text = testing::ReadAll(Path("manifest.json"));
  text.insert(text.size() - 1, " ");  // still valid JSON, other bytes
  testing::WriteAll(Path("manifest.json"), text);
  auto report = VerifyRelease(dir_);
  ASSERT_THAT(report.status(), IsOk());
  EXPECT_THAT(report->ToString(), HasSubstr("manifest.json: sha256 differs"));
}

TEST_F(ReleaseTest, WriterResumesAndSkipsWrittenLayers) {
  const auto before = Snapshot(dir_);
  auto writer = ReleaseWriter::Create(dir_, TestManifest());
  ASSERT_THAT(writer.status(), IsOk());
  EXPECT_FALSE(fs::exists(Path("COMPLETE")));  // in progress again
  EXPECT_THAT(*writer->HasLayer(1, 4), true);
  FlipByte(Path("rank1/L4.bin"), 5);
  EXPECT_THAT(*writer->HasLayer(1, 4), false);
  EXPECT_THAT(writer->Finish(), IsOk());  // all layers listed, COMPLETE from the index
  // Rewriting the full release restores exactly the bytes of the first write.
  WriteTestRelease(dir_);
  EXPECT_EQ(Snapshot(dir_), before);
}

TEST_F(ReleaseTest, WriterRefusesAnotherManifestAndUnfinishedRelease) {
  Manifest other = TestManifest();
  other.config_hash = std::string(64, 'e');
  EXPECT_THAT(ReleaseWriter::Create(dir_, other),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("another manifest")));
  auto writer = ReleaseWriter::Create(root_ + "/fresh", TestManifest());
  ASSERT_THAT(writer.status(), IsOk());
  EXPECT_THAT(writer->Finish(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                         HasSubstr("layer 3 of rank 0 has not been written")));
  EXPECT_THAT(Release::Open(writer->dir()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("COMPLETE")));
}

}  // namespace
}  // namespace nq::format
