#include "services/format/assemble.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>

#include "services/format/release_reader.h"
#include "services/format/release_writer.h"
#include "tests/common/status_matchers.h"
#include "tests/format/test_release.h"

namespace nq::format {
namespace {

namespace fs = std::filesystem;
using ::nq::format::testing::FlipByte;
using ::nq::format::testing::MakeTempDir;
using ::nq::format::testing::Snapshot;
using ::nq::format::testing::TestManifest;
using ::nq::format::testing::WriteTestRelease;
using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Pair;

class AssembleTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = MakeTempDir();
    src_ = root_ + "/src";
    WriteTestRelease(src_, /*seed=*/1);
  }
  void TearDown() override { fs::remove_all(root_); }
  std::string root_;
  std::string src_;
};

AssembleOptions WithHook(StepHook hook) {
  AssembleOptions options;
  options.after_step = std::move(hook);
  return options;
}
AssembleOptions WithRange(uint32_t first, uint32_t last) {
  AssembleOptions options;
  options.layers = LayerRange{first, last};
  return options;
}
AssembleOptions DryRun() {
  AssembleOptions options;
  options.dry_run = true;
  return options;
}

// Counts steps; fails the `fail_at`-th one (1-based) with ABORTED.
StepHook FailAt(int fail_at, int* count, std::vector<AssembleStep>* steps = nullptr) {
  return [=](const StepEvent& event) -> absl::Status {
    if (steps != nullptr) steps->push_back(event.step);
    if (++*count == fail_at) {
      return absl::AbortedError(absl::StrCat("failpoint after ", AssembleStepName(event.step)));
    }
    return absl::OkStatus();
  };
}

TEST_F(AssembleTest, IntoEmptyDirReproducesTheSource) {
  const std::string into = root_ + "/serve";
  int count = 0;
  std::vector<AssembleStep> steps;
  AssembleOptions options = WithHook(FailAt(-1, &count, &steps));
  auto plan = Assemble(src_, into, options);
  ASSERT_THAT(plan.status(), IsOk());
  EXPECT_EQ(plan->installs.size(), 4u);
  EXPECT_TRUE(plan->complete_after);
  EXPECT_EQ(Snapshot(into), Snapshot(src_));
  // remove COMPLETE, manifest, 5 steps per (layer, rank), COMPLETE.
  ASSERT_EQ(steps.size(), 2u + 5u * 4u + 1u);
  EXPECT_EQ(steps.front(), AssembleStep::kRemoveComplete);
  EXPECT_EQ(steps[2], AssembleStep::kDropFromIndex);
  EXPECT_EQ(steps[6], AssembleStep::kWriteIndex);
  EXPECT_EQ(steps.back(), AssembleStep::kWriteComplete);
  auto release = Release::Open(into);
  ASSERT_THAT(release.status(), IsOk());
  EXPECT_TRUE(release->Verify().ok());
}

TEST_F(AssembleTest, TwiceIsANoOp) {
  const std::string into = root_ + "/serve";
  ASSERT_THAT(Assemble(src_, into).status(), IsOk());
  const auto before = Snapshot(into);
  const auto mtime = fs::last_write_time(into + "/COMPLETE");
  int count = 0;
  auto plan = Assemble(src_, into, WithHook(FailAt(-1, &count)));
  ASSERT_THAT(plan.status(), IsOk());
  EXPECT_TRUE(plan->no_op()) << plan->ToString();
  EXPECT_EQ(plan->skipped.size(), 4u);
  EXPECT_EQ(count, 0);
  EXPECT_EQ(Snapshot(into), before);
  EXPECT_EQ(fs::last_write_time(into + "/COMPLETE"), mtime);
}

TEST_F(AssembleTest, DryRunChangesNothing) {
  const std::string into = root_ + "/serve";
  auto plan = Assemble(src_, into, DryRun());
  ASSERT_THAT(plan.status(), IsOk());
  EXPECT_FALSE(fs::exists(into));
  EXPECT_THAT(plan->installs, ElementsAre(Pair(3u, 0u), Pair(3u, 1u), Pair(4u, 0u), Pair(4u, 1u)));
  EXPECT_TRUE(plan->write_manifest);
  EXPECT_THAT(plan->ToString(), HasSubstr("install layer 4 rank 1"));

  ASSERT_THAT(Assemble(src_, into, WithRange(3, 3)).status(), IsOk());
  const auto before = Snapshot(into);
  plan = Assemble(src_, into, DryRun());
  ASSERT_THAT(plan.status(), IsOk());
  EXPECT_THAT(plan->installs, ElementsAre(Pair(4u, 0u), Pair(4u, 1u)));
  EXPECT_THAT(plan->skipped, ElementsAre(Pair(3u, 0u), Pair(3u, 1u)));
  EXPECT_EQ(Snapshot(into), before);
}

// nq assemble's progress: each install is reported with its bytes; layers already installed
// count as done but skipped (they took no work).
TEST_F(AssembleTest, ProgressCountsInstallsAndBytesAndSkipsWhatIsInstalled) {
  const std::string into = root_ + "/serve";
  ASSERT_THAT(Assemble(src_, into, WithRange(3, 3)).status(), IsOk());
  std::vector<ProgressState> progress;
  AssembleOptions options;
  options.progress = [&](const ProgressState& p) { progress.push_back(p); };
  ASSERT_THAT(Assemble(src_, into, options).status(), IsOk());
  ASSERT_EQ(progress.size(), 2u);  // layer 4 on ranks 0 and 1
  uint64_t layer4_bytes = 0;
  auto release = Release::Open(src_);
  ASSERT_THAT(release.status(), IsOk());
  for (uint32_t rank : {0u, 1u}) {
    auto entry = release->Layer(rank, 4);
    ASSERT_THAT(entry.status(), IsOk());
    layer4_bytes += (*entry)->records.bytes + (*entry)->resident.bytes;
  }
  EXPECT_EQ(progress[0].done, 3);
  EXPECT_EQ(progress[0].skipped, 2);
  EXPECT_EQ(progress[0].stage, "layer 4 rank 0");
  EXPECT_EQ(progress[1].done, 4);
  EXPECT_EQ(progress[1].total, 4);
  EXPECT_EQ(progress[1].work, static_cast<double>(layer4_bytes));
}

TEST_F(AssembleTest, LayerRangesInstallPiecewise) {
  const std::string into = root_ + "/serve";
  auto plan = Assemble(src_, into, WithRange(0, 3));
  ASSERT_THAT(plan.status(), IsOk());
  EXPECT_FALSE(plan->complete_after);
  EXPECT_FALSE(fs::exists(into + "/COMPLETE"));
  EXPECT_THAT(Release::Open(into),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("COMPLETE")));
  ASSERT_THAT(Assemble(src_, into, WithRange(4, 9)).status(), IsOk());
  EXPECT_EQ(Snapshot(into), Snapshot(src_));
  EXPECT_THAT(Assemble(src_, into, WithRange(5, 9)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("selects none")));
}

// Interrupt after every step k, rerun, and compare with an uninterrupted assemble: both
// into an empty directory and over an older release of the same model.
TEST_F(AssembleTest, InterruptedAtEveryStepThenRerunIsIdentical) {
  const std::string newer = root_ + "/newer";
  WriteTestRelease(newer, /*seed=*/2);
  for (bool over_older : {false, true}) {
    SCOPED_TRACE(over_older ? "over an older release" : "into an empty directory");
    const std::string source = over_older ? newer : src_;
    const auto want = Snapshot(source);
    int total = 0;
    {
      const std::string ref = root_ + "/ref" + std::to_string(over_older);
      if (over_older) {
        ASSERT_THAT(Assemble(src_, ref).status(), IsOk());
      }
      ASSERT_THAT(Assemble(source, ref, WithHook(FailAt(-1, &total))).status(), IsOk());
      ASSERT_EQ(Snapshot(ref), want);
    }
    ASSERT_GT(total, 20);
    for (int k = 1; k <= total; ++k) {
      SCOPED_TRACE(k);
      const std::string into =
          root_ + "/run" + std::to_string(over_older) + "_" + std::to_string(k);
      if (over_older) {
        ASSERT_THAT(Assemble(src_, into).status(), IsOk());
      }
      int count = 0;
      EXPECT_THAT(Assemble(source, into, WithHook(FailAt(k, &count))),
                  StatusIs(absl::StatusCode::kAborted, HasSubstr("failpoint")));
      if (k < total) {
        EXPECT_FALSE(fs::exists(into + "/COMPLETE"));
        EXPECT_THAT(Release::Open(into).status(),
                    StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("COMPLETE")));
      }
      ASSERT_THAT(Assemble(source, into).status(), IsOk());
      EXPECT_EQ(Snapshot(into), want);
    }
  }
}

TEST_F(AssembleTest, ReinstallsAFileWithTrailingBytes) {
  const std::string into = root_ + "/serve";
  ASSERT_THAT(Assemble(src_, into).status(), IsOk());
  testing::WriteAll(into + "/rank1/L3.bin", testing::ReadAll(into + "/rank1/L3.bin") + "junk");
  auto report = Release::Open(into, OpenOptions{.check_sizes = false}).value().Verify();
  EXPECT_THAT(report.ToString(), HasSubstr("rank 1 layer 3 rank1/L3.bin: size"));
  auto plan = Assemble(src_, into);
  ASSERT_THAT(plan.status(), IsOk());
  EXPECT_THAT(plan->installs, ElementsAre(Pair(3u, 1u)));
  EXPECT_EQ(Snapshot(into), Snapshot(src_));
}

TEST_F(AssembleTest, RefusesAnotherModelAndIncompleteSource) {
  Manifest other = TestManifest();
  other.config_hash = std::string(64, 'e');
  const std::string into = root_ + "/serve";
  ASSERT_THAT(ReleaseWriter::Create(into, other).status(), IsOk());
  EXPECT_THAT(Assemble(src_, into),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("config hash differs")));

  fs::remove(src_ + "/COMPLETE");
  EXPECT_THAT(Assemble(src_, root_ + "/other"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("has no COMPLETE")));
}

TEST_F(AssembleTest, CorruptSourceIsDataLoss) {
  FlipByte(src_ + "/rank0/L4.bin", 100);
  EXPECT_THAT(Assemble(src_, root_ + "/serve"),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("rank 0 layer 4")));
  FlipByte(src_ + "/rank0/L4.bin", 100);
  FlipByte(src_ + "/res/rank1/L3.safetensors", 100);
  EXPECT_THAT(Assemble(src_, root_ + "/serve2"),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("rank 1 layer 3")));
}

TEST(LayerRangeTest, Parse) {
  auto r = ParseLayerRange("3-60");
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_EQ(r->first, 3u);
  EXPECT_EQ(r->last, 60u);
  EXPECT_EQ(ParseLayerRange("7")->last, 7u);
  EXPECT_THAT(ParseLayerRange("9-3"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'9-3'")));
  EXPECT_THAT(ParseLayerRange("a-b"), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  EXPECT_THAT(ParseLayerRange("1-2-3"), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
}

}  // namespace
}  // namespace nq::format
